"""Shared building blocks: vision variants, convolutions, BatchNorm, remat, the two norms.

The layer norm and RMSNorm are the transformers' (GPT's and ViT's; the Llama family's);
the rest the vision models'.

The models read their shape from `config.VisionConfig` (the `model` section when model.name
is resnet, vgg or vit); `VARIANTS` fills the shape fields left at 0. Images are NHWC, conv
kernels HWIO. Shape suffixes: B batch, H height, W width, C channels, K kernel size, I in
features, O out features.

Train and eval. Every BatchNorm is a stock `nnx.BatchNorm` (running mean and variance are
`nnx.BatchStat` variables, not `nnx.Param`, so an optimizer over `nnx.Param` leaves them
alone). The models take `train: bool | None` as a keyword: True normalises with the batch
statistics and updates the running ones, False uses the running ones, None (the default)
follows each BatchNorm's `use_running_average` attribute, which flax's own switches set:
`model.eval()` / `model.train()` or `nnx.view(model, use_running_average=True)`. A pure train
step passes `train=True` and reads the updated statistics back as
`nnx.state(model, nnx.BatchStat)` after the call. Pass params and statistics through
`jax.grad` as plain dicts (`nnx.to_pure_dict`, as the trainer's state holds them): with
`nnx.State` arguments, flax 0.12 refuses BatchNorm's update (TraceContextError).

Global statistics. Under `jax.jit` with the batch sharded over devices, a BatchNorm's mean and
variance are plain reductions over the batch axis of a global array, so XLA inserts the
cross-device reduction itself: the statistics cover the whole global batch (what PyTorch's
SyncBatchNorm does), with no `axis_name` and no shard_map.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.config import LanguageModelConfig, VisionConfig
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.precision import Policy, float32_island, matmul_fp32_out
from paisoar_jax.numerics.remat import wrap_block_call

# The running statistics' decay (flax convention: PyTorch's momentum 0.1) and epsilon.
BATCH_NORM_MOMENTUM = 0.9
BATCH_NORM_EPSILON = 1e-5

# Each variant's family (the registry name) and the shape fields it fills when they are 0.
VARIANTS: dict[str, dict[str, int | str]] = {
    "resnet18": {"family": "resnet", "width": 64, "depth": 18},
    "resnet34": {"family": "resnet", "width": 64, "depth": 34},
    "resnet50": {"family": "resnet", "width": 64, "depth": 50},
    "resnet101": {"family": "resnet", "width": 64, "depth": 101},
    "resnet152": {"family": "resnet", "width": 64, "depth": 152},
    "vgg11": {"family": "vgg", "width": 64, "depth": 11, "mlp_width": 4096},
    "vgg13": {"family": "vgg", "width": 64, "depth": 13, "mlp_width": 4096},
    "vgg16": {"family": "vgg", "width": 64, "depth": 16, "mlp_width": 4096},
    "vgg19": {"family": "vgg", "width": 64, "depth": 19, "mlp_width": 4096},
    "vit_b16": {
        "family": "vit",
        "patch": 16,
        "width": 768,
        "depth": 12,
        "heads": 12,
        "mlp_width": 3072,
    },
    "vit_tiny": {
        "family": "vit",
        "patch": 4,
        "width": 64,
        "depth": 4,
        "heads": 4,
        "mlp_width": 256,
    },
}


# The variant a family gets when model.variant is empty.
DEFAULT_VARIANTS = {"resnet": "resnet50", "vgg": "vgg16", "vit": "vit_b16"}


def resolve_config(config: VisionConfig, family: str) -> VisionConfig:
    """`config` with the variant's shape filled in, checked to be a `family` model."""
    if not config.variant:
        config = dataclasses.replace(config, variant=DEFAULT_VARIANTS[config.name or family])
    if config.variant not in VARIANTS:
        raise UserError(
            f"model.variant={config.variant!r} is not one of {', '.join(sorted(VARIANTS))}"
        )
    defaults = dict(VARIANTS[config.variant])
    variant_family = defaults.pop("family")
    if variant_family != family or config.name not in ("", family):
        same = sorted(key for key, value in VARIANTS.items() if value["family"] == family)
        raise UserError(
            f"model.variant={config.variant!r} is not a {config.name or family} model "
            f"(one of {', '.join(same)})"
        )
    filled = {key: value for key, value in defaults.items() if getattr(config, key) == 0}
    config = dataclasses.replace(config, name=family, **filled)
    for key in ("image_size", "channels", "width", "depth"):  # num_classes: VisionConfig
        if getattr(config, key) < 1:
            raise UserError(f"model.{key} must be >= 1, got {getattr(config, key)}")
    return config


