"""Text into a tokens dataset: the one conversion behind `convert text` and `data.source=hf:`.

A `TextConversion` says what to read (files, directories or recursive globs: one file = one
document, a .jsonl or .parquet file one document per record or row; or the rows of a
Hugging Face `datasets` dataset, data/hf_datasets.py), how a record reads (`format`: whole
text, an instruction's prompt and response, or a chat through its template,
data/conversations.py), the tokenizer (data/tokenizing.py) and where the dataset goes.
`convert_text` tokenizes it into one stream cut into fixed-size records, written as
ArrayRecord shards with their manifest (data/writing.py); instructions and chats also keep
a mask of the tokens to learn.

The settings' `names` say how errors name them: convert's flags (`--field`) or a run's
config keys (`data.hf_field`), so each user reads the words they typed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from paisoar_jax import output
from paisoar_jax.data import conversations, hf_datasets, preferences
from paisoar_jax.data.tokenizing import Tokenizer, load_tokenizer, tokenize
from paisoar_jax.data.writing import (
    DOCUMENT_INDEX,
    TOKEN_WRITER_OPTIONS,
    staged_output,
    tokens_manifest,
    write_manifest,
    write_shards,
)
from paisoar_jax.errors import FLAG_NAMES, SettingNames, UserError

DEFAULT_RECORD_TOKENS = 16384
RECORD_SUFFIXES = (".jsonl", ".parquet")  # files of records; any other file is one document


@dataclasses.dataclass(frozen=True)
class TextConversion:
    """What `convert_text` reads, how it reads and tokenizes it, and where it writes."""

    output: pathlib.Path
    input: tuple[str, ...] = ()  # files, directories or (recursive) globs; or else
    from_hf: pathlib.Path | None = None  # a Hugging Face datasets dataset, its `split`
    split: str = "train"
    tokenizer: str = "byte"  # byte, a tokenizers JSON file or an HF model directory
    eos: str | None = None  # the end-of-document token (None: the one the tokenizer declares)
    record_tokens: int = DEFAULT_RECORD_TOKENS
    format: str = "text"  # one of conversations.FORMATS
    field: str = "text"  # format text: a record's text
    prompt_field: str = "prompt"  # format instruction
    response_field: str = "response"
    messages_field: str = "messages"  # format chat
    shards: int = 1
    overwrite: bool = False  # replace a non-empty output directory
    progress: bool = True  # a progress bar on a terminal
    names: SettingNames = FLAG_NAMES  # how errors name these settings

    def __post_init__(self):
        if isinstance(self.input, str):  # one pattern, not its characters
            object.__setattr__(self, "input", (self.input,))


def convert_text(conversion: TextConversion) -> str:
    """Tokenizes the conversion's input into a tokens dataset; returns the summary line."""
    names = conversion.names
    for setting in ("record_tokens", "shards"):
        value = getattr(conversion, setting)
        if value < 1:
            raise UserError(f"{names(setting)} must be at least 1, got {value}")
    if bool(conversion.input) == (conversion.from_hf is not None):
        raise UserError(f"give {names('input')} or {names('from_hf')}, one of them")
    files = expand_inputs(conversion.input, names) if conversion.input else []
    tokenizer = load_tokenizer(conversion.tokenizer, conversion.eos, names)
    template = None
    if conversion.format == "preference" and tokenizer.model is not None:
        # chat pairs render through the template; text pairs need none
        with contextlib.suppress(UserError):
            template = conversations.ChatTemplate(tokenizer.path, names)
    if conversion.format == "chat":
        if tokenizer.model is None:
            raise UserError(
                f"{names('format', 'chat')} needs a tokenizer with a chat template, not byte"
            )
        template = conversations.ChatTemplate(tokenizer.path, names)
    masked = conversion.format != "text"  # instructions and chats: the tokens to learn marked
    dtype = np.dtype("<u2" if tokenizer.vocab_size <= 1 << 16 else "<u4")
    record_tokens = conversion.record_tokens
    with staged_output(pathlib.Path(conversion.output), conversion.overwrite) as staging:
        # The stream goes to disk first: shard sizes depend on the total, known only at the end.
        stream_path, mask_path = staging / "stream.tmp", staging / "mask.tmp"
        starts, learned_count, token_count = [], 0, 0
        with open(stream_path, "wb") as stream, open(mask_path, "wb") as mask_stream:
            for tokens, mask in token_documents(files, conversion, tokenizer, template):
                stream.write(tokens.astype(dtype).tobytes())
                if masked:
                    mask_stream.write(mask.astype(np.uint8).tobytes())
                starts.append(token_count)
                token_count += len(tokens)
                learned_count += int(mask.sum()) if masked else 0
        if token_count == len(starts):
            raise UserError(f"every input document is empty ({len(starts)} documents)")
        if masked and learned_count == 0:
            raise UserError(f"no record has a response token to learn ({len(starts)} records)")
        stream_tokens = np.memmap(stream_path, dtype, "r")
        mask_bytes = np.memmap(mask_path, np.uint8, "r") if masked else None
        contents = (
            stream_tokens[start : start + record_tokens].tobytes()
            + (mask_bytes[start : start + record_tokens].tobytes() if masked else b"")
            for start in range(0, token_count, record_tokens)
        )
        record_count = -(-token_count // record_tokens)
        shards = write_shards(
            staging, "tokens", contents, record_count, conversion.shards, TOKEN_WRITER_OPTIONS
        )
        del contents, stream_tokens, mask_bytes
        stream_path.unlink()
        mask_path.unlink()
        first = 0
        for shard in shards:
            stop = first + shard["records"]
            shard["tokens"] = min(stop * record_tokens, token_count) - first * record_tokens
            first = stop
        np.save(staging / DOCUMENT_INDEX, np.asarray(starts, np.int64))
        manifest = tokens_manifest(staging, tokenizer, dtype, record_tokens, starts, shards)
        if masked:
            manifest |= {"loss_mask": True, "learned_tokens": learned_count}
        if conversion.format == "preference":  # documents 2i, 2i + 1: pair i (preferences.py)
            manifest |= {"preference_pairs": len(starts) // 2}
        write_manifest(staging, manifest)
    learned = f" ({learned_count} of them to learn)" if masked else ""
    return (
        f"wrote {len(starts)} documents, {token_count} tokens{learned} "
        f"in {len(shards)} shards to {conversion.output}"
    )


def token_documents(
    files: list[pathlib.Path], conversion: TextConversion, tokenizer: Tokenizer, template
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(token ids, learned) of every document, its end-of-document token included.

    A preference record is two documents (data/preferences.py); any other record or file
    one, its pieces tokenized one by one.
    """
    if conversion.format == "preference":
        for record, where in input_records(files, conversion):
            yield from preferences.preference_documents(record, tokenizer, template, where)
        return
    masked = conversion.format != "text"
    for pieces, where in input_pieces(files, conversion, template):
        parts = [tokenize(tokenizer, data, where) for data, _ in pieces]
        flags = [
            np.full(len(part), learned) for part, (_, learned) in zip(parts, pieces, strict=True)
        ]
        # The end-of-document token is learned after a learned piece (a response)
        tokens = np.concatenate([*parts, [tokenizer.eos_id]])
        yield tokens, np.concatenate([*flags, [pieces[-1][1] or not masked]])


def input_records(
    files: list[pathlib.Path], conversion: TextConversion
) -> Iterator[tuple[Any, str]]:
    """(record, where) of every record of the files or of the dataset."""
    if conversion.from_hf is not None:
        yield from hf_datasets.rows(conversion.from_hf, conversion.split, conversion.names)
        return
    for path in output.file_progress(files, "tokenizing", conversion.progress):
        if path.suffix not in RECORD_SUFFIXES:
            setting = conversion.names("format", conversion.format)
            raise UserError(f"{setting} reads .jsonl or .parquet records, not {path}")
        yield from _rows(path, None, conversion.names)


def input_pieces(
    files: list[pathlib.Path], conversion: TextConversion, template
) -> Iterator[tuple[list[tuple[bytes, bool]], str]]:
    """([(UTF-8 bytes, learned), ...], where) of every document: the files' or the dataset's."""
    if conversion.from_hf is not None:
        rows = hf_datasets.rows(conversion.from_hf, conversion.split, conversion.names)
        yield from record_pieces(rows, conversion, template)
        return
    for path in output.file_progress(files, "tokenizing", conversion.progress):
        yield from document_pieces(path, conversion, template)


def document_pieces(path: pathlib.Path, conversion: TextConversion, template) -> Iterator:
    """([(UTF-8 bytes, learned), ...], where) of each document of a file, by its format."""
    if conversion.format == "text" and path.suffix not in RECORD_SUFFIXES:
        for data, where in documents(path, conversion.field, conversion.names):
            yield [(data, True)], where
        return
    if path.suffix not in RECORD_SUFFIXES:
        setting = conversion.names("format", conversion.format)
        raise UserError(f"{setting} reads .jsonl or .parquet records, not {path}")
    columns = [conversion.field] if conversion.format == "text" else None
    yield from record_pieces(_rows(path, columns, conversion.names), conversion, template)


def record_pieces(records: Iterator, conversion: TextConversion, template) -> Iterator:
    """([(UTF-8 bytes, learned), ...], where) of each document of each (record, where).

    A record is one document; a chat whose template rewrites its earlier turns, one per
    assistant turn (conversations.ChatTemplate.documents).
    """
    names = conversion.names
    for record, where in records:
        if conversion.format == "text":
            text = conversations.text_field(record, conversion.field, where, names("field"))
            documents = [[(text, True)]]
        elif conversion.format == "instruction":
            fields = (conversion.prompt_field, conversion.response_field)
            documents = [conversations.instruction_pieces(record, fields, where, names)]
        else:
            documents = template.documents(record, conversion.messages_field, where)
        for pieces in documents:
            yield [(text.encode("utf-8"), learned) for text, learned in pieces], where


def documents(
    path: pathlib.Path, field: str, names: SettingNames = FLAG_NAMES
) -> Iterator[tuple[bytes, str]]:
    """(UTF-8 bytes, where) of each document of a file.

    A .jsonl or .parquet file holds one per record or row (its `field`); any other file is
    one document.
    """
    if path.suffix not in RECORD_SUFFIXES:
        try:
            yield path.read_bytes(), str(path)
        except OSError as error:
            raise UserError(f"cannot read {path}: {error.strerror}") from None
        return
    for record, where in _rows(path, [field], names):
        yield conversations.text_field(record, field, where, names("field")).encode(), where


def _rows(
    path: pathlib.Path, columns: list[str] | None, names: SettingNames
) -> Iterator[tuple[Any, str]]:
    """(record, where) of each record of a .jsonl or row of a .parquet file."""
    if path.suffix == ".parquet":
        return conversations.parquet_rows(path, columns, names)
    return conversations.json_rows(path)


def files_under(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files below a directory at any depth, skipping hidden ones (.git and the like)."""
    return [
        path
        for path in directory.rglob("*")
        if path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    ]


def expand_inputs(patterns: Sequence[str], names: SettingNames = FLAG_NAMES) -> list[pathlib.Path]:
    """The sorted, deduplicated files named by files, directories or (recursive) globs."""
    found: set[pathlib.Path] = set()
    for pattern in patterns:
        matched = []
        for name in [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True):
            path = pathlib.Path(name)
            matched += files_under(path) if path.is_dir() else [path]
        if not matched:
            raise UserError(
                f"{names('input', pattern)}: no such file, or no files under or matching it"
            )
        found.update(pathlib.Path(os.path.abspath(path)) for path in matched)
    return sorted(found)
