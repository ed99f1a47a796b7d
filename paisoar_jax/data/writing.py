"""Datasets written as ArrayRecord shards with a manifest, whole or not at all.

`staged_output` builds a dataset in a hidden sibling directory and renames it into place
only when complete, so a failed or interrupted write leaves no half dataset; `write_shards`
writes records contiguously over shards; `write_manifest` writes manifest.json with sorted
keys (equal datasets, equal bytes); `tokens_manifest` is a tokens dataset's. The formats and
their readers are in records.py; `python -m paisoar_jax.convert` writes through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterator

from paisoar_jax.data import records
from paisoar_jax.errors import UserError

# One record per chunk, so reading one record decompresses only that record.
TOKEN_WRITER_OPTIONS = "group_size:1,zstd:3"
# JPEG and PNG bytes are compressed already; compressing again costs time and saves nothing.
IMAGE_WRITER_OPTIONS = "group_size:1,uncompressed"
DOCUMENT_INDEX = "documents.npy"  # where each document starts in the stream (int64)


@contextlib.contextmanager
def staged_output(output: pathlib.Path, overwrite: bool) -> Iterator[pathlib.Path]:
    """A fresh sibling directory of `output` that replaces it only if the body succeeds."""
    output = pathlib.Path(os.path.abspath(output))  # "." and "out/" need a real name and parent
    if output.exists() and not overwrite and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output} exists and is not empty (--overwrite replaces it)")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.is_dir():
        retired = staging.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(retired)
        staging.rename(output)
        shutil.rmtree(retired)
    else:
        output.unlink(missing_ok=True)
        staging.rename(output)


def write_shards(
    directory: pathlib.Path,
    prefix: str,
    contents: Iterator[bytes],
    record_count: int,
    shard_count: int,
    options: str,
) -> list[dict]:
    """Writes record_count records in order, contiguously over at most shard_count shards."""
    from array_record.python.array_record_module import ArrayRecordWriter

    shard_count = max(1, min(shard_count, record_count))
    base, extra = divmod(record_count, shard_count)
    shards = []
    for index in range(shard_count):
        count = base + (index < extra)
        path = directory / records.shard_name(prefix, index, shard_count)
        writer = ArrayRecordWriter(str(path), options)
        if not writer.ok():
            raise UserError(f"cannot create {path}")
        for _ in range(count):
            writer.write(next(contents))
        writer.close()
        size, sha256 = path.stat().st_size, records.file_sha256(path)
        shards.append({"path": path.name, "records": count, "bytes": size, "sha256": sha256})
    return shards


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    """Writes manifest.json with sorted keys, so equal datasets have equal bytes."""
    text = json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    (directory / records.MANIFEST_NAME).write_text(text)


def tokens_manifest(staging, tokenizer, dtype, record_tokens: int, starts, shards) -> dict:
    """A tokens dataset's manifest: format, tokenizer, sizes, document index, shards."""
    token_count = sum(shard["tokens"] for shard in shards)
    return {
        "format": records.TOKENS_FORMAT,
        "version": records.FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
        "record_tokens": record_tokens,
        "token_count": token_count,
        "documents": len(starts),
        "document_index": {
            "path": DOCUMENT_INDEX,
            "documents": len(starts),
            "sha256": records.file_sha256(staging / DOCUMENT_INDEX),
        },
        "shards": shards,
    }