def param(rngs: nnx.Rngs, initializer, shape: tuple[int, ...], names: tuple) -> nnx.Param:
    """A parameter initialised by `initializer` and annotated with logical axis names."""
    return nnx.Param(nnx.with_partitioning(initializer, names)(rngs.params(), shape))


def build_blocks(create_block, count: int, scanned: bool, rngs: nnx.Rngs):
    """`count` blocks from `create_block(rngs, layer)`: stacked for scan, or a list.

    The stacked axis carries the logical name `layers`, which a pipelined mesh splits over
    its stages (sharding.py). A stack holds identical blocks: each is created as layer 0.
    """
    if not scanned:
        return nnx.List([create_block(rngs, layer) for layer in range(count)])

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(block_rngs: nnx.Rngs):
        return create_block(block_rngs, 0)

    return create(rngs)


def conv_output_size(size: int, kernel_size: int, stride: int, padding: int) -> int:
    """Spatial output size of a convolution or pooling window with symmetric padding."""
    return (size + 2 * padding - kernel_size) // stride + 1


# He initialisation over the fan-out, as torchvision's ResNet and VGG use for their convs.
HE_FAN_OUT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


class Conv(nnx.Module):
    """A 2-D convolution (NHWC input, HWIO kernel) computed in the policy's compute dtype.

    The kernel's logical axes are (None, None, *names), by default (None, None, conv_in,
    conv_out): the spatial dims stay whole, the rules table decides where channels go.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int,
        policy: Policy,
        rngs: nnx.Rngs,
        *,
        stride: int = 1,
        padding: int | None = None,
        use_bias: bool = False,
        kernel_init: Callable = HE_FAN_OUT,
        names: tuple[str, str] = ("conv_in", "conv_out"),
    ):
        shape = (kernel_size, kernel_size, in_features, out_features)
        self.kernel = param(rngs, kernel_init, shape, (None, None, *names))
        zeros = nnx.initializers.zeros
        self.bias = param(rngs, zeros, (out_features,), names[1:]) if use_bias else None
        self.policy, self.stride = policy, stride
        # Symmetric padding (PyTorch's): "SAME" pads stride-2 convs on one side only.
        self.padding = kernel_size // 2 if padding is None else padding

    def __call__(self, x_BxHxWxI: jax.Array) -> jax.Array:
        """The convolved images, B x H' x W' x O in the compute dtype."""
        cast = self.policy.cast_to_compute
        pad = (self.padding, self.padding)
        y_BxHxWxO = jax.lax.conv_general_dilated(
            cast(x_BxHxWxI),
            cast(self.kernel[...]),
            window_strides=(self.stride, self.stride),
            padding=(pad, pad),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.bias is not None:
            y_BxHxWxO = y_BxHxWxO + cast(self.bias[...])
        return y_BxHxWxO


class Dense(nnx.Module):
    """A matmul plus bias in the compute dtype; `fp32_output` gives fp32 results (logits)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        policy: Policy,
        rngs: nnx.Rngs,
        *,
        names: tuple[str, str],
        kernel_init: Callable,
        fp32_output: bool = False,
    ):
        self.kernel = param(rngs, kernel_init, (in_features, out_features), names)
        self.bias = param(rngs, nnx.initializers.zeros, (out_features,), names[1:])
        self.policy, self.fp32_output = policy, fp32_output

    def __call__(self, x_BxI: jax.Array) -> jax.Array:
        """The product with the kernel plus the bias, over the last axis of `x_BxI`."""
        cast = self.policy.cast_to_compute
        if self.fp32_output:  # its backward in the compute dtype, not fp32 x fp32
            y_BxO = matmul_fp32_out("...i,io->...o", cast(x_BxI), cast(self.kernel[...]))
        else:
            y_BxO = jnp.einsum("...i,io->...o", cast(x_BxI), cast(self.kernel[...]))
        bias = self.bias[...] if self.fp32_output else cast(self.bias[...])
        return y_BxO + bias


