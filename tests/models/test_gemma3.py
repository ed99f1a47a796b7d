"""Gemma 3 (text) and sliding windows, checked against transformers itself (no hub).

A tiny random Gemma3ForCausalLM (4 layers sliding over 8 tokens but every second, the
sliding ones with their own rotary base, linear scaling on the global ones, every norm's
scale randomised) goes through hf-import and hf-export with transformers' logits, decodes
transformers' greedy tokens from a prompt longer than the window, and trains sharded as
on one device.
"""

import numpy as np
import pytest
import torch
import transformers
from conftest import build_run
from test_generate import transformers_greedy
from test_hf import (
    ATTENTION,
    TOKENS,
    exported_with_its_weights,
    imported_copy,
    our_logits,
    torch_logits,
)

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.tools import hf

ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
}


def gemma3(**changes):
    """A 4-layer Gemma 3: sliding, global, sliding, global; heads of 32 over a width of 64."""
    settings = ATTENTION | dict(
        num_hidden_layers=4,
        vocab_size=96,
        intermediate_size=96,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24,
        rope_parameters=ROPE,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**settings | changes))
    with torch.no_grad():  # the (1 + w) norms start at w = 0, which would hide a lost one
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF model, its directory, our import)."""
    model = gemma3()
    return model, *imported_copy(model, tmp_path_factory.mktemp("gemma3"))


@pytest.mark.checks("import", "logits", families=["gemma3_text"])
@pytest.mark.parametrize("mesh", [["mesh.data=1"], ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_imported_gemma3_gives_transformers_logits(imported, devices, mesh):
    model, _, ours = imported
    logits, _ = our_logits(ours, devices[: 1 if len(mesh) == 1 else 4], mesh)
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-4
    config = load_config(str(ours / "config.yaml")).model
    assert (config.sliding_window, config.global_every, config.scan_layers) == (8, 2, False)
    assert (config.local_rope_theta, config.rope_scaling, config.rope_factor) == (1e3, "linear", 4)


@pytest.mark.checks("export", families=["gemma3_text"])
def test_the_export_loads_in_transformers_with_the_same_weights(imported, tmp_path):
    model, _, ours = imported
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert type(back).__name__ == "Gemma3ForCausalLM"
    assert back.config.layer_types == model.config.layer_types
    assert back.config.rope_parameters == model.config.rope_parameters
    assert np.abs(torch_logits(back, TOKENS) - torch_logits(model, TOKENS)).max() == 0.0


@pytest.mark.checks("greedy", families=["gemma3_text"])
def test_greedy_tokens_past_the_window_are_transformers(imported, devices):
    """A 20-token prompt over a window of 8: the cache's sliding layers see 8 slots."""
    model, _, ours = imported
    prompt = [int(token) for token in np.random.default_rng(1).integers(3, 96, 20)]
    generated = Generator(ours, devices[:1]).generate([prompt], 10)[0]
    assert generated == transformers_greedy(model, prompt, 10)


GEMMA = [
    "model.name=llama",
    "model.kv_heads=2",
    "model.head_width=16",
    "model.mlp_width=96",
    "model.layers=4",
    "model.scan_layers=false",
    "model.sliding_window=8",
    "model.global_every=2",
    "model.local_rope_theta=1000",
    "model.qk_norm=true",
    "model.norm_offset=true",
    "model.post_norms=true",
    "model.mlp_activation=gelu_tanh",
    "model.embed_scale=true",
    "model.query_scale_width=24",
]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not a Gemma 3"),
        ({"hidden_activation": "gelu"}, "hidden_activation=gelu is not a Gemma 3"),
        (
            {"layer_types": ["full_attention", "sliding_attention"] * 2},
            r"sliding_window=8 on layers \[1, 3\] of 4: the zoo's llama slides on every",
        ),
    ],
)
def test_a_gemma3_the_zoo_does_not_compute_is_one_line(tmp_path, changes, message):
    gemma3(**changes).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=message):
        hf.hf_import(tmp_path / "hf", tmp_path / "ours")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.global_every=6"], "model.global_every is for sliding-window blocks"),
        (
            ["model.sliding_window=8", "model.global_every=2"],
            "mixes sliding-window and global blocks, which one scanned stack cannot hold",
        ),
        (["model.name=gpt", "model.sliding_window=8"], "model.sliding_window is for model.name"),
        (["model.mlp_activation=relu"], "'relu' is not one of silu, gelu_tanh"),
        (["model.sliding_window=8", "model.global_every=1"], "makes every block global"),
        (["model.attention_sinks=true", "model.attention=cudnn"], "has no attention sinks"),
        (
            ["model.experts=4", "model.mlp_activation=gelu_tanh"],
            "every block has experts: set model.expert_activation",
        ),
        (["model.rope_beta_slow=0"], "model.rope_beta_slow must be a finite number > 0"),
    ],
)
def test_bad_window_settings_get_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["model.name=llama", *overrides])


def test_a_peft_adapter_onto_differing_blocks_is_one_line(imported, tmp_path):
    _, source, _ = imported
    with pytest.raises(UserError, match="blocks differ .* is not supported yet"):
        hf.hf_import(source, tmp_path / "ours", adapter=tmp_path / "adapter")


def test_a_sliding_window_over_context_parallelism_is_one_line(devices):
    with pytest.raises(UserError, match="model.sliding_window=8 with mesh.context > 1"):
        build_run(["model.name=llama", "model.sliding_window=8", "mesh.context=2"], devices[:2])


@pytest.mark.checks("import", "logits", "greedy", families=["mistral"])
def test_a_mistral_with_a_sliding_window_gives_transformers_logits_and_tokens(tmp_path, devices):
    """Before: refused ("sliding-window attention is not modelled yet")."""
    config = transformers.MistralConfig(
        **ATTENTION, vocab_size=96, intermediate_size=96, sliding_window=8
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    _, ours = imported_copy(model, tmp_path)
    logits, _ = our_logits(ours, devices[:1])
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-4
    prompt = list(range(3, 23))
    generated = Generator(ours, devices[:1]).generate([prompt], 10)[0]
    assert generated == transformers_greedy(model, prompt, 10)
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert (type(back).__name__, back.config.sliding_window) == ("MistralForCausalLM", 8)
