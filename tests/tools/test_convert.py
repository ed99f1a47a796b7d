"""`python -m paisoar_jax.convert`: determinism, tokenizers, images and one-line errors."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import PYTHON, subprocess_env
from PIL import Image

from paisoar_jax.data.records import ImageRecords, TokenRecords
from paisoar_jax.data.tokenizing import load_tokenizer
from paisoar_jax.errors import SettingNames, UserError
from paisoar_jax.tools import convert

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Pack my box with five dozen liquor jugs! \u00bfQu\u00e9 tal? \u2615\n",
    "def main():\n    return 0\n",
]


def write_texts(directory, texts=TEXTS):
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(texts):
        (directory / f"{index:02d}.txt").write_text(text)
    return directory


def run_convert(*args):
    return convert.main([*map(str, args), "--no-progress"])


def one_error_line(capsys):
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("paisoar_jax.convert: error: ")
    return lines[0]


def directory_bytes(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_same_input_gives_byte_identical_directories(tmp_path):
    inputs = write_texts(tmp_path / "in")
    for output in ("one", "two"):
        args = ["--input", inputs, "--output", tmp_path / output, "--shards", 2]
        assert run_convert("text", *args, "--record-tokens", 16) == 0
    assert directory_bytes(tmp_path / "one") == directory_bytes(tmp_path / "two")
    manifest = (tmp_path / "one/manifest.json").read_text()
    assert str(tmp_path) not in manifest and json.loads(manifest)["documents"] == 3
    for output in ("images_one", "images_two"):
        (tmp_path / "images/cls").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (3, 2), (9, 8, 7)).save(tmp_path / "images/cls/a.png")
        assert (
            run_convert("images", "--input", tmp_path / "images", "--output", tmp_path / output)
            == 0
        )
    assert directory_bytes(tmp_path / "images_one") == directory_bytes(tmp_path / "images_two")


def test_inputs_are_files_directories_and_globs_sorted_and_deduplicated(tmp_path):
    inputs = write_texts(tmp_path / "in/deeper")
    (tmp_path / "in/.hidden").write_text("never read")
    args = [inputs / "01.txt", tmp_path / "in", str(tmp_path / "in/**/*.txt")]
    assert run_convert("text", "--input", *args, "--output", tmp_path / "out") == 0
    records = TokenRecords(tmp_path / "out")
    expected = b"".join(text.encode() + b"\0" for text in TEXTS)
    assert records.read(0, records.token_count).astype(np.uint8).tobytes() == expected


def train_tokenizer(path, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 10, trainer)
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))


def test_tokenizers_json_round_trips_the_text(tmp_path):
    tokenizer = train_tokenizer(tmp_path / "bpe.json", ["<pad>", "</s>"])
    inputs = write_texts(tmp_path / "in")
    args = ["--input", inputs, "--output", tmp_path / "out", "--tokenizer", tmp_path / "bpe.json"]
    assert run_convert("text", *args, "--record-tokens", 5, "--shards", 3) == 0
    records = TokenRecords(tmp_path / "out")
    assert records.tokenizer == "bpe.json" and records.eos_id == tokenizer.token_to_id("</s>")
    assert records.vocab_size == tokenizer.get_vocab_size() and records.dtype == np.uint16
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["tokenizer_sha256"] == convert.records.file_sha256(tmp_path / "bpe.json")
    stream = records.read(0, records.token_count).tolist()
    assert stream[-1] == records.eos_id and stream.count(records.eos_id) == len(TEXTS)
    documents, start = [], 0
    for index, token in enumerate(stream):
        if token == records.eos_id:
            documents.append(tokenizer.decode(stream[start:index]))
            start = index + 1
    assert documents == TEXTS
    assert len(stream) < sum(len(text.encode()) for text in TEXTS)  # it merged something


def test_tokenizer_without_an_end_of_document_token(tmp_path, capsys):
    train_tokenizer(tmp_path / "plain.json", [])
    args = ["--input", write_texts(tmp_path / "in"), "--output", tmp_path / "out"]
    assert run_convert("text", *args, "--tokenizer", tmp_path / "plain.json") == 2
    line = one_error_line(capsys)
    assert "plain.json has no end-of-sequence token: its directory declares none" in line
    assert line.endswith("name it with --eos TOKEN")
    run_side = SettingNames({"tokenizer": "data.tokenizer", "eos": ""}, "=")  # hf: has no eos
    with pytest.raises(UserError, match="convert with `python -m paisoar_jax.convert text --eos"):
        load_tokenizer(str(tmp_path / "plain.json"), names=run_side)


def instruction_records(path):
    rows = [{"prompt": "Add 2 and 3.", "response": "5"}, {"prompt": "Say hi.", "response": "hi"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def response_ends(directory):
    """The token after each response (learned tokens end where the response does)."""
    records = TokenRecords(directory)
    stream = records.read(0, records.token_count).tolist()
    return {stream[index] for index in np.load(directory / "documents.npy")[1:] - 1} | {stream[-1]}


@pytest.mark.parametrize(
    "declaring_file, declared",
    [
        ("tokenizer_config.json", lambda ids: {"eos_token": {"content": "<|im_end|>"}}),
        ("generation_config.json", lambda ids: {"eos_token_id": [ids["<|im_end|>"], 0]}),
        ("config.json", lambda ids: {"eos_token_id": ids["<|im_end|>"]}),
    ],
)
def test_instructions_end_with_the_declared_eos_not_the_first_known_name(
    tmp_path, declaring_file, declared
):
    # A ChatML model whose pad token is <|endoftext|>: its turns end with <|im_end|>.
    model = tmp_path / "chatml"
    model.mkdir()
    tokenizer = train_tokenizer(model / "tokenizer.json", ["<|endoftext|>", "<|im_end|>"])
    end = tokenizer.token_to_id("<|im_end|>")
    (model / declaring_file).write_text(json.dumps(declared(tokenizer.get_vocab())))
    data = instruction_records(tmp_path / "sft.jsonl")
    args = ["--input", data, "--format", "instruction", "--tokenizer", model]
    assert run_convert("text", *args, "--output", tmp_path / "out") == 0
    assert TokenRecords(tmp_path / "out").eos_id == end
    assert response_ends(tmp_path / "out") == {end}
    # A bare tokenizer.json declares nothing: the names are the last resort.
    args[-1] = model / "tokenizer.json"
    (model / declaring_file).unlink()
    assert run_convert("text", *args, "--output", tmp_path / "bare") == 0
    assert TokenRecords(tmp_path / "bare").eos_id == tokenizer.token_to_id("<|endoftext|>")


def test_llama3_end_tokens_are_accepted_and_eos_names_any_token(tmp_path, capsys):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer = train_tokenizer(tmp_path / "llama3.json", specials)
    data = instruction_records(tmp_path / "sft.jsonl")
    args = ["--input", data, "--format", "instruction", "--tokenizer", tmp_path / "llama3.json"]
    assert run_convert("text", *args, "--output", tmp_path / "out") == 0
    assert TokenRecords(tmp_path / "out").eos_id == tokenizer.token_to_id("<|end_of_text|>")
    assert run_convert("text", *args, "--eos", "<|eot_id|>", "--output", tmp_path / "eot") == 0
    assert response_ends(tmp_path / "eot") == {tokenizer.token_to_id("<|eot_id|>")}
    assert run_convert("text", *args, "--eos", "<|nope|>", "--output", tmp_path / "bad") == 2
    assert one_error_line(capsys).endswith("llama3.json has no such token")


def test_missing_tokenizers_package_is_one_line(tmp_path, capsys, monkeypatch):
    train_tokenizer(tmp_path / "bpe.json", ["</s>"])
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    args = ["--input", write_texts(tmp_path / "in"), "--output", tmp_path / "out"]
    assert run_convert("text", *args, "--tokenizer", tmp_path / "bpe.json") == 2
    assert "pip install tokenizers" in one_error_line(capsys)


def test_command_line_end_to_end(tmp_path):
    write_texts(tmp_path / "in")
    command = [PYTHON, "-m", "paisoar_jax.convert"]
    run = lambda *args: subprocess.run(
        [*command, *map(str, args)], env=subprocess_env(), capture_output=True, text=True
    )
    result = run("text", "--input", tmp_path / "in/*.txt", "--output", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"paisoar_jax.convert: wrote 3 documents, {TokenRecords(tmp_path / 'out').token_count} "
        f"tokens in 1 shards to {tmp_path / 'out'}"
    )
    assert run("verify", tmp_path / "out").stdout.startswith("paisoar_jax.convert: OK: ")
    for args, message in [
        (["text", "--input", tmp_path / "nope.txt", "--output", tmp_path / "x"], "nope.txt: no"),
        (["verify", tmp_path / "in"], "manifest.json is missing"),
    ]:
        result = run(*args)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and message in result.stderr


def test_images_skip_unreadable_files_with_one_warning(tmp_path, capsys):
    for index, name in enumerate(["b/one.png", "a/two.jpeg", "a/sub/three.PNG"]):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (index, 0, 0)).save(tmp_path / "in" / name, format="PNG")
    (tmp_path / "in/b/corrupt.jpg").write_bytes(b"garbage")
    args = ["--input", tmp_path / "in", "--output", tmp_path / "out", "--shards", 5]
    assert run_convert("images", *args) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == "paisoar_jax.convert: warning: skipped 1 unreadable images: " + (
        "b/corrupt.jpg"
    )
    assert "wrote 3 images of 2 classes (1 unreadable skipped) in 3 shards" in captured.out
    records = ImageRecords(tmp_path / "out")
    assert records.classes == ["a", "b"] and [records[i]["label"] for i in range(3)] == [0, 0, 1]
    assert convert.main(["verify", str(tmp_path / "out")]) == 0
    assert "3 records in 3 shards match the manifest" in capsys.readouterr().out


def test_overwrite_replaces_and_a_failed_conversion_leaves_nothing(tmp_path, capsys):
    inputs = write_texts(tmp_path / "in")
    assert run_convert("text", "--input", inputs, "--output", tmp_path / "out") == 0
    assert run_convert("text", "--input", inputs, "--output", tmp_path / "out") == 2
    assert "--overwrite replaces it" in one_error_line(capsys)
    write_texts(tmp_path / "in", ["replaced\n"])
    assert run_convert("text", "--input", inputs, "--output", tmp_path / "out", "--overwrite") == 0
    expected = sum(len(text.encode()) + 1 for text in ["replaced\n", *TEXTS[1:]])
    assert TokenRecords(tmp_path / "out").token_count == expected
    (inputs / "zz.bin").write_bytes(b"binary\0data")
    assert run_convert("text", "--input", inputs, "--output", tmp_path / "new") == 2
    assert "zz.bin contains NUL bytes" in one_error_line(capsys)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in", "out"]  # no partial dirs


def damaged_dataset(tmp_path):
    write_texts(tmp_path / "in")
    args = ["--input", tmp_path / "in", "--output", tmp_path / "out", "--record-tokens", 8]
    assert run_convert("text", *args) == 0
    shard = tmp_path / "out/tokens-00000-of-00001.array_record"
    data = bytearray(shard.read_bytes())
    # Padding before the footer block: no reader notices, only the sha256 check does.
    middle = len(data) // 2 - 1000
    data[middle : middle + 8] = b"\xa5" * 8
    shard.write_bytes(bytes(data))
    return ["verify", tmp_path / "out"]


def empty_files(tmp_path):
    write_texts(tmp_path / "in", ["", ""])
    return ["text", "--input", tmp_path / "in", "--output", tmp_path / "out"]


def occupied_output(tmp_path):
    write_texts(tmp_path / "in")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep.txt").write_text("precious")
    return ["text", "--input", tmp_path / "in", "--output", tmp_path / "out"]


BAD_INPUTS = {
    "missing input": (
        lambda tmp: ["text", "--input", tmp / "missing.txt", "--output", tmp / "out"],
        "--input {tmp}/missing.txt: no such file",
    ),
    "empty directory": (
        lambda tmp: (tmp / "in").mkdir() or ["text", "--input", tmp / "in", "--output", tmp / "o"],
        "--input {tmp}/in: no such file, or no files under or matching it",
    ),
    "glob matches nothing": (
        lambda tmp: ["text", "--input", f"{tmp}/*.md", "--output", tmp / "out"],
        "--input {tmp}/*.md: no such file, or no files",
    ),
    "empty files": (empty_files, "every input document is empty (2 documents)"),
    "non-empty output": (
        occupied_output,
        "--output {tmp}/out exists and is not empty (--overwrite replaces it)",
    ),
    "zero shards": (
        lambda tmp: (
            ["text", "--input", write_texts(tmp / "in"), "--output", tmp / "o"] + ["--shards", 0]
        ),
        "--shards must be at least 1, got 0",
    ),
    "zero record tokens": (
        lambda tmp: (
            ["text", "--input", write_texts(tmp / "in"), "--record-tokens", 0]
            + ["--output", tmp / "out"]
        ),
        "--record-tokens must be at least 1, got 0",
    ),
    "no class folders": (
        lambda tmp: write_texts(tmp / "in") and ["images", "--input", tmp / "in", "--output", tmp],
        "{tmp}/in has no class subfolders",
    ),
    "no readable images": (
        lambda tmp: (
            write_texts(tmp / "in/cls") and ["images", "--input", tmp / "in", "--output", tmp]
        ),
        "{tmp}/in has no readable .jpg/.jpeg/.png images",
    ),
    "corrupted shard": (
        damaged_dataset,
        "{tmp}/out/tokens-00000-of-00001.array_record is corrupt: its sha256 differs",
    ),
    "not a dataset": (lambda tmp: ["verify", tmp], "{tmp}/manifest.json is missing"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    make_args, message = BAD_INPUTS[case]
    args = make_args(tmp_path)
    capsys.readouterr()  # only the failing command's output counts
    assert convert.main([str(arg) for arg in args]) == 2
    assert message.format(tmp=tmp_path) in one_error_line(capsys)
    assert capsys.readouterr().out == ""


def test_json_lines_and_parquet_hold_one_document_per_record(tmp_path, capsys):
    import pyarrow
    import pyarrow.parquet as parquet

    (tmp_path / "in").mkdir()
    lines = [json.dumps({"text": text, "id": index}) for index, text in enumerate(TEXTS[:2])]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n\n")
    table = pyarrow.table({"body": [TEXTS[2]], "id": [3]})
    parquet.write_table(table, tmp_path / "in" / "b.parquet", row_group_size=1)
    assert run_convert("text", "--input", tmp_path / "in", "--output", tmp_path / "mixed") == 2
    assert "b.parquet has no column 'text' (columns: body, id): set --field" in one_error_line(
        capsys
    )
    parquet.write_table(pyarrow.table({"text": [TEXTS[2]]}), tmp_path / "in" / "b.parquet")
    assert run_convert("text", "--input", tmp_path / "in", "--output", tmp_path / "mixed") == 0
    # The same texts as plain files give the same tokens, document for document.
    assert (
        run_convert(
            "text", "--input", write_texts(tmp_path / "plain"), "--output", tmp_path / "files"
        )
        == 0
    )
    mixed, files = TokenRecords(tmp_path / "mixed"), TokenRecords(tmp_path / "files")
    assert mixed.manifest["documents"] == files.manifest["documents"] == 3
    np.testing.assert_array_equal(
        mixed.read(0, mixed.token_count), files.read(0, files.token_count)
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a"}\nnot json\n', "a.jsonl:2: not a JSON object"),
        ('{"body": "a"}\n', "a.jsonl:1: no field 'text' (set --field to the text's name)"),
        ('{"text": 3}\n', "a.jsonl:1: field 'text' is int, not text"),
    ],
)
def test_bad_json_lines_get_one_line(tmp_path, capsys, content, message):
    (tmp_path / "a.jsonl").write_text(content)
    assert run_convert("text", "--input", tmp_path / "a.jsonl", "--output", tmp_path / "out") == 2
    assert message in one_error_line(capsys)


def test_a_hugging_face_model_directory_names_its_tokenizer(tmp_path):
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir()
    train_tokenizer(model_dir / "tokenizer.json", ["<pad>", "</s>"])
    inputs = write_texts(tmp_path / "in")
    args = ["--input", inputs, "--output", tmp_path / "out", "--tokenizer", model_dir]
    assert run_convert("text", *args) == 0
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["tokenizer"] == "tokenizer.json"
    assert manifest["tokenizer_sha256"] == convert.records.file_sha256(model_dir / "tokenizer.json")


def test_the_conversion_is_a_typed_object_whose_errors_use_the_doors_names(tmp_path):
    """`convert text` and a run's data.source=hf: share data/text_conversion.py; its errors
    name each setting as the door the user came through spells it."""
    from paisoar_jax.data.text_conversion import TextConversion, convert_text

    (tmp_path / "a.txt").write_text("hello")
    summary = convert_text(TextConversion(tmp_path / "out", input=(str(tmp_path / "a.txt"),)))
    assert summary.startswith("wrote 1 documents, 6 tokens")
    with pytest.raises(UserError, match="give --input or --from-hf, one of them"):
        convert_text(TextConversion(tmp_path / "none"))
    keys = SettingNames({"tokenizer": "data.tokenizer", "format": "data.hf_format"}, "=")
    chat = TextConversion(tmp_path / "c", input=(str(tmp_path / "a.txt"),), format="chat")
    with pytest.raises(UserError, match="^data.hf_format=chat needs a tokenizer with a chat"):
        convert_text(dataclasses.replace(chat, names=keys))
    with pytest.raises(UserError, match="^--format chat needs a tokenizer with a chat"):
        convert_text(chat)
    missing = dataclasses.replace(chat, tokenizer=str(tmp_path / "nope.json"), names=keys)
    with pytest.raises(UserError, match="^data.tokenizer=.*nope.json: no such file"):
        convert_text(missing)