def layer_norm(width: int, epsilon: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """A layer norm computed and stored in fp32, its scale and bias on the `embed` axis.

    The norm of GPT's and ViT's blocks; the Llama family's is RMSNorm below.
    """
    return nnx.LayerNorm(
        width,
        epsilon=epsilon,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in fp32 (HF's LlamaRMSNorm).

    `axis`: the scale's logical axis name (`embed`, or `head_dim` for a head's norm).
    `offset`: the scale is 1 + w, w starting at 0 (Gemma's RMSNorm), so weight decay pulls
    it toward 1 as Gemma's training does.
    """

    def __init__(
        self, width: int, epsilon: float, rngs: nnx.Rngs, axis: str = "embed", offset=False
    ):
        self.epsilon, self.offset = epsilon, offset
        initial = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = param(rngs, initial, (width,), (axis,))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        """The normalised stream, fp32."""
        x = float32_island(x_BxTxD)
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
        return normed * (1.0 + self.scale[...] if self.offset else self.scale[...])


def norm_of(config: LanguageModelConfig) -> Callable[..., RMSNorm]:
    """The model's RMSNorm maker, `(width, epsilon, rngs, axis=...)`: offset as it says."""
    return functools.partial(RMSNorm, offset=config.norm_offset)


def gated_activation(kind: str, alpha: float = 1.702, limit: float = 7.0) -> Callable:
    """A gated MLP's hidden units, `(gate, up) -> hidden`: model.mlp_activation's kinds.

    Also model.expert_activation's. silu: SwiGLU (Llama's). gelu_tanh: GeGLU with tanh
    GELU (Gemma's, HF's gelu_pytorch_tanh). clamped_swiglu: GPT-OSS's, the gate capped at
    `limit` and the up clipped to +-`limit`, then (up + 1) x gate x sigmoid(`alpha` x gate).
    """
    if kind == "gelu_tanh":
        return lambda gate, up: jax.nn.gelu(gate, approximate=True) * up
    if kind == "clamped_swiglu":

        def clamped(gate, up):
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
            return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)

        return clamped
    return lambda gate, up: jax.nn.silu(gate) * up


def batch_norm(features: int, rngs: nnx.Rngs, zero_scale: bool = False) -> nnx.BatchNorm:
    """An fp32 `nnx.BatchNorm` over the last axis, every variable on the `norm` axis.

    Statistics, normalisation, scale and bias are all fp32 whatever the policy; the caller
    casts the result back (`normalize`). `zero_scale` starts the scale at 0 (a residual
    branch then starts as the identity: Goyal et al., 2017).
    """
    names = {"out_sharding": ("norm",)}
    norm = nnx.BatchNorm(
        features,
        momentum=BATCH_NORM_MOMENTUM,
        epsilon=BATCH_NORM_EPSILON,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        scale_init=nnx.initializers.zeros if zero_scale else nnx.initializers.ones,
        scale_metadata=names,
        bias_metadata=names,
        rngs=rngs,
    )
    # nnx.BatchNorm creates its running statistics without sharding metadata: annotate them
    # too, so the trainer derives a sharding for every variable of the state.
    norm.mean = nnx.BatchStat(norm.mean[...], **names)
    norm.var = nnx.BatchStat(norm.var[...], **names)
    return norm


def normalize(
    norm: nnx.BatchNorm, x_BxHxWxC: jax.Array, train: bool | None, policy: Policy
) -> jax.Array:
    """Applies `norm` in fp32 (batch or running statistics, see the module docstring)."""
    use_running_average = None if train is None else not train
    return policy.cast_to_compute(norm(x_BxHxWxC, use_running_average=use_running_average))


def run_block(block: nnx.Module, remat_policy: str, x: jax.Array, **static) -> jax.Array:
    """Calls `block(x, **static)`, under jax.checkpoint with the named remat policy.

    The block runs as a pure function of its state, so the BatchNorm statistics it updates
    come out of the checkpointed function and are written back to the block. `static` holds
    Python values (such as `train`) that select the computation and are not traced.
    """
    if remat_policy == "none":
        return block(x, **static)
    graphdef, state = nnx.split(block)

    # Plain dicts cross the checkpoint boundary: nnx.State's Variables would carry the outer
    # trace in, and BatchNorm may not write to a Variable of another trace.
    def forward(values, x):
        module = nnx.merge(graphdef, values)
        return module(x, **static), nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))

    y, batch_stats = wrap_block_call(forward, remat_policy, scanned=False)(
        nnx.to_pure_dict(state), x
    )
    nnx.update(block, batch_stats)
    return y


def check_image_shape(
    images_BxHxWxC: jax.Array, config: VisionConfig, any_size: bool = False
) -> None:
    """Refuses images whose size (unless `any_size`) or channels the model cannot take."""
    expected = (config.image_size, config.image_size, config.channels)
    shape = tuple(images_BxHxWxC.shape)
    if any_size and len(shape) == 4:
        expected = (*shape[1:3], config.channels)
    if len(shape) != 4 or shape[1:] != expected:
        raise UserError(
            f"{config.variant} takes B x {' x '.join(map(str, expected))} images (NHWC), "
            f"got shape {shape}"
        )
