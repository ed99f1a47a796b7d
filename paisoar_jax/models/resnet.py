"""ResNet (He et al., 2015) in Flax NNX, NHWC: basic blocks (18, 34), bottlenecks (50+).

The bottleneck is v1.5 (torchvision's, NVIDIA's): the stride-2 downsampling sits in the 3x3
conv rather than the first 1x1, about 0.5% more accurate than v1 for ~12% more FLOPs.
Convs have no bias (each feeds a BatchNorm); the last BatchNorm of every residual branch
starts with scale 0 (`zero_init_residual`), so every block starts as the identity, which
large-batch training (Goyal et al., 2017) relies on. Parameter counts match torchvision
(ResNet-50: 25,557,032 with 1000 classes). Train/eval switching and the global batch
statistics: see models/layers.py. Shape suffixes: B batch, H height, W width, C channels,
N classes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.errors import UserError
from paisoar_jax.models.layers import (
    Conv,
    Dense,
    VisionConfig,
    batch_norm,
    check_image_shape,
    conv_output_size,
    normalize,
    resolve_config,
    run_block,
)
from paisoar_jax.numerics.precision import Policy, float32_island
from paisoar_jax.parallel.sharding import constrain

# Depth -> (bottleneck blocks?, blocks per stage), as in the paper's Table 1.
DEPTHS: dict[int, tuple[bool, tuple[int, ...]]] = {
    18: (False, (2, 2, 2, 2)),
    34: (False, (3, 4, 6, 3)),
    50: (True, (3, 4, 6, 3)),
    101: (True, (3, 4, 23, 3)),
    152: (True, (3, 8, 36, 3)),
}
BOTTLENECK_EXPANSION = 4  # a bottleneck's output has 4x the channels of its 3x3 conv

# Classifier initialisation of Goyal et al. (2017): N(0, 0.01^2).
HEAD_INIT = nnx.initializers.normal(0.01)
IMAGE_AXES = ("batch", None, None, None)


class Shortcut(nnx.Module):
    """The projection shortcut (1x1 conv with stride, then BatchNorm) of a resizing block."""

    def __init__(self, in_features: int, features: int, stride: int, policy, rngs: nnx.Rngs):
        self.conv = Conv(in_features, features, 1, policy, rngs, stride=stride)
        self.norm = batch_norm(features, rngs)
        self.policy = policy

    def __call__(self, x_BxHxWxC: jax.Array, train: bool | None) -> jax.Array:
        """The projected input, shaped like the residual branch's output."""
        return normalize(self.norm, self.conv(x_BxHxWxC), train, self.policy)


class BasicBlock(nnx.Module):
    """Two 3x3 convs with BatchNorm and ReLU, plus the shortcut (ResNet-18/34)."""

    def __init__(self, in_features: int, features: int, stride: int, model_config, policy, rngs):
        self.conv1 = Conv(in_features, features, 3, policy, rngs, stride=stride)
        self.norm1 = batch_norm(features, rngs)
        self.conv2 = Conv(features, features, 3, policy, rngs)
        self.norm2 = batch_norm(features, rngs, zero_scale=model_config.zero_init_residual)
        resize = stride != 1 or in_features != features
        self.shortcut = Shortcut(in_features, features, stride, policy, rngs) if resize else None
        self.policy = policy

    def __call__(self, x_BxHxWxC: jax.Array, train: bool | None = None) -> jax.Array:
        """relu(branch(x) + shortcut(x))."""
        h_BxHxWxC = jax.nn.relu(normalize(self.norm1, self.conv1(x_BxHxWxC), train, self.policy))
        h_BxHxWxC = normalize(self.norm2, self.conv2(h_BxHxWxC), train, self.policy)
        shortcut = self.shortcut(x_BxHxWxC, train) if self.shortcut else x_BxHxWxC
        return constrain(jax.nn.relu(h_BxHxWxC + shortcut), IMAGE_AXES)


class Bottleneck(nnx.Module):
    """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand, plus the shortcut."""

    def __init__(self, in_features: int, features: int, stride: int, model_config, policy, rngs):
        out_features = features * BOTTLENECK_EXPANSION
        self.conv1 = Conv(in_features, features, 1, policy, rngs)
        self.norm1 = batch_norm(features, rngs)
        self.conv2 = Conv(features, features, 3, policy, rngs, stride=stride)
        self.norm2 = batch_norm(features, rngs)
        self.conv3 = Conv(features, out_features, 1, policy, rngs)
        self.norm3 = batch_norm(out_features, rngs, zero_scale=model_config.zero_init_residual)
        resize = stride != 1 or in_features != out_features
        self.shortcut = (
            Shortcut(in_features, out_features, stride, policy, rngs) if resize else None
        )
        self.policy = policy

    def __call__(self, x_BxHxWxC: jax.Array, train: bool | None = None) -> jax.Array:
        """relu(branch(x) + shortcut(x))."""
        h_BxHxWxC = jax.nn.relu(normalize(self.norm1, self.conv1(x_BxHxWxC), train, self.policy))
        h_BxHxWxC = jax.nn.relu(normalize(self.norm2, self.conv2(h_BxHxWxC), train, self.policy))
        h_BxHxWxC = normalize(self.norm3, self.conv3(h_BxHxWxC), train, self.policy)
        shortcut = self.shortcut(x_BxHxWxC, train) if self.shortcut else x_BxHxWxC
        return constrain(jax.nn.relu(h_BxHxWxC + shortcut), IMAGE_AXES)


