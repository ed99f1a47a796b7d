"""ArrayRecord datasets written by `python -m paisoar_jax.convert`, read back for grain.

A dataset is a directory of `PREFIX-0000i-of-0000N.array_record` shards plus a
`manifest.json` that records, per shard, its record count, byte size and sha256. Opening a
dataset checks the manifest against the files, so a missing or truncated shard is one
`UserError` line instead of a crash deep inside a training run; `verify()` also checks the
hashes. Every reader here is a random-access source (`__len__`, `__getitem__`) that pickles
without its open file handles, so grain's worker processes can each reopen the shards.

Tokens: one stream of all documents, each followed by `eos_id`, cut into records of exactly
`record_tokens` tokens (only the last may be shorter), so token i lives in record
i // record_tokens. A dataset converted from instructions or chats (`loss_mask` in the
manifest) follows each record's tokens with one byte per token, 1 where the token is one to
learn (a response's) and 0 where it is context (a prompt's). `documents.npy` holds where
each document starts in the stream (int64), for packing whole documents into windows.

Images: each record is a little-endian int32 label followed by the
original encoded file bytes. `ImageFolder` reads an unconverted folder with the same class
and skip rules, in the same order, so both give identical items.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from paisoar_jax.errors import UserError

MANIFEST_NAME = "manifest.json"
TOKENS_FORMAT = "paisoar_jax.tokens"
IMAGES_FORMAT = "paisoar_jax.images"
FORMAT_VERSION = 1
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
LABEL_DTYPE = np.dtype("<i4")
# Where a Hugging Face model directory declares its end-of-sequence token, in this order
# (the tokenizer's own word first: what its chat template ends a turn with).
EOS_DECLARING_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")
# No readahead and no thread pool: training reads scattered single records, not runs.
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
SHARD_KEYS = {"path", "records", "bytes", "sha256"}
REQUIRED_KEYS = {
    TOKENS_FORMAT: set(
        "shards token_count record_tokens vocab_size eos_id tokenizer dtype".split()
    ),
    IMAGES_FORMAT: set("shards classes count".split()),
}


def shard_name(prefix: str, index: int, count: int) -> str:
    """The file name of shard `index` of `count`, e.g. tokens-00000-of-00003.array_record."""
    return f"{prefix}-{index:05d}-of-{count:05d}.array_record"


def file_sha256(path: pathlib.Path) -> str:
    """The hex sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def load_manifest(directory: pathlib.Path, expected_format: str) -> dict:
    """The parsed manifest of a dataset directory, or a UserError naming what is wrong."""
    if not directory.is_dir():
        raise UserError(f"dataset directory not found: {directory}")
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing: not a dataset written by paisoar_jax.convert"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path} is not a readable manifest: {error}") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path} is not a JSON object")
    found = (manifest.get("format"), manifest.get("version"))
    if found != (expected_format, FORMAT_VERSION):
        raise UserError(
            f"{path} has format {found[0]!r} version {found[1]!r} "
            f"(expected {expected_format!r} version {FORMAT_VERSION})"
        )
    missing = sorted(REQUIRED_KEYS[expected_format] - manifest.keys())
    if not missing and any(not SHARD_KEYS <= set(shard) for shard in manifest["shards"]):
        missing = [f"shards[].{key}" for key in sorted(SHARD_KEYS)]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}")
    return manifest


def decode_image_record(record: bytes) -> dict:
    """{"image": encoded file bytes, "label": int} from one image record."""
    label = int(np.frombuffer(record[: LABEL_DTYPE.itemsize], LABEL_DTYPE)[0])
    return {"image": record[LABEL_DTYPE.itemsize :], "label": label}


