"""`python -m paisoar_jax.convert text|images|verify|hf-import|hf-export ...`: datasets, models.

`text` tokenizes files (one file = one document, each followed by the end-of-document id;
a .jsonl or .parquet file holds one document per record or row, its `--field`; `--from-hf`
reads the rows of a Hugging Face `datasets` dataset instead, tools/hf/datasets.py) into one
stream cut into fixed-size records; `images` packs a class-per-folder image tree
into labelled records; `verify` checks a dataset's shards against its manifest. The formats
and their readers are in `paisoar_jax.data.records`. `hf-import` and `hf-export` carry
GPT-2 and Llama weights between Hugging Face's format and ours (paisoar_jax/tools/hf/).

Inputs are files, directories (every non-hidden file below them) or recursive globs. The
`byte` tokenizer stores each file's raw UTF-8 bytes (vocab 256) and uses 0 as the
end-of-document id: text never contains NUL, so a file that does is rejected as binary.
A `tokenizers` JSON file ends documents with the end-of-sequence token its model directory
declares (tokenizer_config.json's eos_token, else generation_config.json's or config.json's
eos_token_id), or the one `--eos` names; only a bare tokenizer.json falls back to the first
of EOS_NAMES it has.

The same inputs give byte-identical output: inputs are sorted and the manifest holds no
timestamps or absolute paths. A dataset is built in a hidden sibling directory and renamed
into place only when complete, so a failed or interrupted run leaves no half dataset.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from paisoar_jax import output
from paisoar_jax.data import records
from paisoar_jax.data.tokenizing import load_tokenizer, tokenize
from paisoar_jax.data.writing import (
    DOCUMENT_INDEX,
    IMAGE_WRITER_OPTIONS,
    TOKEN_WRITER_OPTIONS,
    staged_output,
    tokens_manifest,
    write_manifest,
    write_shards,
)
from paisoar_jax.errors import UserError
from paisoar_jax.tools import conversations, hf
from paisoar_jax.tools.cli import exit_status
from paisoar_jax.tools.hf import datasets as hf_datasets

PROGRAM = "paisoar_jax.convert"
DEFAULT_RECORD_TOKENS = 16384
SHOWN_SKIPPED = 3


def documents(path: pathlib.Path, field: str) -> Iterator[tuple[bytes, str]]:
    """(UTF-8 bytes, where) of each document of a file.

    A .jsonl or .parquet file holds one per record or row (its `field`); any other file is
    one document.
    """
    if path.suffix not in (".jsonl", ".parquet"):
        try:
            yield path.read_bytes(), str(path)
        except OSError as error:
            raise UserError(f"cannot read {path}: {error.strerror}") from None
        return
    for record, where in _rows(path, [field]):
        yield conversations.text_field(record, field, where).encode("utf-8"), where


def _rows(path: pathlib.Path, columns: list[str] | None) -> Iterator[tuple[Any, str]]:
    """(record, where) of each record of a .jsonl or row of a .parquet file."""
    if path.suffix == ".parquet":
        return conversations.parquet_rows(path, columns)
    return conversations.json_rows(path)


def document_pieces(path: pathlib.Path, args: argparse.Namespace, template) -> Iterator:
    """([(UTF-8 bytes, learned), ...], where) of each document of a file, by --format."""
    if args.format == "text" and path.suffix not in (".jsonl", ".parquet"):
        for data, where in documents(path, args.field):
            yield [(data, True)], where
        return
    if path.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"--format {args.format} reads .jsonl or .parquet records, not {path}")
    columns = [args.field] if args.format == "text" else None
    yield from record_pieces(_rows(path, columns), args, template)


def record_pieces(records: Iterator, args: argparse.Namespace, template) -> Iterator:
    """([(UTF-8 bytes, learned), ...], where) of each (record, where), by --format."""
    for record, where in records:
        if args.format == "text":
            pieces = [(conversations.text_field(record, args.field, where), True)]
        elif args.format == "instruction":
            fields = (args.prompt_field, args.response_field)
            pieces = conversations.instruction_pieces(record, *fields, where)
        else:
            pieces = template.pieces(record, args.messages_field, where)
        yield [(text.encode("utf-8"), learned) for text, learned in pieces], where


def input_pieces(files: list[pathlib.Path], args: argparse.Namespace, template) -> Iterator:
    """The pieces of every document: of the files, or of the rows of --from-hf's dataset."""
    if args.from_hf is not None:
        rows = hf_datasets.rows(args.from_hf, args.split)
        yield from record_pieces(rows, args, template)
        return
    for path in progress(files, "tokenizing", args.progress):
        yield from document_pieces(path, args, template)


