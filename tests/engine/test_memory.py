"""Per-device bytes of sharded arrays and of their abstract shapes."""

import jax
import numpy as np

from paisoar_jax.config import MeshConfig
from paisoar_jax.engine import memory
from paisoar_jax.parallel import sharding


def test_per_device_bytes_of_arrays_and_of_their_shapes(devices):
    mesh = sharding.build_mesh(MeshConfig(data=8), devices)
    whole = jax.device_put(np.zeros((8, 4), np.float32), sharding.replicated(mesh))
    split = jax.device_put(np.zeros((8, 4), np.float32), sharding.batch_sharding(mesh))
    assert memory.per_device_bytes(whole) == 128
    assert memory.per_device_bytes(split) == 16
    assert memory.per_device_bytes({"a": whole, "b": split}) == 144
    abstract = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=split.sharding)
    assert memory.per_device_bytes(abstract) == 16  # what plan reads before any array exists