class ShardedRecords:
    """The records of all shards of a dataset as one sequence, with validated shards."""

    def __init__(self, directory: str | pathlib.Path, expected_format: str):
        self.directory = pathlib.Path(directory)
        self.manifest = load_manifest(self.directory, expected_format)
        self.shard_paths: list[pathlib.Path] = []
        counts = []
        for shard in self.manifest["shards"]:
            path = self.directory / shard["path"]
            if not path.is_file():
                raise UserError(f"shard listed in the manifest is missing: {path}")
            size = path.stat().st_size
            if size != shard["bytes"]:
                raise UserError(
                    f"{path} has {size} bytes, the manifest says {shard['bytes']}: "
                    f"truncated or replaced (rerun paisoar_jax.convert)"
                )
            reader = self._open(path)
            found = reader.num_records()
            reader.close()
            if found != shard["records"]:
                raise UserError(f"{path} has {found} records, the manifest says {shard['records']}")
            self.shard_paths.append(path)
            counts.append(found)
        # shard_starts[i] is the global index of shard i's first record.
        self.shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._readers: dict[int, ArrayRecordReader] = {}

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def __getstate__(self) -> dict:
        # Open readers hold file handles that cannot cross into grain's worker processes.
        return {**self.__dict__, "_readers": {}}

    @staticmethod
    def _open(path: pathlib.Path) -> ArrayRecordReader:
        try:
            reader = ArrayRecordReader(str(path), READER_OPTIONS)
        except Exception as error:
            raise UserError(f"{path} is not a readable ArrayRecord file: {error}") from None
        if not reader.ok():
            raise UserError(f"{path} is corrupt: the ArrayRecord reader cannot open it")
        return reader

    def read_records(self, first: int, stop: int) -> list[bytes]:
        """Records [first, stop) in order; a damaged shard becomes a UserError naming it."""
        records: list[bytes] = []
        shard = int(np.searchsorted(self.shard_starts, first, side="right")) - 1
        while first < stop:
            start, end = int(self.shard_starts[shard]), int(self.shard_starts[shard + 1])
            local_stop = min(stop, end) - start
            path = self.shard_paths[shard]
            try:
                if shard not in self._readers:
                    self._readers[shard] = self._open(path)
                records.extend(self._readers[shard].read(list(range(first - start, local_stop))))
            except UserError:
                raise
            except Exception as error:
                raise UserError(f"{path} is corrupt: {error}") from None
            first, shard = start + local_stop, shard + 1
        return records

    def verify(self) -> None:
        """Checks every shard's sha256 against the manifest; UserError names a corrupt shard."""
        files = [
            (shard["sha256"], path)
            for shard, path in zip(self.manifest["shards"], self.shard_paths, strict=True)
        ]
        index = self.manifest.get("document_index")
        if index is not None:
            files.append((index["sha256"], self.directory / index["path"]))
        for sha256, path in files:
            if not path.is_file() or file_sha256(path) != sha256:
                raise UserError(f"{path} is corrupt: its sha256 differs from the manifest")


class TokenRecords(ShardedRecords):
    """The token stream of a `convert text` dataset, read by token position."""

    def __init__(self, directory: str | pathlib.Path):
        super().__init__(directory, TOKENS_FORMAT)
        self.token_count: int = self.manifest["token_count"]
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int = self.manifest["eos_id"]
        self.tokenizer: str = self.manifest["tokenizer"]
        self.tokenizer_sha256: str | None = self.manifest.get("tokenizer_sha256")
        self.record_tokens: int = self.manifest["record_tokens"]
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.has_loss_mask: bool = bool(self.manifest.get("loss_mask", False))
        # convert --format preference: documents 2i and 2i + 1 are pair i (data/preferences.py)
        self.preference_pairs: int = int(self.manifest.get("preference_pairs", 0))
        expected = -(-self.token_count // self.record_tokens)
        if len(self) != expected:
            raise UserError(
                f"{self.directory / MANIFEST_NAME} lists {len(self)} records, but "
                f"{self.token_count} tokens make {expected} records of {self.record_tokens}"
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, in the stored dtype."""
        return self.read_with_mask(start, stop)[0]

    def read_with_mask(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, loss mask or None) of positions [start, stop) of the stream."""
        if not 0 <= start <= stop <= self.token_count:
            raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.token_count})")
        if start == stop:
            return np.zeros(0, self.dtype), (np.zeros(0, bool) if self.has_loss_mask else None)
        first, last = start // self.record_tokens, (stop - 1) // self.record_tokens
        bytes_per_token = self.dtype.itemsize + self.has_loss_mask
        token_parts, mask_parts = [], []
        for offset, record in enumerate(self.read_records(first, last + 1)):
            index = first + offset
            size = min(self.record_tokens, self.token_count - index * self.record_tokens)
            if len(record) != size * bytes_per_token:
                shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
                raise UserError(
                    f"{self.shard_paths[shard]} is corrupt: record {index} has {len(record)} "
                    f"bytes, expected {size * bytes_per_token}"
                )
            token_parts.append(record[: size * self.dtype.itemsize])
            mask_parts.append(record[size * self.dtype.itemsize :])
        offset = start - first * self.record_tokens
        window = slice(offset, offset + stop - start)
        tokens = np.frombuffer(b"".join(token_parts), self.dtype)[window]
        if not self.has_loss_mask:
            return tokens, None
        return tokens, np.frombuffer(b"".join(mask_parts), np.uint8)[window].astype(bool)

    def document_starts(self) -> np.ndarray:
        """Where each document starts in the stream (int64), checked against the manifest.

        Read once per TokenRecords (the packing plan and each split's windows ask for it).
        """
        if (cached := self.__dict__.get("_document_starts")) is not None:
            return cached
        entry = self.manifest.get("document_index")
        if entry is None:
            raise UserError(
                f"{self.directory} has no document index (converted by an older paisoar_jax): "
                f"convert the text again to pack whole documents"
            )
        path = self.directory / entry["path"]
        try:
            starts = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:
            what = "is empty" if path.is_file() and path.stat().st_size == 0 else "is damaged"
            detail = (str(error).splitlines() or [type(error).__name__])[0][:120]
            raise UserError(
                f"{path} {what}: not a readable document index (.npy), convert the text again "
                f"({detail})"
            ) from None
        last = starts[-1] if len(starts) else self.token_count
        if len(starts) != entry["documents"] or starts[0] != 0 or last >= self.token_count:
            raise UserError(f"{path} does not match the manifest: convert the text again")
        self._document_starts = starts.astype(np.int64)
        return self._document_starts


