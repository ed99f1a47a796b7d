"""Reading converted datasets back: token streams, packed windows, images, damage."""

import io
import itertools
import json
import pickle

import numpy as np
import pytest
from PIL import Image

from paisoar_jax.data.pipeline import batch_dataset
from paisoar_jax.data.records import (
    ImageFolder,
    ImageRecords,
    PackedWindows,
    TokenRecords,
)
from paisoar_jax.errors import UserError
from paisoar_jax.tools import convert

DOCUMENTS = [
    b"hello world\n",
    b"",
    "na\u00efve caf\u00e9 \u2615\n".encode(),
    b"the quick brown fox jumps over the lazy dog\n" * 3,
]
STREAM = np.frombuffer(b"".join(document + b"\0" for document in DOCUMENTS), np.uint8)


def run_convert(*args):
    assert convert.main([*map(str, args), "--no-progress"]) == 0


@pytest.fixture
def token_dir(tmp_path):
    """DOCUMENTS as byte tokens, records of 7 tokens over 3 shards."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for index, document in enumerate(DOCUMENTS):
        (inputs / f"doc_{index}.txt").write_bytes(document)
    output = tmp_path / "tokens"
    run_convert("text", "--input", inputs, "--output", output, "--record-tokens", 7, "--shards", 3)
    return output


def make_images(root):
    """cat (3 images, one nested), dog (1 + a corrupt .jpg), emu (1); returns the good ones."""
    rng = np.random.default_rng(0)
    names = ["cat/B.JPG", "cat/a.png", "cat/nested/c.jpeg", "dog/x.png", "emu/y.jpg"]
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path, format="PNG" if name.endswith(".png") else "JPEG")
    (root / "dog/broken.jpg").write_bytes(b"\xff\xd8 this is not a jpeg")
    (root / "dog/notes.txt").write_text("not an image")
    (root / ".cache").mkdir()
    return names


def test_token_stream_round_trips_across_records_and_shards(token_dir):
    records = TokenRecords(token_dir)
    assert (records.token_count, records.vocab_size, records.eos_id) == (len(STREAM), 256, 0)
    assert records.tokenizer == "byte" and records.dtype == np.uint16
    np.testing.assert_array_equal(records.read(0, len(STREAM)), STREAM)
    for start in range(len(STREAM)):
        for length in (0, 1, 6, 7, 8, 15, 22):
            stop = min(start + length, len(STREAM))
            np.testing.assert_array_equal(records.read(start, stop), STREAM[start:stop])
    manifest = json.loads((token_dir / "manifest.json").read_text())
    per_shard = [shard["records"] for shard in manifest["shards"]]
    assert sum(per_shard) == -(-len(STREAM) // 7) and max(per_shard) - min(per_shard) <= 1
    assert sum(shard["tokens"] for shard in manifest["shards"]) == len(STREAM)
    assert manifest["documents"] == len(DOCUMENTS)
    with pytest.raises(IndexError):
        records.read(0, len(STREAM) + 1)


@pytest.mark.parametrize("seq_len", [1, 4, 7, 10, 50])
def test_packed_windows_are_shifted_slices_losing_only_the_tail(token_dir, seq_len):
    windows = PackedWindows(TokenRecords(token_dir), seq_len)
    assert len(windows) == (len(STREAM) - 1) // seq_len
    covered = set()
    for index in range(len(windows)):
        start = index * seq_len
        assert windows[index].dtype == np.int32
        np.testing.assert_array_equal(windows[index], STREAM[start : start + seq_len + 1])
        covered.update(range(start, start + seq_len + 1))
    assert covered == set(range(len(covered)))
    assert len(STREAM) - len(covered) < seq_len
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_window_ranges_carve_a_held_out_tail(token_dir):
    records = TokenRecords(token_dir)
    every = PackedWindows(records, 4)
    train = PackedWindows(records, 4, stop_window=len(every) - 3)
    held_out = PackedWindows(records, 4, start_window=len(every) - 3)
    assert len(train) + len(held_out) == len(every) and len(held_out) == 3
    for index in range(3):
        np.testing.assert_array_equal(held_out[index], every[len(train) + index])
    with pytest.raises(ValueError):
        PackedWindows(records, 4, start_window=2, stop_window=len(every) + 1)


def test_seq_len_longer_than_the_data(token_dir):
    records = TokenRecords(token_dir)
    assert len(PackedWindows(records, len(STREAM) - 1)) == 1
    message = rf"model.seq_len={len(STREAM)} is longer than the data \({len(STREAM)} tokens in "
    with pytest.raises(UserError, match=message + rf"{token_dir}\)"):
        PackedWindows(records, len(STREAM))


def test_readers_pickle_without_handles_and_feed_grain_workers(token_dir):
    records = TokenRecords(token_dir)
    records.read(0, len(STREAM))  # opens every shard's reader
    clone = pickle.loads(pickle.dumps(records))
    np.testing.assert_array_equal(clone.read(3, 40), STREAM[3:40])
    windows = PackedWindows(records, 4)
    batches = lambda **workers: list(
        itertools.islice(iter(batch_dataset(windows, global_batch=2, seed=0, **workers)), 4)
    )
    plain, from_workers = batches(), batches(workers=1)
    for one, other in zip(plain, from_workers, strict=True):
        np.testing.assert_array_equal(one, other)
    starts = {int(row[0]) for batch in plain for row in batch}
    assert starts <= {int(window[0]) for window in (windows[i] for i in range(len(windows)))}


def test_image_records_equal_the_folder_they_came_from(tmp_path):
    names = make_images(tmp_path / "in")
    run_convert("images", "--input", tmp_path / "in", "--output", tmp_path / "out", "--shards", 2)
    records, folder = ImageRecords(tmp_path / "out"), ImageFolder(tmp_path / "in")
    assert records.classes == folder.classes == ["cat", "dog", "emu"]
    assert len(records) == len(folder) == len(names)
    assert [str(path.relative_to(tmp_path / "in")) for path, _ in folder.files] == names
    assert [path.name for path in folder.skipped] == ["broken.jpg"]
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert (manifest["count"], manifest["skipped"], len(manifest["shards"])) == (5, 1, 2)
    for index, name in enumerate(names):
        item = records[index]
        assert item == folder[index]
        assert item["label"] == records.classes.index(name.split("/")[0])
        assert item["image"] == (tmp_path / "in" / name).read_bytes()  # not re-encoded
        assert Image.open(io.BytesIO(item["image"])).size == (5, 6)
    assert pickle.loads(pickle.dumps(records))[4] == folder[4]


def flip_middle(path, start, stop):
    """Inverts 16 bytes in the middle of path's bytes [start, stop)."""
    data = bytearray(path.read_bytes())
    middle = (start + stop) // 2
    data[middle : middle + 16] = bytes(255 - byte for byte in data[middle : middle + 16])
    path.write_bytes(bytes(data))