def resolve_resnet_config(config: VisionConfig) -> VisionConfig:
    """The config with the variant's shape filled in; refuses depths with no block table."""
    config = resolve_config(config, "resnet")
    if config.depth not in DEPTHS:
        depths = ", ".join(map(str, DEPTHS))
        raise UserError(f"model.depth={config.depth} is not a ResNet depth ({depths})")
    return config


def stage_plan(config: VisionConfig) -> list[tuple[int, int, int]]:
    """(in channels, 3x3-conv channels, stride) of every residual block, in order."""
    bottleneck, blocks_per_stage = DEPTHS[config.depth]
    expansion = BOTTLENECK_EXPANSION if bottleneck else 1
    plan, in_features = [], config.width
    for stage, blocks in enumerate(blocks_per_stage):
        features = config.width * 2**stage
        for index in range(blocks):
            stride = 2 if stage > 0 and index == 0 else 1
            plan.append((in_features, features, stride))
            in_features = features * expansion
    return plan


def final_features(config: VisionConfig) -> int:
    """Channels of the last stage, which the classifier reads after pooling."""
    bottleneck, _ = DEPTHS[config.depth]
    return config.width * 8 * (BOTTLENECK_EXPANSION if bottleneck else 1)


class ResNet(nnx.Module):
    """ResNet image classifier: NHWC images in, fp32 logits (B x N) out."""

    def __init__(
        self, model_config: VisionConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
    ) -> None:
        model_config = resolve_resnet_config(model_config)
        self.config, self.policy, self.remat_policy = model_config, policy, remat_policy
        bottleneck, _ = DEPTHS[model_config.depth]
        block_class = Bottleneck if bottleneck else BasicBlock
        self.stem_conv = Conv(model_config.channels, model_config.width, 7, policy, rngs, stride=2)
        self.stem_norm = batch_norm(model_config.width, rngs)
        self.blocks = nnx.List(
            [
                block_class(in_features, features, stride, model_config, policy, rngs)
                for in_features, features, stride in stage_plan(model_config)
            ]
        )
        self.head = Dense(
            final_features(model_config),
            model_config.num_classes,
            policy,
            rngs,
            names=("embed", "classes"),
            kernel_init=HEAD_INIT,
            fp32_output=True,
        )

    def __call__(self, images_BxHxWxC: jax.Array, *, train: bool | None = None) -> jax.Array:
        """Class logits (fp32) for a batch of normalised images of any size."""
        check_image_shape(images_BxHxWxC, self.config, any_size=True)
        x_BxHxWxC = self.stem_conv(constrain(images_BxHxWxC, IMAGE_AXES))
        x_BxHxWxC = jax.nn.relu(normalize(self.stem_norm, x_BxHxWxC, train, self.policy))
        x_BxHxWxC = max_pool_3x3_stride_2(x_BxHxWxC)
        for block in self.blocks:
            x_BxHxWxC = run_block(block, self.remat_policy, x_BxHxWxC, train=train)
        # Global average pooling in fp32: a bf16 sum over 49+ positions loses digits.
        pooled_BxC = float32_island(x_BxHxWxC).mean(axis=(1, 2))
        return constrain(self.head(pooled_BxC), ("batch", None))

    @staticmethod
    def flops_per_example(config: VisionConfig, param_count: int = 0) -> float:
        """Training FLOPs per image: 3 x forward, 2 FLOPs per multiply-add of convs and head.

        Counts the conv and classifier multiply-adds from their shapes (BatchNorm, ReLU,
        pooling and the residual adds are left out, as in the usual figures), times 2 for
        FLOPs and times 3 for forward + backward. ResNet-50 at 224 px: 4.09 GMACs forward,
        24.5 GFLOP per training image (the "4.1 GMACs, ~24.6 GFLOP" convention); ResNet-18:
        1.81 GMACs, 10.9 GFLOP. `param_count` is unused (conv FLOPs do not follow it).
        """
        return 6.0 * forward_macs(config)


def max_pool_3x3_stride_2(x_BxHxWxC: jax.Array) -> jax.Array:
    """The stem's 3x3 max pool with stride 2 and padding 1 (padding never wins the max).

    The init value is a Python scalar so that JAX recognises a max pool, which it can
    differentiate (a generic windowed reduction it cannot).
    """
    return jax.lax.reduce_window(
        x_BxHxWxC,
        -jnp.inf,
        jax.lax.max,
        window_dimensions=(1, 3, 3, 1),
        window_strides=(1, 2, 2, 1),
        padding=((0, 0), (1, 1), (1, 1), (0, 0)),
    )


def forward_macs(config: VisionConfig) -> int:
    """Multiply-adds of the convs and the classifier in one image's forward pass."""
    config = resolve_resnet_config(config)
    bottleneck, _ = DEPTHS[config.depth]
    size = conv_output_size(config.image_size, 7, 2, 3)
    macs = size * size * 49 * config.channels * config.width
    size = conv_output_size(size, 3, 2, 1)  # max pool
    for in_features, features, stride in stage_plan(config):
        out_size = conv_output_size(size, 3, stride, 1)
        area, out_area = size * size, out_size * out_size
        if bottleneck:
            out_features = features * BOTTLENECK_EXPANSION
            macs += area * in_features * features  # 1x1 reduce, before the stride
            macs += out_area * 9 * features * features
            macs += out_area * features * out_features
        else:
            out_features = features
            macs += out_area * 9 * in_features * features
            macs += out_area * 9 * features * features
        if stride != 1 or in_features != out_features:
            macs += out_area * in_features * out_features
        size = out_size
    return macs + final_features(config) * config.num_classes
