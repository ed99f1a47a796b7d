"""DeepSeek-V3, checked against transformers itself (no hub).

A tiny random DeepseekV3ForCausalLM (3 layers: one dense, then 8 experts in 4 groups, 2 of
them a token's, a shared expert; latent queries, keys and values; YaRN with DeepSeek's
mscale; the router's balancing bias randomised) goes through hf-import and hf-export with
transformers' logits, decodes transformers' greedy tokens, and gives its logits sharded
over experts and heads (tests/slow/models: its sharded training). A second form (queries
projected directly, rotary halves, no YaRN) imports too.
"""

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import build_run
from test_generate import transformers_greedy
from test_hf import TOKENS, exported_with_its_weights, imported_copy, our_logits, torch_logits

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.models.decoding import empty_cache
from paisoar_jax.tools import hf

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN |= {"mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
YARN |= {"rope_theta": 10_000.0}


# 3 layers (dense, then experts), width 64, 4 heads of 16 + 8 rotated, values of 12, 8
# experts in 4 groups (2 a token's, within 2 groups): DeepSeek-V3's and V2's alike.
SHAPE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,
)


def deepseek(version: str = "V3", **changes):
    """A tiny random DeepseekV3 (or V2) ForCausalLM of SHAPE and `changes`, from seed 0.

    The routers scaled up (clear choices: no tie broken by the last bit), the latent norms
    and V3's router bias randomised (ones and zeros would hide a lost one).
    """
    config = getattr(transformers, f"Deepseek{version}Config")(**(SHAPE | changes))
    torch.manual_seed(0)
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("gate.weight"):
                weight.normal_(0, 1.0)
            if "layernorm" in name:
                weight.normal_(1.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.2)
    return model


def deepseek_v3(**changes):
    """DeepSeek-V3 with a query latent, a shared expert, scaled weights and YaRN."""
    settings = dict(q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5)
    return deepseek("V3", **(settings | {"rope_parameters": YARN} | changes))


# deepseek_v3_tiny's attention over conftest's TINY (2 layers of width 64)
LATENT = ["model.name=llama", "model.kv_latent_width=32", "model.rope_head_width=8"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF model, its directory, our import)."""
    model = deepseek_v3()
    return model, *imported_copy(model, tmp_path_factory.mktemp("deepseek_v3"))


@pytest.mark.checks("import", "logits", families=["deepseek_v3"])
@pytest.mark.parametrize(
    "mesh", [["mesh.data=1"], ["mesh.data=1", "mesh.expert=2", "mesh.tensor=2"]]
)
def test_imported_deepseek_v3_gives_transformers_logits(imported, devices, mesh):
    model, _, ours = imported
    logits, _ = our_logits(ours, devices[: 1 if len(mesh) == 1 else 4], mesh)
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-5
    config = load_config(str(ours / "config.yaml")).model
    assert (config.kv_latent_width, config.q_latent_width, config.rope_head_width) == (32, 48, 8)
    assert (config.router, config.router_groups, config.router_top_groups) == ("sigmoid", 4, 2)
    assert (config.dense_layers, config.shared_experts, config.router_scale) == (1, 1, 2.5)


@pytest.mark.checks("export", families=["deepseek_v3"])
def test_the_export_loads_in_transformers_with_the_same_weights(imported, tmp_path):
    """The router's bias (model state, not a parameter) goes back as HF's buffer."""
    model, _, ours = imported
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert np.abs(torch_logits(back) - torch_logits(model)).max() < 1e-6


@pytest.mark.checks("greedy", families=["deepseek_v3"])
def test_greedy_tokens_are_transformers(imported, devices):
    model, _, ours = imported
    """Two prompts of two lengths in one batch, the cache holding each position's latent."""
    rng = np.random.default_rng(1)
    prompts = [[int(token) for token in rng.integers(3, 96, length)] for length in (12, 7)]
    generated = Generator(ours, devices[:1]).generate(prompts, 8)
    assert generated == [transformers_greedy(model, prompt, 8) for prompt in prompts]
    latents, rotated = empty_cache(load_config(str(ours / "config.yaml")).model, 2, 20, "float32")
    assert latents.shape == (3, 2, 20, 1, 32) and rotated.shape == (3, 2, 20, 1, 8)


@pytest.mark.checks("import", "logits", families=["deepseek_v3"])
def test_direct_queries_and_rotary_halves_import_too(tmp_path, devices):
    """DeepSeek-V2-Lite's form: no query latent; rotary halves; no YaRN."""
    default = {"rope_type": "default", "rope_theta": 10_000.0}
    model = deepseek_v3(q_lora_rank=None, rope_interleave=False, rope_parameters=default)
    _, ours = imported_copy(model, tmp_path)
    logits, _ = our_logits(ours, devices[:1])
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-5
    exported_with_its_weights(model, ours, tmp_path / "back")


@pytest.mark.checks("import", "logits", "export", families=["deepseek_v2"])
def test_deepseek_v2_with_softmax_routing_in_groups_imports_and_exports(tmp_path, devices):
    """DeepSeek-V2's router: softmax, each group ranked by its best, weights only scaled."""
    model = deepseek(
        "V2",
        topk_method="group_limited_greedy",
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
    )
    _, ours = imported_copy(model, tmp_path)
    logits, _ = our_logits(ours, devices[:1])
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-5
    config = load_config(str(ours / "config.yaml")).model
    assert (config.router, config.router_renormalize, config.router_groups) == ("softmax", False, 4)
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert back.config.topk_method == "group_limited_greedy"


