"""GPT-OSS, checked against transformers itself (no hub).

A tiny random GptOssForCausalLM (2 layers, the first sliding over 8 tokens, YaRN rotary
scaling, every bias and sink randomised, the clamp of its SwiGLU low enough to bind) goes
through hf-import and hf-export with transformers' logits, decodes transformers' greedy
tokens past the window, and trains sharded over experts as on one device.
"""

import json

import numpy as np
import pytest
import torch
import transformers
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

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0}
YARN |= {"truncate": False, "original_max_position_embeddings": 16, "rope_theta": 10_000.0}


def gpt_oss(intermediate_size=48):
    """2 layers (sliding, full), 4 experts of width 48, 2 per token, heads of 16."""
    config = transformers.GptOssConfig(
        **ATTENTION,
        vocab_size=96,
        intermediate_size=intermediate_size,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=0.5,
        rope_parameters=YARN,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # biases and sinks start at 0, which would hide a lost one
        for name, weight in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                weight.normal_(0, 0.5)
            if name.endswith("router.weight"):
                weight.mul_(20.0)  # clear choices: no tie broken by the last bit
            if name.endswith(("gate_up_proj", "down_proj")):
                weight.normal_(0, 0.3)
    return model


MESHES = [["mesh.data=1"], ["mesh.data=1", "mesh.expert=2", "mesh.tensor=2"]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF model, its directory, our import)."""
    model = gpt_oss()
    return model, *imported_copy(model, tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.checks("import", "logits", families=["gpt_oss"])
@pytest.mark.parametrize(
    "mesh", [["mesh.data=1"], ["mesh.data=1", "mesh.expert=2", "mesh.tensor=2"]]
)
def test_imported_gpt_oss_gives_transformers_logits(imported, devices, mesh):
    model, _, ours = imported
    logits, _ = our_logits(ours, devices[: 1 if len(mesh) == 1 else 4], mesh)
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-4
    config = load_config(str(ours / "config.yaml")).model
    assert (config.sliding_window, config.global_every, config.rope_scaling) == (8, 2, "yarn")
    assert (config.attention_sinks, config.expert_activation) == (True, "clamped_swiglu")


@pytest.mark.checks("export", families=["gpt_oss"])
def test_the_export_loads_in_transformers_with_the_same_weights(imported, tmp_path):
    """The gate and up, two arrays of ours, interleave back into one gate_up_proj."""
    model, _, ours = imported
    back = exported_with_its_weights(model, ours, tmp_path / "back")
    assert type(back).__name__ == "GptOssForCausalLM"
    assert back.config.rope_parameters == model.config.rope_parameters


@pytest.mark.checks("greedy", families=["gpt_oss"])
def test_greedy_tokens_past_the_window_are_transformers(imported, devices):
    model, _, ours = imported
    prompt = [int(token) for token in np.random.default_rng(1).integers(3, 96, 20)]
    generated = Generator(ours, devices[:1]).generate([prompt], 10)[0]
    assert generated == transformers_greedy(model, prompt, 10)


@pytest.mark.checks("import", "logits", families=["gpt_oss"])
def test_an_mxfp4_checkpoint_imports_as_transformers_dequantises_it(tmp_path, devices):
    """The published form: the experts as MXFP4 blocks and scales (random bytes here).

    Experts 64 wide: MXFP4's blocks of 32 divide every input width.
    """
    import safetensors.numpy
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = gpt_oss(intermediate_size=64)
    source, _ = imported_copy(model, tmp_path)
    stored = safetensors.numpy.load_file(str(source / "model.safetensors"))
    rng = np.random.default_rng(5)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            experts, inputs, outputs = weight.shape  # HF's (in, out): MXFP4 rows are out
            blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 124, (experts, outputs, inputs // 32), dtype=np.uint8)
            del stored[name]
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
            theirs = convert_moe_packed_tensors(
                torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32
            )
            weight.copy_(theirs)  # transformers' own decoding is the reference
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    settings = json.loads((source / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(settings))
    safetensors.numpy.save_file(stored, str(quantized / "model.safetensors"))
    hf.hf_import(quantized, tmp_path / "decoded")
    logits, _ = our_logits(tmp_path / "decoded", devices[:1])
    assert np.abs(logits - torch_logits(model, TOKENS)).max() < 1e-4


def test_another_quantization_is_one_line(imported, tmp_path):
    _, source, _ = imported
    settings = json.loads((source / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "bitsandbytes_4bit"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(UserError, match="stored in bitsandbytes_4bit.*dequantise them"):
        hf.hf_import(tmp_path / "hf", tmp_path / "ours")


def test_sinks_over_context_parallelism_are_one_line(devices):
    from conftest import build_run

    with pytest.raises(UserError, match="model.attention_sinks with mesh.context > 1"):
        build_run(["model.name=llama", "model.attention_sinks=true", "mesh.context=2"], devices[:2])
