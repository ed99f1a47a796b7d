"""LoRA adapters to and from PEFT (paisoar_jax/tools/hf/peft.py), checked against peft itself.

A tiny random Llama and GPT-2 are built with transformers, imported, LoRA fine-tuned a few
steps, and exported: `peft.PeftModel.from_pretrained` over transformers' base model must
give our logits, with no warning from PEFT.
"""

import json
import warnings

import jax
import numpy as np
import peft
import pytest
import torch  # the [test] extra's reference implementation (never imported by the library)
import transformers
from flax import nnx

import paisoar_jax
from paisoar_jax.checkpointing.weights import checkpoint_step, load_weights
from paisoar_jax.config import LoraConfig, load_config
from paisoar_jax.errors import UserError
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.zoo import zoo_workload
from paisoar_jax.tools import hf
from paisoar_jax.tools.hf import peft as peft_format

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 24))
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)


def hf_llama(width=64):
    config = transformers.LlamaConfig(
        **{**SMALL, "hidden_size": width},
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def hf_gpt2():
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def lora_fine_tune(imported, run_dir, *extra):
    """Three LoRA steps from an import, a high lr so that every B is clearly non-zero."""
    settings = [
        "mesh.data=2",
        "mesh.fsdp=4",
        "train.global_batch=8",
        "model.seq_len=24",
        "train.steps=3",
        "train.eval_every=0",
        "train.sample_bytes=0",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        "data.source=synthetic",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.dir={run_dir}",
        "lora.rank=4",
        "lora.alpha=8",
        *extra,
    ]
    paisoar_jax.fit(str(imported / "config.yaml"), settings)
    return run_dir


def our_logits(config_path, weights, overrides=()):
    """Our forward pass of `weights` (a run's step or an export) on one device."""
    config = load_config(str(config_path), ["mesh.data=1", "mesh.fsdp=1", *overrides])
    run = setup(config, zoo_workload(config), jax.devices()[:1])
    with jax.set_mesh(run.mesh):
        params, model_state = load_weights(weights, run.layout.abstract_state)
        model = nnx.merge(run.layout.graphdef, params, model_state or {})
        return np.asarray(model(TOKENS)), params


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """{name: (HF base dir, our run dir)} for a Llama and a GPT-2, LoRA fine-tuned."""
    root = tmp_path_factory.mktemp("peft")
    runs = {}
    for name, build in (("llama", hf_llama), ("gpt2", hf_gpt2)):
        build().save_pretrained(root / name)
        hf.hf_import(root / name, root / f"{name}_ours")
        runs[name] = (root / name, lora_fine_tune(root / f"{name}_ours", root / f"{name}_run"))
    return runs


def peft_model(base_dir, adapter_dir):
    """transformers' base with PEFT's adapter over it; any warning about the adapter fails.

    (PEFT's "missing adapter keys" is a UserWarning. Deprecations of the libraries' own
    APIs, which peft calls, are not about the adapter.)
    """
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    about_adapter = [
        str(warning.message)
        for warning in caught
        if not issubclass(warning.category, DeprecationWarning | FutureWarning)
    ]
    assert not about_adapter, about_adapter
    return model


@pytest.mark.checks("lora", families=["llama", "gpt2"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_peft_loads_the_adapter_and_gives_our_logits(tuned, tmp_path, name):
    base_dir, run_dir = tuned[name]
    summary = hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    assert "PEFT adapter" in summary
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(base_dir.absolute())  # for AutoPeftModel
    model = peft_model(base_dir, tmp_path / "adapter")
    _, step_dir, _ = checkpoint_step(run_dir)
    ours, params = our_logits(run_dir / "config.yaml", step_dir)
    bs = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if "_lora" in str(path)
    ]
    assert bs and all(np.abs(np.asarray(b)).max() > 0 for b in bs)  # trained, not zeros
    np.testing.assert_allclose(torch_logits(model), ours, atol=1e-4, rtol=0)
    # The adapter matters: the base alone gives other logits.
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert np.abs(torch_logits(base) - ours).max() > 1e-3


def test_the_merged_export_is_the_base_plus_the_scaled_product(tuned, tmp_path):
    base_dir, run_dir = tuned["llama"]
    hf.hf_export(run_dir, tmp_path / "merged", form="merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    _, step_dir, _ = checkpoint_step(run_dir)
    ours, _ = our_logits(run_dir / "config.yaml", step_dir)
    np.testing.assert_allclose(torch_logits(merged), ours, atol=1e-4, rtol=0)
    # On the arrays: W + alpha / r x A B, stacked over layers, heads as their own axes.
    rng = np.random.default_rng(0)
    weight, a, b = (
        rng.normal(size=(2, 4, 3, 5)),
        rng.normal(size=(2, 4, 3, 2)),
        rng.normal(size=(2, 2, 5)),
    )
    flat = {
        "blocks.out_kernel": weight,
        "blocks.out_kernel_lora.a": a,
        "blocks.out_kernel_lora.b": b,
    }
    folded = peft_format.merged(flat, LoraConfig(rank=2, alpha=6.0))
    expected = weight + 3.0 * np.einsum("lhei,lid->lhed", a, b)
    np.testing.assert_allclose(folded["blocks.out_kernel"], expected, rtol=1e-5, atol=1e-6)
    assert set(folded) == {"blocks.out_kernel"}


def test_a_peft_adapter_imports_and_trains_on(tuned, tmp_path):
    base_dir, run_dir = tuned["llama"]
    hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    hf.hf_import(base_dir, tmp_path / "again", adapter=tmp_path / "adapter")
    config = load_config(str(tmp_path / "again" / "config.yaml"))
    assert (config.lora.rank, config.lora.alpha) == (4, 8.0)
    ours, _ = our_logits(tmp_path / "again" / "config.yaml", tmp_path / "again")
    reference = torch_logits(peft_model(base_dir, tmp_path / "adapter"))
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    # config.yaml trains them on: its init_from holds the adapters, which are loaded.
    lora_fine_tune(tmp_path / "again", tmp_path / "on", "lora.rank=4")
    assert (tmp_path / "on" / "metrics.jsonl").is_file()


def test_bad_exports_and_imports_are_one_line(tuned, tmp_path):
    base_dir, run_dir = tuned["llama"]
    failures = []
    with pytest.raises(UserError) as error:
        hf.hf_export(run_dir, tmp_path / "plain")
    failures.append((error.value, "--peft"))
    hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    hf_llama(width=32).save_pretrained(tmp_path / "other")
    with pytest.raises(UserError) as error:
        hf.hf_import(tmp_path / "other", tmp_path / "mixed", adapter=tmp_path / "adapter")
    failures.append((error.value, "an adapter for another base model: 2 layers of width 64 ("))
    # It names both bases: the adapter's base_model_name_or_path, and this import's.
    assert f"({base_dir}), and this one ({tmp_path / 'other'}) has 2 layers of width 32" in str(
        error.value
    )
    with pytest.raises(UserError) as error:
        hf.hf_import(base_dir, tmp_path / "none", adapter=tmp_path / "plain_missing")
    failures.append((error.value, "not a PEFT adapter"))
    ours = tuned["gpt2"][0].parent / "gpt2_ours"
    with pytest.raises(UserError) as error:
        hf.hf_export(ours, tmp_path / "nothing", form="peft")
    failures.append((error.value, "holds no LoRA adapters"))
    zero = tmp_path / "rank_zero"
    zero.mkdir()
    (zero / "adapter_model.safetensors").write_bytes(
        (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    )
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (zero / "adapter_config.json").write_text(json.dumps({**settings, "r": 0}))
    with pytest.raises(UserError) as error:
        hf.hf_import(base_dir, tmp_path / "zero_import", adapter=zero)
    failures.append((error.value, "rank is at least 1"))
    for failure, expected in failures:
        assert expected in str(failure) and "\n" not in str(failure), str(failure)
    # From the command line: the line, and exit status 2.
    from conftest import run_module

    result = run_module("convert", "hf-export", run_dir, "--output", tmp_path / "cli", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--peft" in result.stderr


def test_generate_runs_with_the_adapter_as_peft_does(tuned, tmp_path):
    """Greedy tokens of a LoRA run (python -m paisoar_jax.generate) = PEFT's over the base."""
    import json

    from conftest import run_module

    base_dir, run_dir = tuned["llama"]
    hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    model = peft_model(base_dir, tmp_path / "adapter")
    prompt = [5, 17, 42, 8]
    model.generation_config.eos_token_id = None  # as many tokens as asked, as ours
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    arguments = ("--tokens", ",".join(map(str, prompt)), "--max-new", "8", "--greedy", "--json")
    result = run_module("generate", run_dir, *arguments, "--ignore-eos", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["tokens"] == expected