def test_flipped_bytes_inside_a_record_fail_the_read_naming_the_shard(tmp_path):
    names = make_images(tmp_path / "in")
    run_convert("images", "--input", tmp_path / "in", "--output", tmp_path / "out")
    shard = tmp_path / "out/images-00000-of-00001.array_record"
    image = (tmp_path / "in" / names[3]).read_bytes()
    offset = shard.read_bytes().find(image)  # records are stored uncompressed
    assert offset > 0
    flip_middle(shard, offset, offset + len(image))
    records = ImageRecords(tmp_path / "out")  # sizes and counts still match the manifest
    assert records[0]["label"] == 0  # other chunks are intact
    with pytest.raises(UserError, match=f"{shard} is corrupt"):
        records[3]
    with pytest.raises(UserError, match=f"{shard} is corrupt: its sha256 differs"):
        records.verify()


def test_flipped_bytes_in_a_token_shard_are_a_user_error(token_dir):
    shard = token_dir / "tokens-00001-of-00003.array_record"
    content = np.flatnonzero(np.frombuffer(shard.read_bytes(), np.uint8))
    flip_middle(shard, int(content[0]), int(content[len(content) // 2]))
    with pytest.raises(UserError, match=str(shard)):
        TokenRecords(token_dir).read(0, len(STREAM))


def rewrite_manifest(directory, drop=(), shard=(), **changes):
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(changes)
    manifest["shards"][0].update(shard)
    for key in drop:
        del manifest[key]
    (directory / "manifest.json").write_text(json.dumps(manifest))


SHARD_0 = "tokens-00000-of-00003.array_record"
BREAKAGES = {
    "missing directory": (lambda d: d.rename(d.with_name("gone")), "directory not found"),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    "bad json": (
        lambda d: (d / "manifest.json").write_text("{"),
        "manifest.json is not a readable manifest",
    ),
    "wrong format": (
        lambda d: rewrite_manifest(d, format="paisoar_jax.images"),
        "has format 'paisoar_jax.images' version 1",
    ),
    "missing key": (
        lambda d: rewrite_manifest(d, drop=["vocab_size", "eos_id"]),
        "manifest.json lacks eos_id, vocab_size",
    ),
    "missing shard": (lambda d: (d / SHARD_0).unlink(), f"shard listed .* missing: .*{SHARD_0}"),
    "truncated shard": (
        lambda d: (d / SHARD_0).write_bytes((d / SHARD_0).read_bytes()[:70_000]),
        rf"{SHARD_0} has 70000 bytes, the manifest says \d+: truncated",
    ),
    "record count": (
        lambda d: rewrite_manifest(d, shard={"records": 5}),
        f"{SHARD_0} has 8 records, the manifest says 5",
    ),
    "token count": (
        lambda d: rewrite_manifest(d, token_count=500),
        "lists 24 records, but 500 tokens make 72 records of 7",
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_broken_datasets_are_one_line_user_errors_at_open(token_dir, breakage):
    damage, message = BREAKAGES[breakage]
    damage(token_dir)
    with pytest.raises(UserError, match=message) as raised:
        TokenRecords(token_dir)
    assert "\n" not in str(raised.value)
