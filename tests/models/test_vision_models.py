"""Vision models: shapes, parameter counts, FLOPs, logical names, precision, BatchNorm, remat."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from paisoar_jax.config import MeshConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models import layers, resnet, vgg, vit
from paisoar_jax.models.layers import VisionConfig
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.parallel import sharding

CLASSES = {"resnet": resnet.ResNet, "vgg": vgg.VGG, "vit": vit.ViT}
MACS = {"resnet": resnet.forward_macs, "vgg": vgg.forward_macs, "vit": vit.forward_macs}

# The entries the report proposes for sharding.parameter_rules (at ZeRO 0).
PROPOSED_RULES = {
    **sharding.parameter_rules(0),
    "conv_in": (),
    "conv_out": ("fsdp",),
    "norm": (),
    "classes": (),
}

# Tiny shapes: each compiles in seconds on 2 cores.
TINY = {
    "resnet18": VisionConfig(variant="resnet18", width=8, image_size=16, num_classes=10),
    "resnet50": VisionConfig(variant="resnet50", width=4, image_size=16, num_classes=10),
    "vgg16": VisionConfig(variant="vgg16", width=4, image_size=32, num_classes=10, mlp_width=16),
    "vgg16_bn": VisionConfig(
        variant="vgg16", width=4, image_size=32, num_classes=10, mlp_width=16, batch_norm=True
    ),
    "vit_tiny": VisionConfig(variant="vit_tiny", image_size=8, num_classes=10),
}


def family(config):
    return layers.VARIANTS.get(config.variant, {"family": "resnet"})["family"]


def build(config, policy="fp32", remat="none", rngs=None):
    """The model, really initialised: slow (every init op compiles), so used sparingly."""
    with nnx.use_eager_sharding(False):
        model_class = CLASSES[family(config)]
        return model_class(config, get_policy(policy), remat, rngs or nnx.Rngs(0))


def abstract_model(config, policy="fp32", remat="none"):
    """(graphdef, abstract state) of the model, with no array allocated."""
    graphdefs = []

    def create():
        graphdef, state = nnx.split(build(config, policy, remat))
        graphdefs.append(graphdef)
        return state

    state = jax.eval_shape(create)
    return graphdefs[0], state


def random_state(abstract_state, seed=0):
    """Host-made values for an abstract state: eager init would compile every op (slow)."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name in ("mean", "var"):  # BatchNorm running statistics start at 0 and 1
            return np.full(leaf.shape, float(name == "var"), leaf.dtype)
        noise = rng.normal(size=leaf.shape)
        if name == "scale":
            return (1 + 0.1 * noise).astype(leaf.dtype)
        fan_in = math.prod(leaf.shape[:-1]) if leaf.ndim > 1 else 100
        return (noise / np.sqrt(fan_in)).astype(leaf.dtype)

    values = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.asarray(fill(path, leaf)), nnx.to_pure_dict(abstract_state)
    )
    nnx.replace_by_pure_dict(abstract_state, values)  # in place: the state is our own copy
    return abstract_state


def tiny_model(name, policy="fp32", remat="none", seed=0):
    """(graphdef, state) of a TINY model with random values."""
    graphdef, state = abstract_model(TINY[name], policy, remat)
    return graphdef, random_state(state, seed)


def images_for(config, batch=4, seed=0):
    shape = (batch, config.image_size, config.image_size, config.channels)
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def apply(graphdef, state, images, train):
    model = nnx.merge(graphdef, state)
    return model(images, train=train), nnx.state(model, nnx.BatchStat)


jit_apply = jax.jit(apply, static_argnums=(0, 3))


def count(state):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))


