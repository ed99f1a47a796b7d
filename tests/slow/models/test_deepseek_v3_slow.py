"""The slow tier beside tests/models/test_deepseek_v3.py: sharded training, a LoRA fine-tune."""

import numpy as np
import pytest
from conftest import assert_steps_match, step_losses
from test_deepseek_v3 import deepseek_v3
from test_hf import imported_copy
from test_peft import lora_fine_tune, our_logits, peft_model, torch_logits

from paisoar_jax.checkpointing.weights import checkpoint_step
from paisoar_jax.tools import hf

# deepseek_v3_tiny's shape over conftest's TINY: latent attention, a dense block, then 8
# experts in 4 groups with a shared one, the bias balancing on.
DEEPSEEK = ["model.name=llama", "model.layers=3", "model.scan_layers=false"]
DEEPSEEK += ["model.kv_latent_width=32", "model.q_latent_width=48", "model.head_width=16"]
DEEPSEEK += ["model.rope_head_width=8", "model.value_head_width=12", "model.rope_interleave=true"]
DEEPSEEK += ["model.dense_layers=1", "model.experts=8", "model.shared_experts=1"]
DEEPSEEK += ["model.router=sigmoid", "model.router_groups=4", "model.router_top_groups=2"]
DEEPSEEK += ["model.router_scale=2.5", "model.router_bias_rate=0.01", "precision.policy=fp32"]


@pytest.mark.checks("sharded", families=["deepseek_v3", "zoo:deepseek_v3_tiny"])
def test_a_sharded_deepseek_v3_step_matches_one_device(devices):
    """Experts over 2 devices, heads over 2, FSDP over 2: the losses and the params.

    Bias balancing is on, so the later steps route by the biases the earlier ones moved.
    """
    single, single_state = step_losses([*DEEPSEEK, "mesh.data=1"], devices[:1])
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]
    sharded, sharded_state = step_losses([*DEEPSEEK, *mesh], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)


@pytest.mark.checks("lora", families=["deepseek_v3"])
def test_a_lora_tuned_deepseek_v3_exports_an_adapter_peft_loads_with_our_logits(tmp_path):
    """Adapters on the latent projections, named as PEFT names them; the bias held."""
    base, ours = imported_copy(deepseek_v3(), tmp_path)
    targets = "lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"
    run_dir = lora_fine_tune(ours, tmp_path / "run", targets)
    hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    model = peft_model(base, tmp_path / "adapter")
    _, step_dir, _ = checkpoint_step(run_dir)
    ours, _ = our_logits(run_dir / "config.yaml", step_dir)
    np.testing.assert_allclose(torch_logits(model), ours, atol=1e-4, rtol=0)
