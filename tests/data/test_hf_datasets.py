"""`convert text --from-hf` (paisoar_jax/data/hf_datasets.py): a `datasets` dataset, saved
or as local data files, converts to the same tokens as the same records in a .jsonl."""

import json

import datasets
import numpy as np
import pytest

from paisoar_jax.data.records import TokenRecords
from paisoar_jax.tools import convert

RECORDS = [
    {
        "text": f"document {i}: " + "word " * (i % 7 + 1),
        "prompt": f"{i} + 1 =",
        "response": f" {i + 1}",
    }
    for i in range(40)
]


def tokens_of(directory):
    """(the token stream, its loss mask or None, the document starts) of a converted dataset."""
    found = TokenRecords(directory)
    stream, mask = found.read_with_mask(0, found.token_count)
    return stream, mask, found.document_starts()


def converted(tmp_path, name, *arguments):
    status = convert.main(["text", *arguments, "--output", str(tmp_path / name), "--no-progress"])
    assert status == 0
    return tokens_of(tmp_path / name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_datasets")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(root / "saved"))
    splits = {
        "train": datasets.Dataset.from_list(RECORDS),
        "test": datasets.Dataset.from_list(RECORDS[:3]),
    }
    datasets.DatasetDict(splits).save_to_disk(str(root / "dict"))
    (root / "files").mkdir()
    (root / "files" / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root


@pytest.mark.parametrize(
    "format_arguments", [[], ["--format", "instruction"]], ids=["text", "instruction"]
)
def test_a_datasets_dataset_converts_as_its_jsonl_does(sources, tmp_path, format_arguments):
    expected = converted(
        tmp_path, "jsonl", "--input", str(sources / "files" / "part.jsonl"), *format_arguments
    )
    for name in ("saved", "dict", "files"):  # save_to_disk, a DatasetDict, data files
        found = converted(tmp_path, name, "--from-hf", str(sources / name), *format_arguments)
        for got, want in zip(found, expected, strict=True):
            if want is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got, want, err_msg=name)
    assert (expected[1] is not None) == bool(format_arguments)  # instructions: a loss mask


def test_a_split_is_chosen_and_bad_input_is_one_line(sources, tmp_path, capsys):
    test_split = converted(tmp_path, "test", "--from-hf", str(sources / "dict"), "--split", "test")
    assert len(test_split[2]) == 3
    (tmp_path / "empty").mkdir()
    failures = []
    for arguments, expected in (
        (["--from-hf", str(sources / "dict"), "--split", "valid"], "has no split 'valid'"),
        (["--from-hf", str(tmp_path / "missing")], "no such directory or file"),
        (["--from-hf", str(tmp_path / "empty")], "not a directory written by save_to_disk"),
        (["--from-hf", str(sources / "saved"), "--field", "body"], "no field 'body'"),
    ):
        capsys.readouterr()
        assert convert.main(["text", *arguments, "--output", str(tmp_path / "x")]) == 2
        failures.append((capsys.readouterr().err.strip(), expected))
    for message, expected in failures:
        assert expected in message and "\n" not in message, message