def equations(jaxpr):
    """Every equation of a jaxpr, nested ones (pjit, checkpoint, custom_jvp) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from equations(sub)


def traced_macs(jaxpr):
    """Multiply-adds of every conv and dot_general in a jaxpr, from their shapes."""
    total = 0
    for eqn in equations(jaxpr):
        out = math.prod(eqn.outvars[0].aval.shape)
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += out * math.prod(lhs[d] for d in contracting)
        elif eqn.primitive.name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape
            rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
            total += out * math.prod(kernel[d] for d in rhs_spec[1:])
    return total


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("vgg16", 138_357_544),
        ("vgg19", 143_667_240),
        ("vit_b16", 86_567_656),
    ],
)
def test_param_counts_match_the_reference_models(variant, expected):
    _, state = abstract_model(VisionConfig(variant=variant))
    assert count(nnx.state(state, nnx.Param)) == expected


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_give_fp32_logits(name):
    config = TINY[name]
    logits, _ = jit_apply(*tiny_model(name), images_for(config), True)
    assert logits.shape == (4, 10) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("variant", ["resnet50", "vgg16", "vit_b16"])
def test_full_size_output_shapes_by_abstract_evaluation(variant):
    config = VisionConfig(variant=variant)
    graphdef, state = abstract_model(config)
    images = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
    logits, _ = jax.eval_shape(lambda s, x: apply(graphdef, s, x, True), state, images)
    assert logits.shape == (2, 1000) and logits.dtype == jnp.float32


@pytest.mark.parametrize(
    "config",
    [VisionConfig(variant=v) for v in ("resnet18", "resnet50", "vgg16", "vit_b16")]
    + [TINY["resnet18"], TINY["vgg16_bn"], TINY["vit_tiny"]],
    ids=lambda c: f"{c.variant}-{c.image_size}px",
)
def test_flops_per_example_counts_the_traced_convs_and_matmuls(config):
    graphdef, state = abstract_model(config)
    images = jax.ShapeDtypeStruct(images_for(config, batch=1).shape, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda s, x: apply(graphdef, s, x, False))(state, images)
    assert MACS[family(config)](config) == traced_macs(jaxpr.jaxpr)
    model_class = CLASSES[family(config)]
    assert model_class.flops_per_example(config, 0) == 6 * traced_macs(jaxpr.jaxpr)


def test_resnet50_flops_follow_the_stated_convention():
    # 4.1 GMACs forward per 224 px image, x 2 FLOPs x 3 (forward + backward) ~ 24.6 GFLOP.
    flops = resnet.ResNet.flops_per_example(VisionConfig(variant="resnet50"), 25_557_032)
    assert flops == pytest.approx(24.6e9, rel=0.01)


@pytest.mark.parametrize("name", list(TINY))
def test_every_variable_has_logical_axis_names(name):
    _, state = abstract_model(TINY[name])
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    values = nnx.to_pure_dict(state)
    flat_specs = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    assert len(flat_specs) == len(jax.tree.leaves(values))
    for path, spec in flat_specs:
        leaf = values
        for key in path:
            leaf = leaf[key.key]
        where = jax.tree_util.keystr(path)
        assert len(spec) == leaf.ndim and any(spec), where
        assert all(axis is None or axis in PROPOSED_RULES for axis in spec), where


@pytest.mark.parametrize(
    "variant, mesh_shape",
    [("resnet50", (1, 8, 1)), ("vgg16", (2, 2, 2)), ("vit_b16", (1, 2, 4))],
)
def test_proposed_rules_shard_the_full_size_models(devices, variant, mesh_shape):
    """The proposed rules give every variable a valid sharding; FSDP splits the big ones."""
    data, fsdp, tensor = mesh_shape
    mesh = sharding.build_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices)
    _, state = abstract_model(VisionConfig(variant=variant, batch_norm=True))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    values = nnx.to_pure_dict(state)
    shardings = sharding.tree_shardings(specs, values, mesh, PROPOSED_RULES)
    split = {
        (leaf.size, sharding_.spec)
        for leaf, sharding_ in zip(jax.tree.leaves(values), jax.tree.leaves(shardings), strict=True)
        if leaf.size >= 1_000_000
    }
    assert split and all(any(spec) for _, spec in split)  # no big replicated variable


HEAVY = ("conv_general_dilated", "dot_general")


@pytest.mark.parametrize("name", ["resnet18", "vgg16_bn", "vit_tiny"])
def test_bf16_policy_computes_in_bf16_with_fp32_islands(name):
    config = TINY[name]
    graphdef, state = abstract_model(config, "bf16")
    images = images_for(config)
    jaxpr = jax.make_jaxpr(lambda s: apply(graphdef, s, images, True))(state)
    heavy = [e for e in equations(jaxpr.jaxpr) if e.primitive.name in HEAVY]
    operand_dtypes = {v.aval.dtype for e in heavy for v in e.invars}
    assert operand_dtypes == {jnp.dtype(jnp.bfloat16)}, operand_dtypes
    logits, batch_stats = jaxpr.out_avals[0], jaxpr.out_avals[1:]
    assert logits.dtype == jnp.float32
    assert all(stat.dtype == jnp.float32 for stat in batch_stats)
    # BatchNorm and layer norm reduce in fp32: no bf16 reduction anywhere.
    reductions = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "reduce_sum"]
    assert reductions and all(e.invars[0].aval.dtype == jnp.float32 for e in reductions)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state))


def test_batch_norm_layer_reduces_over_the_global_batch(devices):
    mesh = sharding.build_mesh(MeshConfig(), devices)  # data=8
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(layers.batch_norm(4, nnx.Rngs(0)))
    # Each example gets its own offset and scale, so one device's shard has other statistics.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3, 3, 4)) * np.arange(1, 17)[:, None, None, None] / 4
    x = (x + np.arange(16)[:, None, None, None]).astype(np.float32)

    def step(state, x):
        norm = nnx.merge(graphdef, state)
        return norm(x, use_running_average=False), nnx.state(norm, nnx.BatchStat)

    sharded_x = jax.device_put(x, sharding.batch_sharding(mesh))
    replicated_state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(replicated_state, sharded_x).compile()
        y, stats = compiled(replicated_state, sharded_x)
    assert "all-reduce" in compiled.as_text()  # XLA adds the cross-device reduction itself
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    np.testing.assert_allclose(stats["mean"][...], 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["var"][...], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-4)
    shard_mean = x[:2].mean(axis=(0, 1, 2))  # what a per-device BatchNorm would have used
    assert not np.allclose(0.1 * shard_mean, stats["mean"][...], atol=1e-2)


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1)], ids=["data8", "data2-fsdp4"])
def test_resnet_batch_statistics_sharded_equal_one_device(devices, mesh_shape):
    config = TINY["resnet18"]
    graphdef, state = tiny_model("resnet18")
    images = np.asarray(images_for(config, batch=16)) * np.linspace(0.5, 2, 16)[:, None, None, None]
    one_device = jax.device_put((state, images), devices[0])
    logits, stats = jit_apply(graphdef, *one_device, True)
    data, fsdp, tensor = mesh_shape
    mesh = sharding.build_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices)
    sharded_images = jax.device_put(images, sharding.batch_sharding(mesh))
    # Every variable where the proposed rules put it: with fsdp=4 the conv kernels are split.
    state_shardings = sharding.tree_shardings(
        nnx.to_pure_dict(nnx.get_partition_spec(state)),
        nnx.to_pure_dict(state),
        mesh,
        PROPOSED_RULES,
    )
    sharded_state = jax.device_put(nnx.to_pure_dict(state), state_shardings)
    nnx.replace_by_pure_dict(state, sharded_state)
    with jax.set_mesh(mesh):
        sharded_logits, sharded_stats = jit_apply(graphdef, state, sharded_images, True)
    assert {shard.data.shape for shard in sharded_logits.addressable_shards} == {(2, 10)}
    np.testing.assert_allclose(sharded_logits, logits, rtol=1e-4, atol=1e-5)
    for got, want in zip(jax.tree.leaves(sharded_stats), jax.tree.leaves(stats), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    before = jax.tree.leaves(nnx.state(state, nnx.BatchStat))
    assert any(not np.allclose(a, b) for a, b in zip(before, jax.tree.leaves(stats), strict=True))
    kernel = state["blocks"][7]["conv2"]["kernel"][...]
    assert kernel.sharding.spec == PartitionSpec(None, None, None, "fsdp" if fsdp > 1 else None)


def test_eval_mode_uses_the_running_statistics():
    config = TINY["resnet18"]
    graphdef, state = tiny_model("resnet18")
    model = nnx.merge(graphdef, state)
    # Running statistics away from the initial 0 and 1, as after some training.
    nnx.update(model, jit_apply(graphdef, state, images_for(config, seed=3), True)[1])
    graphdef, state = nnx.split(model)
    batch_a, batch_b = images_for(config, 4, seed=1), images_for(config, 4, seed=2)
    batch_b = batch_b.at[0].set(batch_a[0])
    eval_a, stats_after_eval = jit_apply(graphdef, state, batch_a, False)
    eval_b, _ = jit_apply(graphdef, state, batch_b, False)
    np.testing.assert_allclose(eval_a[0], eval_b[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.tree.leaves(stats_after_eval),
        jax.tree.leaves(nnx.state(state, nnx.BatchStat)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)  # eval leaves the running statistics alone
    train_a, _ = jit_apply(graphdef, state, batch_a, True)
    train_b, _ = jit_apply(graphdef, state, batch_b, True)
    assert not np.allclose(train_a[0], train_b[0], atol=1e-4)  # batch statistics do depend
    # flax's own switches: with them, train=None follows the running statistics.
    eval_view = nnx.view(model, use_running_average=True)
    np.testing.assert_allclose(jit_apply(*nnx.split(eval_view), batch_a, None)[0], eval_a)
    model.eval()
    np.testing.assert_allclose(jit_apply(*nnx.split(model), batch_a, None)[0], eval_a)
    assert not np.allclose(jit_apply(graphdef, state, batch_a, None)[0], eval_a)  # default


def gradients(name, remat):
    # Random params: at init the zero-scaled BatchNorms would hide most gradients.
    graphdef, state = tiny_model(name, remat=remat)
    graphdef, params, batch_stats = nnx.split(nnx.merge(graphdef, state), nnx.Param, nnx.BatchStat)
    config = TINY[name]
    images = images_for(config)
    labels = jnp.arange(4) % config.num_classes

    # Plain dicts through jax.grad, as the trainer's state holds them: nnx.State's Variables
    # would keep the outer trace, and BatchNorm may not update them from inside grad.
    def loss(params, batch_stats):
        model = nnx.merge(graphdef, params, batch_stats)
        log_probs = jax.nn.log_softmax(model(images, train=True))
        new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        return -jnp.take_along_axis(log_probs, labels[:, None], 1).mean(), new_stats

    pure = nnx.to_pure_dict
    return jax.jit(jax.grad(loss, has_aux=True))(pure(params), pure(batch_stats))


def test_real_initialisation():
    # The rbg generator compiles much faster than threefry on CPU; one jit builds it all.
    config = TINY["resnet18"]
    key = jax.random.key(0, impl="rbg")
    graphdef, _ = abstract_model(config)
    state = jax.jit(lambda: nnx.split(build(config, rngs=nnx.Rngs(params=key)))[1])()
    model = nnx.merge(graphdef, state)
    for block in model.blocks:
        assert not np.any(block.norm2.scale[...])  # zero_init_residual
        assert np.all(block.norm1.scale[...] == 1) and not np.any(block.norm1.mean[...])
        assert np.all(block.norm1.var[...] == 1)
    kernel = np.asarray(model.blocks[-1].conv1.kernel[...])  # 3 x 3 x 32 x 64: He, fan-out
    assert np.std(kernel) == pytest.approx(np.sqrt(2 / (9 * 64)), rel=0.1)


@pytest.mark.parametrize(
    "config, message",
    [
        (VisionConfig(variant="resnet7"), "model.variant='resnet7' is not one of"),
        (VisionConfig(name="vit", variant="resnet50"), "is not a vit model"),
        (VisionConfig(variant="resnet50", depth=42), "not a ResNet depth"),
        (VisionConfig(variant="vgg16", image_size=100), "multiple of 32"),
        (VisionConfig(variant="vit_tiny", image_size=30), "multiple of model.patch=4"),
        (VisionConfig(variant="vit_tiny", width=30), "not divisible by model.heads=4"),
        (VisionConfig(variant="resnet18", channels=0), "model.channels must be >= 1"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(UserError, match=message):
        build(config)


def test_images_of_the_wrong_shape_are_refused():
    config = TINY["vit_tiny"]
    graphdef, state = abstract_model(config)
    wrong = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
    with pytest.raises(UserError, match=r"vit_tiny takes B x 8 x 8 x 3 images"):
        jax.eval_shape(lambda s, x: apply(graphdef, s, x, True), state, wrong)