class PackedWindows:
    """Windows of seq_len + 1 tokens; window i starts at token i * seq_len.

    Consecutive windows share one token (the last target of one is the first input of the
    next), so only the final partial window of fewer than seq_len tokens is never trained on.
    `start_window`/`stop_window` select a contiguous range, e.g. a held-out tail for eval.
    """

    def __init__(
        self,
        token_records: TokenRecords,
        seq_len: int,
        start_window: int = 0,
        stop_window: int | None = None,
    ):
        total = (token_records.token_count - 1) // seq_len
        if total == 0:
            raise UserError(
                f"model.seq_len={seq_len} is longer than the data "
                f"({token_records.token_count} tokens in {token_records.directory})"
            )
        stop_window = total if stop_window is None else stop_window
        if not 0 <= start_window <= stop_window <= total:
            raise ValueError(f"windows [{start_window}, {stop_window}) outside [0, {total})")
        self.token_records, self.seq_len = token_records, seq_len
        self.start_window, self.stop_window = start_window, stop_window

    def __len__(self) -> int:
        return self.stop_window - self.start_window

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} outside [0, {len(self)})")
        start = (self.start_window + index) * self.seq_len
        return self.token_records.read(start, start + self.seq_len + 1).astype(np.int32)


class ImageRecords(ShardedRecords):
    """The labelled images of a `convert images` dataset."""

    def __init__(self, directory: str | pathlib.Path):
        super().__init__(directory, IMAGES_FORMAT)
        self.classes: list[str] = self.manifest["classes"]
        if len(self) != self.manifest["count"]:
            raise UserError(
                f"{self.directory / MANIFEST_NAME} says count {self.manifest['count']}, "
                f"but its shards hold {len(self)} records"
            )

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"image {index} outside [0, {len(self)})")
        return decode_image_record(self.read_records(index, index + 1)[0])


def scan_image_folder(
    directory: pathlib.Path,
) -> tuple[list[str], list[tuple[pathlib.Path, int]], list[pathlib.Path]]:
    """(classes, readable (path, label) pairs, unreadable paths) of a class-per-folder tree.

    Classes are the sorted names of the non-hidden subfolders; their .jpg/.jpeg/.png files
    (any case, any depth) are taken in sorted order and kept if Pillow can verify them.
    """
    from PIL import Image

    if not directory.is_dir():
        raise UserError(f"image directory not found: {directory}")
    classes = sorted(
        path.name for path in directory.iterdir() if path.is_dir() and not path.name.startswith(".")
    )
    if not classes:
        raise UserError(f"{directory} has no class subfolders (expected {directory}/CLASS/*.jpg)")
    readable, unreadable = [], []
    for label, name in enumerate(classes):
        files = sorted(
            path
            for path in (directory / name).rglob("*")
            if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file()
        )
        for path in files:
            try:
                with Image.open(path) as image:
                    image.verify()
            except Exception:  # Pillow raises many types for a damaged file; all mean skip.
                unreadable.append(path)
                continue
            readable.append((path, label))
    return classes, readable, unreadable


class ImageFolder:
    """An unconverted class-per-folder image tree, item for item like its ImageRecords."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.classes, self.files, self.skipped = scan_image_folder(self.directory)
        if not self.files:
            raise UserError(f"{self.directory} has no readable .jpg/.jpeg/.png images")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        path, label = self.files[index]
        return {"image": path.read_bytes(), "label": label}
