"""The slow tier beside tests/models/test_llama.py: longer runs, more settings.

The Llama decoder: sharded steps match one device, every setting runs, bad shapes refused.
"""

import numpy as np
import pytest
from test_llama import losses


@pytest.mark.parametrize(
    "overrides",
    [
        ["remat.policy=full"],
        ["model.scan_layers=false", "model.tie_embeddings=false"],
        ["precision.policy=bf16", "mesh.zero=1"],
        ["precision.policy=fp8"],
        ["model.rope_scaling=llama3", "model.rope_original_length=16"],
    ],
)
def test_every_setting_trains(devices, overrides):
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
    values, _ = losses([*mesh, *overrides], devices[:4], steps=2)
    # That the setting compiles and runs sharded; the sharded step's numbers are checked
    # against one device above, and the rope scaling against transformers in test_hf.py.
    assert len(values) == 2 and all(np.isfinite(values))