def files_under(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files below a directory at any depth, skipping hidden ones (.git and the like)."""
    return [
        path
        for path in directory.rglob("*")
        if path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    ]


def expand_inputs(patterns: Sequence[str]) -> list[pathlib.Path]:
    """The sorted, deduplicated files named by files, directories or (recursive) globs."""
    found: set[pathlib.Path] = set()
    for pattern in patterns:
        matched = []
        for name in [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True):
            path = pathlib.Path(name)
            matched += files_under(path) if path.is_dir() else [path]
        if not matched:
            raise UserError(f"--input {pattern}: no such file, or no files under or matching it")
        found.update(pathlib.Path(os.path.abspath(path)) for path in matched)
    return sorted(found)


def progress(items: Sequence, description: str, enabled: bool) -> Iterator:
    """A tqdm bar on stderr, shown only on a terminal and when enabled."""
    from tqdm import tqdm

    return tqdm(
        items,
        desc=description,
        unit="file",
        file=sys.stderr,
        disable=None if enabled and output.shows_progress() else True,
    )


def convert_text(args: argparse.Namespace) -> str:
    """Tokenizes the input files into a tokens dataset; returns the summary line."""
    if args.record_tokens < 1:
        raise UserError(f"--record-tokens must be at least 1, got {args.record_tokens}")
    files = expand_inputs(args.input) if args.input else []
    tokenizer = load_tokenizer(args.tokenizer, args.eos)
    template = None
    if args.format == "chat":
        if tokenizer.model is None:
            raise UserError("--format chat needs a tokenizer with a chat template, not byte")
        template = conversations.ChatTemplate(tokenizer.path)
    masked = args.format != "text"  # instructions and chats: the tokens to learn marked
    dtype = np.dtype("<u2" if tokenizer.vocab_size <= 1 << 16 else "<u4")
    record_tokens = args.record_tokens
    with staged_output(pathlib.Path(args.output), args.overwrite) as staging:
        # The stream goes to disk first: shard sizes depend on the total, known only at the end.
        stream_path, mask_path = staging / "stream.tmp", staging / "mask.tmp"
        starts, learned_count, token_count = [], 0, 0
        with open(stream_path, "wb") as stream, open(mask_path, "wb") as mask_stream:
            for pieces, where in input_pieces(files, args, template):
                parts = [tokenize(tokenizer, data, where) for data, _ in pieces]
                flags = [
                    np.full(len(part), learned)
                    for part, (_, learned) in zip(parts, pieces, strict=True)
                ]
                # The end-of-document token is learned after a learned piece (a response)
                tokens = np.concatenate([*parts, [tokenizer.eos_id]])
                mask = np.concatenate([*flags, [pieces[-1][1] or not masked]])
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
            staging, "tokens", contents, record_count, args.shards, TOKEN_WRITER_OPTIONS
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
        write_manifest(staging, manifest)
    learned = f" ({learned_count} of them to learn)" if masked else ""
    return (
        f"wrote {len(starts)} documents, {token_count} tokens{learned} "
        f"in {len(shards)} shards to {args.output}"
    )


def convert_images(args: argparse.Namespace) -> str:
    """Packs a class-per-folder image tree into an images dataset; returns the summary line."""
    directory = pathlib.Path(args.input)
    classes, files, skipped = records.scan_image_folder(directory)
    if skipped:
        names = [str(path.relative_to(directory)) for path in skipped[:SHOWN_SKIPPED]]
        names += ["..."] if len(skipped) > SHOWN_SKIPPED else []
        output.warning(
            f"skipped {len(skipped)} unreadable images: {', '.join(names)}", program=PROGRAM
        )
    if not files:
        raise UserError(f"{directory} has no readable .jpg/.jpeg/.png images")
    contents = (
        np.array(label, records.LABEL_DTYPE).tobytes() + path.read_bytes()
        for path, label in progress(files, "packing", args.progress)
    )
    with staged_output(pathlib.Path(args.output), args.overwrite) as staging:
        shards = write_shards(
            staging, "images", contents, len(files), args.shards, IMAGE_WRITER_OPTIONS
        )
        manifest = {
            "format": records.IMAGES_FORMAT,
            "version": records.FORMAT_VERSION,
            "classes": classes,
            "count": len(files),
            "skipped": len(skipped),
            "shards": shards,
        }
        write_manifest(staging, manifest)
    return (
        f"wrote {len(files)} images of {len(classes)} classes "
        f"({len(skipped)} unreadable skipped) in {len(shards)} shards to {args.output}"
    )


def verify_dataset(args: argparse.Namespace) -> str:
    """Checks a dataset's manifest, shard sizes, record counts and hashes; returns the OK line."""
    directory = pathlib.Path(args.directory)
    try:
        found = json.loads((directory / records.MANIFEST_NAME).read_text()).get("format")
    except Exception:
        found = None  # TokenRecords below reports what exactly is wrong with the manifest.
    reader = (records.ImageRecords if found == records.IMAGES_FORMAT else records.TokenRecords)(
        directory
    )
    reader.verify()
    shards = len(reader.shard_paths)
    return f"OK: {directory}: {len(reader)} records in {shards} shards match the manifest"


def _import_hf(args: argparse.Namespace) -> str:
    """hf-import, in every process of a launched run (each builds only its devices' shards)."""
    from paisoar_jax import distributed
    from paisoar_jax.config import DistributedConfig

    distributed.initialize(DistributedConfig(), program=PROGRAM)  # the launcher's, if any
    return hf.hf_import(args.input, args.output, args.adapter)


def _add_hf_commands(commands) -> None:
    """The `hf-import` and `hf-export` subcommands: Hugging Face checkpoints in and out."""
    hf_in = commands.add_parser("hf-import", help="a Hugging Face GPT-2 or Llama, as params")
    hf_in.add_argument("--input", required=True, metavar="HF_DIR", type=pathlib.Path)
    hf_in.add_argument("--output", required=True, metavar="DIR", type=pathlib.Path)
    hf_in.add_argument(
        "--adapter",
        metavar="PEFT_DIR",
        type=pathlib.Path,
        help="a PEFT LoRA adapter of that model, imported to train on (lora.* in config.yaml)",
    )
    hf_in.set_defaults(handler=_import_hf)
    hf_out = commands.add_parser("hf-export", help="a run's params as a Hugging Face model")
    hf_out.add_argument("source", metavar="RUN_DIR_OR_EXPORT", type=pathlib.Path)
    hf_out.add_argument("--output", required=True, metavar="HF_DIR", type=pathlib.Path)
    form = hf_out.add_mutually_exclusive_group()
    form.add_argument(
        "--peft",
        dest="form",
        action="store_const",
        const="peft",
        default="model",
        help="a LoRA run's adapters alone, as a PEFT adapter over the base model",
    )
    form.add_argument(
        "--merged",
        dest="form",
        action="store_const",
        const="merged",
        help="a LoRA run's model with its adapters folded into the weights",
    )
    hf_out.set_defaults(handler=lambda args: hf.hf_export(args.source, args.output, args.form))


def build_parser() -> argparse.ArgumentParser:
    """The `text`, `images`, `verify`, `hf-import` and `hf-export` subcommands."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description="Build ArrayRecord datasets.")
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("text", help="tokenize text files into a tokens dataset")
    inputs = text.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input", nargs="+", metavar="FILES_OR_GLOB")
    inputs.add_argument(
        "--from-hf",
        type=pathlib.Path,
        metavar="DATASET",
        help="a Hugging Face datasets directory (save_to_disk) or local data files it loads",
    )
    text.add_argument("--split", default="train", help="--from-hf: the split of a DatasetDict")
    text.add_argument(
        "--tokenizer", default="byte", help="byte, a tokenizers JSON file or an HF model directory"
    )
    text.add_argument(
        "--eos",
        metavar="TOKEN",
        help="the end-of-document token (default: the one the tokenizer's directory declares)",
    )
    text.add_argument("--record-tokens", type=int, default=DEFAULT_RECORD_TOKENS)
    text.add_argument(
        "--field", default="text", help=".jsonl and .parquet inputs: the text's field or column"
    )
    text.add_argument(
        "--format",
        choices=conversations.FORMATS,
        default="text",
        help="text: whole documents, all learned; instruction: prompt and response fields, "
        "the prompt masked from the loss; chat: messages rendered with the tokenizer's chat "
        "template, the assistant turns learned",
    )
    text.add_argument("--prompt-field", default="prompt", help="--format instruction")
    text.add_argument("--response-field", default="response", help="--format instruction")
    text.add_argument("--messages-field", default="messages", help="--format chat")
    text.set_defaults(handler=convert_text)
    images = commands.add_parser("images", help="pack a DIR/CLASS/*.jpg tree into a dataset")
    images.add_argument("--input", required=True, metavar="DIR")
    images.set_defaults(handler=convert_images)
    for command in (text, images):
        command.add_argument("--output", required=True, metavar="DIR")
        command.add_argument("--shards", type=int, default=1)
        command.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
        command.add_argument("--no-progress", dest="progress", action="store_false")
    _add_hf_commands(commands)
    verify = commands.add_parser("verify", help="check a dataset against its manifest")
    verify.add_argument("directory", metavar="DIR")
    verify.set_defaults(handler=verify_dataset)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)

    def work() -> None:
        if getattr(args, "shards", 1) < 1:
            raise UserError(f"--shards must be at least 1, got {args.shards}")
        summary = args.handler(args)
        if summary:  # empty on the other processes of a multi-process import
            output.result(f"{PROGRAM}: {summary}")  # the tool's product, in every mode

    return exit_status(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())