def test_latent_attention_over_context_parallelism_is_one_line(devices):
    with pytest.raises(UserError, match="model.kv_latent_width .* with mesh.context > 1"):
        build_run([*LATENT, "mesh.context=2"], devices[:2])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.kv_latent_width=0"], "model.q_latent_width is for multi-head latent"),
        (
            ["model.kv_latent_width=0", "model.q_latent_width=0", "model.rope_head_width=0"]
            + ["model.value_head_width=0"],
            "model.rope_interleave is for multi-head latent",
        ),
        (["model.rope_head_width=0"], "needs model.rope_head_width"),
        (["model.kv_heads=2"], "model.kv_heads=2 with multi-head latent attention"),
        (["model.sliding_window=8"], "model.sliding_window=8 with multi-head latent"),
        (["model.out_bias=true"], "model.out_bias=True with multi-head latent"),
        (["model.router_groups=3"], "do not split into model.router_groups=3"),
        (["model.router_top_groups=5"], "model.router_top_groups=5 is more than"),
        (["model.dense_layers=4"], "no layer would have experts"),
        (["model.scan_layers=true"], "model.dense_layers=1 puts dense blocks"),
    ],
)
def test_bad_latent_and_routing_keys_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config("deepseek_v3_tiny", overrides)


def test_a_quantized_checkpoint_is_one_line(imported, tmp_path):
    _, source, _ = imported
    settings = json.loads((source / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(UserError, match="quantization_config=.*dequantise it to bf16 first"):
        hf.hf_import(tmp_path / "hf", tmp_path / "ours")


V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
V3_YARN |= {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# DeepSeek-V2-Lite's config.json (transformers' defaults are DeepSeek-V2's own shape)
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, n_shared_experts=2)
V2_LITE |= dict(moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16)
V2_LITE |= dict(num_key_value_heads=16, n_routed_experts=64, kv_lora_rank=512, q_lora_rank=None)
V2_LITE |= dict(num_experts_per_tok=6, first_k_dense_replace=1, aux_loss_alpha=0.001)
V2_LITE |= dict(rope_parameters=V3_YARN | {"mscale": 0.707, "mscale_all_dim": 0.707})


@pytest.mark.parametrize(
    "config_name, version, settings",
    [
        ("deepseek_v3_671b", "V3", dict(rope_parameters=V3_YARN)),
        ("deepseek_v2_lite_16b", "V2", V2_LITE),
    ],
)
def test_a_shipped_real_size_config_is_what_its_config_json_imports_as(
    config_name, version, settings
):
    """The real config.json's settings (transformers' defaults are the V3 and V2 shapes)."""
    import dataclasses
    import pathlib

    from paisoar_jax.models import families

    hf = getattr(transformers, f"Deepseek{version}Config")(
        max_position_embeddings=163840, **settings
    )
    imported = families.model_config_from_hf(hf.to_dict(), pathlib.Path("config.json"))
    shipped = load_config(config_name).model
    differing = {
        field.name
        for field in dataclasses.fields(shipped)
        if getattr(shipped, field.name) != getattr(imported, field.name)
    }
    # the training window, kv_heads spelled out, the experts' capacity for plan (and V3's
    # balancing on, for pretraining)
    planned = {"seq_len", "kv_heads", "expert_capacity_factor"}
    assert differing == planned | ({"router_bias_rate"} if version == "V3" else set())


@pytest.mark.parametrize(
    "config_name, overrides, key",
    [
        ("deepseek_v3_tiny", ["model.post_norms=true"], "model.post_norms"),
        ("deepseek_v3_tiny", ["model.embed_scale=true"], "model.embed_scale"),
        ("deepseek_v3_tiny", ["model.mlp_activation=gelu_tanh"], "model.mlp_activation"),
        ("deepseek_v3_671b", ["model.rope_scaling=none"], "model.query_scale_width"),
        ("deepseek_v2_lite_16b", ["model.router_bias_rate=0.001"], "model.router_bias_rate"),
    ],
)
def test_an_export_refuses_what_no_hf_deepseek_computes(config_name, overrides, key):
    """Each changes our forward pass, and transformers' DeepSeek has no setting for it."""
    from paisoar_jax.models import families

    model = load_config(config_name, overrides).model
    with pytest.raises(UserError, match=f"an HF DeepSeek-V[23] .*this model has {key}="):
        families.hf_config(model)


def test_keys_a_config_json_leaves_out_take_transformers_defaults():
    """A hand-written DeepSeek-V3 config.json without its routing keys: transformers' 8 groups."""
    import pathlib

    from paisoar_jax.models import families

    shape = SHAPE | {"n_routed_experts": 32, "num_hidden_layers": 5}
    written = transformers.DeepseekV3Config(**shape).to_dict()
    for key in ("n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor"):
        del written[key]
    theirs = transformers.DeepseekV3Config(**written)
    ours = families.model_config_from_hf(written, pathlib.Path("config.json"))
    assert (ours.router_groups, ours.router_top_groups) == (theirs.n_group, theirs.topk_group)
    assert (ours.dense_layers, ours.router_scale) == (
        min(theirs.first_k_dense_replace, theirs.num_hidden_layers),
        theirs.routed_scaling_factor,
    )
