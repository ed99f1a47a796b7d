"""The slow tier beside tests/models/test_mtp.py: sharded steps, generation and the export."""

import numpy as np
import pytest
from conftest import assert_steps_match, step_losses
from test_mtp import LLAMA


@pytest.mark.checks("mtp", "sharded", families=["zoo:llama"])
def test_sharded_steps_with_two_modules_equal_one_device(devices):
    """Dense, the logits whole: the losses (the modules' in them) and the parameters."""
    depth = [*LLAMA, "model.mtp_depth=2", "train.global_batch=16"]
    single, single_state = step_losses([*depth, "mesh.data=1"], devices[:1])
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    sharded, sharded_state = step_losses([*depth, *mesh], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)


@pytest.mark.checks("mtp", families=["zoo:llama"])
def test_generation_and_the_hf_export_leave_the_modules_out(tmp_path, devices):
    import paisoar_jax
    from paisoar_jax.tools import hf

    run_dir = tmp_path / "run"
    settings = [*LLAMA, "model.mtp_depth=1", "train.steps=2", "train.eval_every=0"]
    settings += ["model.layers=2", "model.width=64", "model.seq_len=32", "train.global_batch=8"]
    settings += ["train.sample_bytes=0", "run.progress=false", f"run.dir={run_dir}"]
    paisoar_jax.fit(None, settings)
    hf.hf_export(run_dir, tmp_path / "hf")
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", framework="numpy") as handle:
        names = list(handle.keys())
    assert names and not any("mtp" in name for name in names)
    text = paisoar_jax.Generator(run_dir, devices[:1]).generate([[1, 2, 3]], 4)[0]
    assert len(text) == 4
