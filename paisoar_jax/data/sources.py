"""Token sources: random-access datasets of fixed-length windows for grain.

`embedded` reads the Python standard library's own source files byte-level (vocab 256): a
real corpus of about 11 MB on every machine, with nothing to download. Files are assigned to
the train or eval split by a hash of their path, so the split is stable; eval reads the first
EMBEDDED_EVAL_BYTES of its files (every eval reads all of its split: a few seconds on a
laptop's CPU, not the half-minute the whole 5% would take each time). `synthetic` makes
random tokens at full speed, for benchmarks. `arrayrecord:<dir or glob>` reads a dataset
written by `python -m paisoar_jax.convert text`, packed into windows with no padding; its
last `data.eval_fraction` of windows is held out for eval. `hf:<path>` is a Hugging Face
`datasets` directory or local data files, tokenized once into a cache (`hf_cache_directory`;
the language-model task converts it when it opens its sources, data/hf_sources.py) and
then read as an arrayrecord dataset.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pathlib
import sysconfig
import zlib
from typing import Any

import numpy as np

from paisoar_jax.config import DataConfig, LanguageModelConfig
from paisoar_jax.data import documents
from paisoar_jax.data.preferences import PreferenceWindows
from paisoar_jax.data.records import (
    EOS_DECLARING_FILES,
    MANIFEST_NAME,
    PackedWindows,
    TokenRecords,
    file_sha256,
)
from paisoar_jax.errors import UserError, one_line_errors

SKIPPED_DIRECTORIES = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__"}
SYNTHETIC_WINDOWS = 1 << 30
EMBEDDED_EVAL_BYTES = 96 * 1024  # about 750 windows of the default 128 tokens
SYNTHETIC_EVAL_WINDOWS = 256  # a synthetic eval set is finite: every eval reads all of it


def embedded_corpus(eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) byte tokens of the standard library's .py files, split by path hash."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[bytes]] = {"train": [], "eval": []}
    paths = []
    for directory, subdirectories, files in os.walk(root):
        # Pruned, not filtered: site-packages (torch and all) is never walked.
        subdirectories[:] = [name for name in subdirectories if name not in SKIPPED_DIRECTORIES]
        paths += [pathlib.Path(directory, name) for name in files if name.endswith(".py")]
    for path in sorted(paths):
        relative = path.relative_to(root)
        bucket = zlib.crc32(relative.as_posix().encode()) % 10_000
        parts["eval" if bucket < eval_fraction * 10_000 else "train"].append(path.read_bytes())
    train, held_out = b"".join(parts["train"]), b"".join(parts["eval"])[:EMBEDDED_EVAL_BYTES]
    return tuple(np.frombuffer(text, dtype=np.uint8) for text in (train, held_out))


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens (inputs plus the shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int32)

    def read_batch(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int32: the windows at `indices`, in one gather."""
        positions = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return self.tokens[positions].astype(np.int32)


