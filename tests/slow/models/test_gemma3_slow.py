"""The slow tier beside tests/models/test_gemma3.py: sharded steps, a LoRA fine-tune PEFT loads."""

import numpy as np
import pytest
from conftest import assert_steps_match, step_losses
from test_gemma3 import GEMMA, gemma3
from test_hf import imported_copy
from test_peft import lora_fine_tune, our_logits, peft_model, torch_logits

from paisoar_jax.checkpointing.weights import checkpoint_step
from paisoar_jax.tools import hf


@pytest.mark.checks("lora", families=["gemma3_text"])
def test_a_lora_tuned_gemma3_exports_an_adapter_peft_loads_with_our_logits(tmp_path):
    """The blocks unrolled (sliding and global differ): each block's adapters its own."""
    base, ours = imported_copy(gemma3(), tmp_path)
    run_dir = lora_fine_tune(ours, tmp_path / "run")
    hf.hf_export(run_dir, tmp_path / "adapter", form="peft")
    model = peft_model(base, tmp_path / "adapter")
    _, step_dir, _ = checkpoint_step(run_dir)
    ours, _ = our_logits(run_dir / "config.yaml", step_dir)
    np.testing.assert_allclose(torch_logits(model), ours, atol=1e-4, rtol=0)


@pytest.mark.checks("sharded", families=["gemma3_text", "zoo:llama"])
def test_a_sharded_gemma3_step_matches_one_device(devices):
    single, single_state = step_losses([*GEMMA, "mesh.data=1"], devices[:1])
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    sharded, sharded_state = step_losses([*GEMMA, *mesh], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)
