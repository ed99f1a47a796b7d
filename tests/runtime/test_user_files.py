"""Every file read from a user, truncated or empty: one UserError line naming the file.

Each reader is called as its door calls it (hf-import's, PEFT's, the tokenizers', the chat
template's, generate's, the YAML configs', JSONL conversion's, the document index's, the
exports' and checkpoints'); the CLI turns the same UserError into exit status 2.
"""

import json
import shutil

import numpy as np
import pytest
import yaml
from conftest import TINY
from safetensors.numpy import save_file

from paisoar_jax.checkpointing.weights import export_weights, read_params, run_config
from paisoar_jax.config import dump_yaml, load_config
from paisoar_jax.data.conversations import ChatTemplate, json_rows
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import end_of_sequence_ids
from paisoar_jax.inference.text import Text
from paisoar_jax.runtime.user_files import open_tokenizer
from paisoar_jax.tools.hf.peft import read_adapter_settings, read_adapter_tensors
from paisoar_jax.tools.hf.reader import SafetensorsReader


def hf_directory(tmp_path, sharded=False):
    directory = tmp_path / "hf"
    directory.mkdir()
    tensors = {"a.weight": np.ones((4, 4), np.float32), "b.weight": np.zeros(4, np.float32)}
    if sharded:
        for index, (name, value) in enumerate(tensors.items()):
            save_file({name: value}, str(directory / f"model-{index}.safetensors"))
        weight_map = {name: f"model-{i}.safetensors" for i, name in enumerate(tensors)}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}, indent=2))
    return directory


def safetensors_file(tmp_path):
    return hf_directory(tmp_path) / "model.safetensors", lambda path: SafetensorsReader(path.parent)


def shard(tmp_path):
    directory = hf_directory(tmp_path, sharded=True)
    return directory / "model-1.safetensors", lambda path: SafetensorsReader(directory)


def index(tmp_path):
    directory = hf_directory(tmp_path, sharded=True)
    return directory / "model.safetensors.index.json", lambda path: SafetensorsReader(directory)


def config_json(tmp_path):
    import transformers

    from paisoar_jax.models.families import model_config_from_hf
    from paisoar_jax.runtime.user_files import read_json

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, vocab_size=64)
    settings = transformers.LlamaConfig(num_attention_heads=2, **small).to_dict()
    path = hf_directory(tmp_path) / "config.json"
    path.write_text(json.dumps(settings, indent=2))
    return path, lambda path: model_config_from_hf(read_json(path), path)  # as hf-import reads


def adapter(tmp_path, name):
    directory = tmp_path / "adapter"
    directory.mkdir()
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0}
    (directory / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    lora_a = np.ones((2, 8), np.float32)
    save_file({"model.layers.0.self_attn.q_proj.lora_A.weight": lora_a},
              str(directory / "adapter_model.safetensors"))  # fmt: skip
    reader = read_adapter_settings if name == "adapter_config.json" else read_adapter_tensors
    return directory / name, lambda path: reader(directory)  # read_adapter's two readers


def tokenizer_file(chat_tokenizer, tmp_path, name, read):
    directory = shutil.copytree(chat_tokenizer, tmp_path / "tokenizer")
    return directory / name, lambda path: read(directory)


def generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}, indent=2))
    return tmp_path / "generation_config.json", lambda path: end_of_sequence_ids(
        "", [tmp_path], None
    )


def yaml_config(tmp_path):
    path = tmp_path / "my_run.yaml"
    path.write_text(dump_yaml(load_config(None, TINY)))
    return path, lambda path: load_config(str(path))


def run_config_yaml(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(load_config(None, TINY)))
    return path, run_config


def jsonl(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hello {i}"}]} for i in range(20)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, lambda path: list(json_rows(path))


def document_index(token_dataset):
    def read(path):
        return TokenRecords(path.parent).document_starts()

    return next(token_dataset.glob("*documents*.npy")), read


def export(tmp_path, name):
    params = {"dense": {"kernel": np.ones((64, 64), np.float32), "bias": np.zeros(64)}}
    export_weights(params, {}, tmp_path / "export")
    item = tmp_path / "export" / "params"
    target = item / name if name else max(item.glob("**/d/*"), key=lambda p: p.stat().st_size)
    return target, lambda path: read_params(tmp_path / "export")


READERS = {
    "model.safetensors": safetensors_file,
    "a safetensors shard": shard,
    "model.safetensors.index.json": index,
    "config.json": config_json,
    "adapter_config.json": lambda tmp_path: adapter(tmp_path, "adapter_config.json"),
    "adapter_model.safetensors": lambda tmp_path: adapter(tmp_path, "adapter_model.safetensors"),
    "generation_config.json": generation_config,
    "a YAML config": yaml_config,
    "a run's config.yaml": run_config_yaml,
    "JSONL": jsonl,
    "an export's _METADATA": lambda tmp_path: export(tmp_path, "_METADATA"),
    "an export's array data": lambda tmp_path: export(tmp_path, None),
}
TOKENIZER_READERS = {
    "tokenizer.json": ("tokenizer.json", lambda d: open_tokenizer(d / "tokenizer.json")),
    "tokenizer.json (generate)": ("tokenizer.json", lambda d: Text(d / "tokenizer.json", 300)),
    "tokenizer_config.json": ("tokenizer_config.json", lambda d: ChatTemplate(d / "x.json")),
}


def damage(path, how):
    data = path.read_bytes()
    cut = len(data) // 2
    if path.suffix == ".yaml":  # inside a key: a cut at a line's end is a shorter config
        cut = data.rfind(b"\n", 0, cut) + 5  # ("  den" of "  dense_layers: 0")
    path.write_bytes(data[:cut] if how == "truncated" else b"")


def assert_one_line_naming(path, call):
    with pytest.raises(UserError) as refused:
        call(path)
    message = str(refused.value)
    assert "\n" not in message and "Traceback" not in message, message
    # The file, or the directory that is one item (an Orbax export's params/).
    assert any(str(where) in message for where in (path, *path.parents[:3])), message
    return message


@pytest.mark.parametrize("how", ["truncated", "empty"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_broken_file_is_one_line_naming_it(tmp_path, reader, how):
    path, call = READERS[reader](tmp_path)
    call(path)  # whole, it reads
    damage(path, how)
    message = assert_one_line_naming(path, call)
    if how == "empty" and not reader.startswith("an export"):
        assert f"{path} is empty" in message, message


@pytest.mark.parametrize("how", ["truncated", "empty"])
@pytest.mark.parametrize("reader", list(TOKENIZER_READERS))
def test_a_broken_tokenizer_file_is_one_line_naming_it(chat_tokenizer, tmp_path, reader, how):
    name, read = TOKENIZER_READERS[reader]
    path, call = tokenizer_file(chat_tokenizer, tmp_path, name, read)
    call(path)
    damage(path, how)
    message = assert_one_line_naming(path, call)
    if how == "empty":
        assert f"{path} is empty" in message, message


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_a_broken_document_index_is_one_line_naming_it(token_dataset, tmp_path, how):
    dataset = shutil.copytree(token_dataset, tmp_path / "dataset")
    path, call = document_index(dataset)
    call(path)
    damage(path, how)
    assert_one_line_naming(path, call)


def test_a_run_config_cut_at_a_line_boundary_is_refused_as_truncated(tmp_path):
    path, read = run_config_yaml(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: len(lines) // 2]))  # parses: the rest would be defaults
    assert isinstance(yaml.safe_load(path.read_text()), dict)
    message = assert_one_line_naming(path, read)
    assert "that a run writes: the file is truncated or was edited" in message