class SyntheticWindows:
    """Uniformly random token windows, reproducible per index."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = SYNTHETIC_WINDOWS):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read_batch(np.array([index]))[0]

    def read_batch(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int32 windows, computed together."""
        # A counter-based hash (splitmix64) of (seed, index, position): a few microseconds a
        # window, where building a numpy Generator per window took ~45 (the input pipeline
        # must stay far ahead of steps of a millisecond). uint64 arithmetic wraps mod 2**64.
        width = self.seq_len + 1
        starts = np.asarray(indices).astype(np.uint64) * np.uint64(width)
        counters = starts[:, None] + np.arange(width, dtype=np.uint64)
        hashed = splitmix64(counters ^ np.uint64(((self.seed * 0x9E3779B1) << 32) % 2**64))
        return (hashed % np.uint64(self.vocab_size)).astype(np.int32)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: well-mixed uint64 values from a counter (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def dataset_directory(pattern: str) -> pathlib.Path:
    """The one converted dataset a directory path or glob (of it or its shards) names."""
    matches = sorted(glob.glob(pattern, recursive=True))
    if not matches:
        raise UserError(f"data.source=arrayrecord:{pattern}: no such file or directory")
    directories = sorted(
        {path if path.is_dir() else path.parent for path in map(pathlib.Path, matches)}
    )
    if len(directories) > 1:
        raise UserError(
            f"data.source=arrayrecord:{pattern} matches {len(directories)} datasets "
            f"({directories[0]}, {directories[1]}, ...): name one directory"
        )
    return directories[0]


def _same_tokenizer(wanted: str, records: TokenRecords) -> bool:
    """Whether a dataset was tokenized by data.tokenizer.

    `byte`; a tokenizer file, or a directory holding tokenizer.json (its bytes must be those
    the dataset was converted with); or a tokenizer's name as the manifest records it.
    """
    path = tokenizer_file(wanted)
    if path is not None:
        return file_sha256(path) == records.tokenizer_sha256
    return wanted == records.tokenizer


def tokenizer_file(spec: str) -> pathlib.Path | None:
    """The tokenizer file that data.tokenizer names, or None (`byte`, a tokenizer's name).

    A tokenizer.json, or one in the directory named (an HF model or an import).
    """
    path = pathlib.Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    return path if spec != "byte" and path.is_file() else None


def open_token_records(
    pattern: str, data_config: DataConfig, seq_len: int, vocab_size: int | None
) -> tuple[Any, Any]:
    """(train, eval) windows of a converted dataset, checked against the model's vocab.

    data.packing and data.loss_on choose the windows (data/documents.py).
    """
    records = TokenRecords(dataset_directory(pattern))
    if data_config.tokenizer and not _same_tokenizer(data_config.tokenizer, records):
        raise UserError(
            f"data.tokenizer={data_config.tokenizer} but {records.directory} was tokenized "
            f"with {records.tokenizer}"
            f"{f' (sha256 {records.tokenizer_sha256[:12]})' if records.tokenizer_sha256 else ''}"
            f": convert the text again with --tokenizer {data_config.tokenizer}"
        )
    if vocab_size is not None and records.vocab_size > vocab_size:
        raise UserError(
            f"{records.directory} has vocab size {records.vocab_size} ({records.tokenizer}) "
            f"but model.vocab_size={vocab_size}: token ids would overflow"
        )
    packing = data_config.packing
    documents.check_loss_mask(records, data_config.loss_on)
    plan = None
    if records.preference_pairs:  # rows of pairs, for train.objective=dpo
        plan = PreferenceWindows.plan_for(records, seq_len, packing)
        return tuple(
            PreferenceWindows(records, seq_len, packing, plan, *split)
            for split in _splits(len(plan) - 1, data_config, records)
        )
    if packing == "stream":
        windows = len(PackedWindows(records, seq_len))  # checks seq_len fits
    else:
        plan = documents.DocumentWindows.plan_for(records, seq_len, packing)
        windows = len(plan) - 1
    splits = _splits(windows, data_config, records)
    if plan is not None:
        return tuple(
            documents.DocumentWindows(records, seq_len, packing, data_config.loss_on, plan, *split)
            for split in splits
        )
    if data_config.loss_on == "response":
        return tuple(documents.MaskedStreamWindows(records, seq_len, *split) for split in splits)
    return tuple(PackedWindows(records, seq_len, *split) for split in splits)


def _splits(windows: int, data_config: DataConfig, records: TokenRecords) -> tuple:
    """The (start, stop) of the train and eval windows: data.eval_fraction held out last."""
    eval_windows = round(windows * data_config.eval_fraction)
    if data_config.eval_fraction > 0 and (eval_windows == 0 or eval_windows == windows):
        raise UserError(
            f"data.eval_fraction={data_config.eval_fraction} of {windows} windows of "
            f"{records.directory} leaves an empty train or eval split"
        )
    return ((0, windows - eval_windows), (windows - eval_windows, windows))


def hf_cache_directory(
    data_config: DataConfig, path: str, key: str = "data.source"
) -> pathlib.Path:
    """Where `hf:<path>` is tokenized once, under data.cache_dir (`key` names the setting).

    Its name holds a hash of the data files (relative path, size, modification time) and of
    the conversion's settings (tokenizer and its sha256, split, format, field): changed data
    or settings get a conversion of their own.
    """
    target = pathlib.Path(path).expanduser().absolute()
    if not target.exists():
        raise UserError(f"{key}=hf:{path}: no such directory or file")
    files = (
        sorted(file for file in target.rglob("*") if file.is_file())
        if target.is_dir()
        else [target]
    )
    digest = hashlib.blake2b(digest_size=6)
    for file in files:
        status = file.stat()
        digest.update(
            f"{file.relative_to(target.parent)}\0{status.st_size}\0{status.st_mtime_ns}\n".encode()
        )
    tokenizer = data_config.tokenizer or "byte"
    tokenizer_path = tokenizer_file(tokenizer)
    sha = file_sha256(tokenizer_path) if tokenizer_path is not None else ""
    # The files beside it that declare its end-of-sequence token decide the tokens too.
    declaring = [tokenizer_path.parent / name for name in EOS_DECLARING_FILES] if sha else []
    sha += "".join(file_sha256(path) for path in declaring if path.is_file())
    settings = (tokenizer, sha, data_config.hf_split, data_config.hf_format, data_config.hf_field)
    digest.update(repr(settings).encode())
    root = pathlib.Path(data_config.cache_dir or "~/.cache/paisoar_jax/hf").expanduser()
    return root / f"{target.name or 'data'}-{digest.hexdigest()}"


def open_source(
    data_config: DataConfig, model_config: LanguageModelConfig, seed: int
) -> tuple[TokenWindows | SyntheticWindows | PackedWindows, ...]:
    """The (train, eval) window sources named by data.source."""
    source = data_config.source
    if source.startswith(("arrayrecord:", "hf:")):
        directory = source.removeprefix("arrayrecord:")
        if source.startswith("hf:"):
            directory = str(hf_cache_directory(data_config, source.removeprefix("hf:")))
            if not (pathlib.Path(directory) / MANIFEST_NAME).is_file():
                raise UserError(
                    f"data.source={source} is not tokenized yet: `python -m paisoar_jax.train` "
                    f"and fit do it on first use (into {directory}), or run `python -m "
                    f"paisoar_jax.convert text --from-hf {source[3:]} --output DIR` and train "
                    f"on data.source=arrayrecord:DIR"
                )
        return open_token_records(
            directory, data_config, model_config.seq_len, model_config.vocab_size
        )
    if data_config.packing != "stream" or data_config.loss_on != "all":
        setting = (
            f"data.packing={data_config.packing}"
            if data_config.packing != "stream"
            else f"data.loss_on={data_config.loss_on}"
        )
        raise UserError(
            f"{setting} reads the documents of a converted dataset (data.source=arrayrecord:"
            f"DIR), and data.source={data_config.source} has none"
        )
    if data_config.source.startswith("images:"):
        raise UserError(
            f"data.source={data_config.source} holds images, and model.name="
            f"{model_config.name} reads tokens"
        )
    if data_config.source == "synthetic":
        return (
            SyntheticWindows(model_config.vocab_size, model_config.seq_len, seed),
            SyntheticWindows(
                model_config.vocab_size, model_config.seq_len, seed + 1, SYNTHETIC_EVAL_WINDOWS
            ),
        )
    if data_config.source != "embedded":
        raise UserError(
            f"data.source={data_config.source!r} is not one of embedded, synthetic, "
            f"arrayrecord:<dir>, hf:<dir>, images:<dir>"
        )
    if data_config.tokenizer not in ("", "byte"):
        raise UserError(
            f"data.source=embedded is byte-level text, but this model reads the tokens of "
            f"data.tokenizer={data_config.tokenizer}: convert your text with `python -m "
            f"paisoar_jax.convert text --input ... --output DIR --tokenizer "
            f"{data_config.tokenizer}` and train with data.source=arrayrecord:DIR"
        )
    if model_config.vocab_size < 256:
        raise UserError(
            f"data.source=embedded is byte-level and needs model.vocab_size >= 256, "
            f"got {model_config.vocab_size}"
        )
    train_tokens, eval_tokens = embedded_corpus(data_config.eval_fraction)
    sources = (
        TokenWindows(train_tokens, model_config.seq_len),
        TokenWindows(eval_tokens, model_config.seq_len),
    )
    for split, source in zip(("train", "eval"), sources, strict=True):
        if len(source) == 0 and (split == "train" or data_config.eval_fraction > 0):
            raise UserError(
                f"model.seq_len={model_config.seq_len} is longer than the embedded {split} "
                f"split ({len(source.tokens)} tokens)"
            )
    return sources


@one_line_errors("paisoar_jax.token_windows")
def token_windows(
    directory: str,
    seq_len: int,
    *,
    packing: str | None = None,
    loss_on: str | None = None,
    eval_fraction: float = 0.05,
    tokenizer: str = "",
) -> tuple[Any, Any]:
    """(train, eval) windows of a converted dataset, for a model of one's own.

    What `data.source=arrayrecord:DIR` gives a zoo model, as examples for `fit(data=...,
    eval_data=...)`. By default, what the data holds: text (`convert text`) as windows of
    seq_len + 1 tokens streamed across documents with the loss on every token, each an
    int32 window (data.packing's and data.loss_on's defaults); instruction or chat data
    (`--format instruction` or `chat`, which mark response tokens) packed by documents with
    the loss on the responses, each a dict of tokens (seq_len + 1), loss_mask, segments and
    positions (paisoar_jax/data/documents.py says what each holds).

    Args:
        directory: what `python -m paisoar_jax.convert text --output DIR` wrote.
        seq_len: tokens per window the model sees (each window holds one more: the target).
        packing: "stream", "documents" or "padding", as data.packing (default: see above).
        loss_on: "all" or "response" (instruction or chat data only), as data.loss_on.
        eval_fraction: the last share of the windows held out (0: none, and eval is None).
        tokenizer: when given, must be the one the dataset was converted with.

    Returns:
        (train, eval): random-access examples, as fit's data and eval_data take them.

    Example:
        ```python
        import pathlib

        from paisoar_jax.tools import convert

        import paisoar_jax

        pathlib.Path("texts").mkdir(exist_ok=True)
        pathlib.Path("texts/a.txt").write_text("Some text to learn from. " * 400)
        convert.main(["text", "--input", "texts/*.txt", "--output", "data/texts"])
        train, held_out = paisoar_jax.token_windows("data/texts", seq_len=64)
        print(len(train), train[0].shape)  # windows of 65 tokens: 64 in, each one's next out
        ```

    """
    if packing is None or loss_on is None:  # what the data holds: responses marked or not
        responses = TokenRecords(dataset_directory(str(directory))).has_loss_mask
        packing = packing or ("documents" if responses else "stream")
        loss_on = loss_on or ("response" if responses else "all")
    for name, value, allowed in (
        ("packing", packing, ("stream", "documents", "padding")),
        ("loss_on", loss_on, ("all", "response")),
    ):
        if value not in allowed:
            raise UserError(f"token_windows: {name}={value!r} is not one of {', '.join(allowed)}")
    data_config = DataConfig(
        source=f"arrayrecord:{directory}",
        packing=packing,
        loss_on=loss_on,
        eval_fraction=eval_fraction,
        tokenizer=tokenizer,
    )
    train, held_out = open_token_records(str(directory), data_config, seq_len, None)
    return train, held_out if eval_fraction > 0 else None
