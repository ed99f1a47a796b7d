import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paisoar_jax.config import MeshConfig
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding


@pytest.mark.parametrize(
    "mesh_config, shape",
    [
        (MeshConfig(), {"data": 8}),
        (MeshConfig(data=2, fsdp=-1, tensor=2), {"data": 2, "fsdp": 2, "tensor": 2}),
        (MeshConfig(data=1, fsdp=8), {"data": 1, "fsdp": 8}),
        (MeshConfig(data=-1, tensor=4), {"data": 2, "tensor": 4}),
        (MeshConfig(stage=2, fsdp=2), {"data": 2, "stage": 2, "fsdp": 2}),
        (MeshConfig(fsdp=2, expert=2), {"data": 2, "fsdp": 2, "expert": 2}),
        (MeshConfig(fsdp=2, context=2), {"data": 2, "fsdp": 2, "context": 2}),
    ],
)
def test_mesh_shapes(mesh_config, shape, devices):
    """The axes not named in `shape` have size 1."""
    mesh = sharding.build_mesh(mesh_config, devices)
    whole = {"data": 1, "stage": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert dict(mesh.shape) == whole | shape
    assert mesh.axis_names == ("data", "stage", "fsdp", "expert", "context", "tensor")
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
    "mesh_config, message",
    [
        (MeshConfig(data=3), "needs 3 devices, but 8 are present"),
        (MeshConfig(data=2, fsdp=2, tensor=4), "needs 16 devices"),
        (MeshConfig(data=-1, fsdp=-1), "at most one of"),
        (MeshConfig(data=-1, tensor=3), "do not divide the 8 devices"),
        (MeshConfig(data=4, dcn_data=4), "needs 16 devices"),
        (MeshConfig(data=4, dcn_data=2), r"must equal the number of processes \(1\)"),
    ],
)
def test_bad_meshes(mesh_config, message, devices):
    with pytest.raises(UserError, match=message):
        sharding.build_mesh(mesh_config, devices)


def test_batch_must_split_over_the_batch_axes(devices):
    mesh = sharding.build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    assert sharding.batch_shards(mesh) == 4
    sharding.check_batch(16, 2, mesh)
    with pytest.raises(UserError, match="train.global_batch=6 is not divisible by the 4 batch"):
        sharding.check_batch(6, 1, mesh)
    with pytest.raises(UserError, match=r"micro-batch 2 with grad_accum=8"):
        sharding.check_batch(16, 8, mesh)


def test_rules_by_zero_stage():
    # The devices of a context split share the weights' shards as FSDP's do.
    assert sharding.parameter_rules(0)["embed"] == ("fsdp", "context")
    assert sharding.parameter_rules(0, optimizer_state=True)["embed"] == ("fsdp", "context")
    assert sharding.parameter_rules(1)["embed"] == ("fsdp", "context")
    assert sharding.parameter_rules(1, optimizer_state=True)["embed"] == (
        "data",
        "fsdp",
        "context",
    )
    assert sharding.parameter_rules(3)["embed"] == ("data", "fsdp", "context")
    for zero in (0, 1, 3):
        assert sharding.parameter_rules(zero)["heads"] == ("tensor",)
        assert sharding.parameter_rules(zero)["mlp"] == ("tensor",)


def test_logical_to_sharding(devices):
    mesh = sharding.build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    rules = sharding.parameter_rules(3)
    named = sharding.logical_to_sharding(P("embed", "mlp"), (8, 4), mesh, rules, "w")
    assert named.spec == P(("data", "fsdp"), "tensor")
    with pytest.raises(UserError, match=r"parameter w: dimension 1 \(mlp, size 3\)"):
        sharding.logical_to_sharding(P("embed", "mlp"), (8, 3), mesh, rules, "w")
    with pytest.raises(ValueError, match="no sharding rule"):
        sharding.logical_to_sharding(P("bogus"), (8,), mesh, rules, "w")


def test_constrain_is_a_no_op_without_a_mesh():
    x = np.ones((4, 2), np.float32)
    assert sharding.constrain(x, ("batch", None)) is x


def test_one_process_reads_every_row_of_the_batch(devices):
    for mesh_config in (MeshConfig(), MeshConfig(stage=2, fsdp=2)):
        mesh = sharding.build_mesh(mesh_config, devices)
        assert sharding.input_slot(mesh) == (0, 1)
        with jax.set_mesh(mesh):
            assert sharding.input_slot() == (0, 1)
