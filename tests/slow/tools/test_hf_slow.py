"""The slow tier beside tests/tools/test_hf.py: longer runs, more settings.

Hugging Face checkpoints in and out, checked against transformers itself (no hub).
"""

import json
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest
import transformers
from conftest import PYTHON, random_chats, subprocess_env
from flax import nnx
from test_generate import transformers_greedy
from test_hf import (
    TOKENS,
    exported_with_its_weights,
    fine_tune,
    imported,  # noqa: F401 (fixtures)
    imported_copy,
    llama,
    our_logits,
    qwen3_moe,
    readme_fine_tuning_commands,
    readme_supervised_fine_tuning_commands,
    torch_logits,
)

from paisoar_jax.checkpointing.weights import load_weights
from paisoar_jax.config import load_config
from paisoar_jax.inference.generator import Generator
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.zoo import zoo_workload
from paisoar_jax.tools import hf


@pytest.mark.checks("resume", "export", families=["llama", "mixtral"])
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_an_imported_model_fine_tunes_resumes_exactly_and_exports(
    imported, devices, tmp_path, name
):
    _, _, ours = imported[name]
    straight = fine_tune(ours, tmp_path / "straight", 20, "optim.schedule=constant")
    fine_tune(ours, tmp_path / "resumed", 10, "optim.schedule=constant")
    resumed = fine_tune(ours, tmp_path / "resumed", 20, "optim.schedule=constant")
    assert len(straight) == 20 and resumed[10:] == straight[10:]
    # Trained params -> HF: transformers gives our logits for them.
    hf.hf_export(tmp_path / "straight", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = load_config(str(tmp_path / "straight" / "config.yaml"), ["mesh.data=1", "mesh.fsdp=1"])
    run = setup(config, zoo_workload(config), devices[:1])
    from paisoar_jax.checkpointing.weights import checkpoint_step

    _, step_dir, _ = checkpoint_step(tmp_path / "straight")
    with jax.set_mesh(run.mesh):
        params, _ = load_weights(step_dir, run.layout.abstract_state)
        logits = nnx.merge(run.layout.graphdef, params, {})(TOKENS)
    assert np.abs(torch_logits(loaded) - np.asarray(logits)).max() < 1e-4


def test_the_readme_fine_tuning_sequence_runs_as_written(tmp_path):
    """Import, convert JSONL with the model's tokenizer, fine-tune, export, generate.

    Before: the README's train line (no data.source) trained the imported BPE model on the
    byte-level corpus without a word and died at the end in sample.py (exit 1); the import
    pinned no tokenizer; the export wrote the training window as the model's positions and
    a tokenizer without its special tokens.
    """
    import tokenizers

    words = ["<eos>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far"]
    vocabulary = {word: index for index, word in enumerate(words)}
    vocabulary |= {f"w{index}": index for index in range(len(words), 96)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<eos>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    llama().save_pretrained(tmp_path / "hf")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(tmp_path / "hf")
    (tmp_path / "my_texts").mkdir()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words[1:], 6)) for _ in range(300)]
    text = "".join(json.dumps({"text": line}) + "\n" for line in lines)
    (tmp_path / "my_texts" / "stories.jsonl").write_text(text)
    small = ["train.steps=4", "train.global_batch=8", "model.seq_len=16", "train.eval_every=2"]
    small += ["run.progress=false", "mesh.data=1"]
    commands = readme_fine_tuning_commands()
    assert [command[2] for command in commands] == [
        "paisoar_jax.convert",
        "paisoar_jax.convert",
        "paisoar_jax.train",
        "paisoar_jax.convert",
        "paisoar_jax.generate",
    ]
    env = {**subprocess_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    outputs = []
    for command in commands:
        command = [PYTHON, *command[1:]]
        command = [str(tmp_path / "hf") if part == "HF_MODEL_DIR" else part for part in command]
        if "paisoar_jax.train" in command:
            command += small
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
        outputs.append(result.stdout + result.stderr)
    assert "starting from the weights of" in outputs[2] and "eval_perplexity" in outputs[2]
    assert not any("Metadata file does not exist" in text for text in outputs)  # absl's
    exported = json.loads((tmp_path / "tuned_hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 64  # the model's, not the window of 16
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned_hf")
    assert (loaded.eos_token, loaded.pad_token) == ("<eos>", "<eos>")
    # The byte-level corpus (the README's old train line) is refused for this model.
    refused = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.train", "--config", "imported/config.yaml", "run.dir=x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "data.source=embedded is byte-level text, but this model reads the tokens of" in (
        refused.stderr
    )
    # The README's LoRA quick start, in a folder of its own with the same texts.
    from doc_blocks import argv, command_lines, doc_block

    quick = tmp_path / "quick"
    shutil.copytree(tmp_path / "my_texts", quick / "my_texts")
    for line in command_lines(doc_block("quick-lora")):
        words = argv(line.replace("HF_MODEL_DIR", str(tmp_path / "hf")))[1]
        command = [PYTHON, *words[1:]] + (small if "paisoar_jax.train" in words else [])
        result = subprocess.run(command, cwd=quick, env=env, capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr[-2000:])
    assert json.loads((quick / "my_adapter" / "adapter_config.json").read_text())["r"] == 16


@pytest.mark.checks("sft", families=["llama"])
def test_the_readme_supervised_fine_tuning_commands_run_as_written(chat_tokenizer, tmp_path):
    """Chats converted with the imported model's template, trained on the responses alone
    (packed documents), exported, and loaded by transformers."""
    llama(vocab_size=300).save_pretrained(tmp_path / "hf")  # the tokenizer's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "hf" / name).write_bytes((chat_tokenizer / name).read_bytes())
    chats = random_chats(200)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    env = {**subprocess_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    small = ["train.steps=6", "train.global_batch=8", "model.seq_len=64", "train.eval_every=3"]
    small += ["run.progress=false", "mesh.data=2"]
    imported = ["-m", "paisoar_jax.convert", "hf-import", "--input", "hf", "--output", "imported"]
    commands = [imported, *(command[1:] for command in readme_supervised_fine_tuning_commands())]
    commands.append(["-m", "paisoar_jax.convert", "hf-export", "runs/sft", "--output", "sft_hf"])
    outputs = []
    for command in commands:
        command = [PYTHON, *command] + (small if "paisoar_jax.train" in command else [])
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
        outputs.append(result.stdout + result.stderr)
    assert "of them to learn" in outputs[1] and "eval_perplexity" in outputs[2]
    records = [json.loads(line) for line in (tmp_path / "runs/sft/metrics.jsonl").open()]
    assert records[-1]["loss"] < records[0]["loss"]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sft_hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "sft_hf")
    prompt = tokenizer.apply_chat_template(
        chats[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    generated = tuned.generate(prompt, max_new_tokens=2, do_sample=False)
    assert generated.shape[1] > prompt.shape[1]
    # Then the page's generation: the command line on the import and on the run, and Python.
    from doc_blocks import argv, command_lines, doc_block, without_optional

    for line in command_lines(doc_block("generate")):
        line = without_optional(line).replace("runs/default", "runs/sft")
        result = subprocess.run(
            [PYTHON, *argv(line)[1][1:]], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, (line, result.stderr[-2000:])
        assert result.stdout.strip()  # the completion it generated
    questions, expected = ["Hi", "Hello there"], ["a", "b"]
    program = doc_block("generator-python").text
    names = {"questions": questions, "expected": expected}
    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(program, names)  # the page's Python, as written, on this run
    finally:
        os.chdir(previous)
    assert len(names["answers"]) == 2 and all(isinstance(a, str) for a in names["answers"])
    assert len(names["tokens"]) == 2 and 0 <= names["exact"] <= 1


@pytest.mark.checks("import", "export", "logits", "greedy", families=["qwen3_moe"])
def test_a_qwen3_moe_with_dense_layers_between_round_trips(devices, tmp_path):
    """decoder_sparse_step=2 (before: refused): the blocks unrolled, experts on every second."""
    model = qwen3_moe(sparse_step=2)
    _, ours = imported_copy(model, tmp_path)
    config = load_config(str(ours / "config.yaml")).model
    assert (config.moe_every, config.scan_layers, config.layers) == (2, False, 4)
    logits, _ = our_logits(ours, devices[:1])
    assert np.abs(logits - torch_logits(model)).max() < 1e-4
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert back.config.decoder_sparse_step == 2
    prompt = [5, 17, 3, 88, 41, 9]
    generated = Generator(ours, devices[:1]).generate([prompt], 6)[0]
    assert generated == transformers_greedy(model, prompt, 6)
