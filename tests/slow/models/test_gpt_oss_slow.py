"""The slow tier beside tests/models/test_gpt_oss.py: a sharded step equals one device's."""

import dataclasses

import numpy as np
import pytest
from conftest import assert_steps_match, step_losses
from test_gpt_oss import imported  # noqa: F401 (the module's fixture: the tiny import)

from paisoar_jax.config import load_config


@pytest.mark.checks("sharded", families=["gpt_oss"])
def test_a_sharded_gpt_oss_step_matches_one_device(imported, devices):
    """The import's own model section, trained from scratch over expert x data x tensor."""
    _, _, ours = imported
    config = dataclasses.asdict(load_config(str(ours / "config.yaml")).model)
    keys = ("qkv_bias", "out_bias", "attention_sinks", "sliding_window", "global_every")
    keys += ("scan_layers", "experts", "expert_bias", "expert_activation", "swiglu_limit")
    keys += ("rope_scaling", "rope_factor", "rope_original_length", "rope_truncate")
    model = [f"model.{key}={config[key]}" for key in keys]
    model += ["model.name=llama", "model.kv_heads=2", "model.head_width=16"]
    model += ["model.expert_mlp_width=48", "model.layers=2"]
    single, single_state = step_losses([*model, "mesh.data=1"], devices[:1])
    mesh = ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"]
    sharded, sharded_state = step_losses([*model, *mesh], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)
