"""VGG (Simonyan and Zisserman, 2014) in Flax NNX, NHWC: 11, 13, 16 or 19 layers.

Five stages of 3x3 convs (64, 128, 256, 512, 512 channels at the default width), each ended
by a 2x2 max pool, then three dense layers (4096, 4096, classes). Classic by default: conv
biases, no BatchNorm, VGG-16 has 138,357,544 parameters at 224 px and 1000 classes, as in
torchvision. `batch_norm=True` puts a BatchNorm after every conv and drops the conv biases
it makes redundant (torchvision's vgg16_bn keeps them: 4,224 fewer params here). No dropout.

The classifier reads the last feature map whole, so its input width follows the image
size: 7 x 7 x 512 = 25,088 at 224 px, 512 at 32 px (torchvision instead pools every size to
7 x 7 first). The image size must be a multiple of 32. The flattening order is H, W, C
(NHWC), not PyTorch's C, H, W: transpose fc1 when importing its weights. Shape suffixes:
B batch, H height, W width, C channels, F classifier width, N classes.
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
    normalize,
    resolve_config,
    run_block,
)
from paisoar_jax.numerics.precision import Policy
from paisoar_jax.parallel.sharding import constrain

# Depth -> convs in each of the five stages (the paper's configurations A, B, D, E).
DEPTHS: dict[int, tuple[int, ...]] = {
    11: (1, 1, 2, 2, 2),
    13: (2, 2, 2, 2, 2),
    16: (2, 2, 3, 3, 3),
    19: (2, 2, 4, 4, 4),
}
STAGE_MULTIPLIERS = (1, 2, 4, 8, 8)  # stage channels as multiples of `width`
DOWNSAMPLING = 2 ** len(STAGE_MULTIPLIERS)  # five 2x2 pools: the image shrinks 32x

# torchvision's VGG initialisation: N(0, 0.01^2) for the dense layers.
DENSE_INIT = nnx.initializers.normal(0.01)
IMAGE_AXES = ("batch", None, None, None)


class Stage(nnx.Module):
    """A run of 3x3 conv (+ BatchNorm) + ReLU layers, then a 2x2 max pool."""

    def __init__(
        self, in_features: int, features: int, convs: int, batch_norm_on: bool, policy, rngs
    ):
        self.convs = nnx.List(
            [
                Conv(first, features, 3, policy, rngs, use_bias=not batch_norm_on)
                for first in [in_features] + [features] * (convs - 1)
            ]
        )
        norms = [batch_norm(features, rngs) for _ in range(convs)] if batch_norm_on else []
        self.norms = nnx.List(norms)
        self.policy = policy

    def __call__(self, x_BxHxWxC: jax.Array, train: bool | None = None) -> jax.Array:
        """The stage's features at half the input's height and width."""
        for index, conv in enumerate(self.convs):
            x_BxHxWxC = conv(x_BxHxWxC)
            if self.norms:
                x_BxHxWxC = normalize(self.norms[index], x_BxHxWxC, train, self.policy)
            x_BxHxWxC = jax.nn.relu(x_BxHxWxC)
        x_BxHxWxC = jax.lax.reduce_window(
            x_BxHxWxC, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
        )
        return constrain(x_BxHxWxC, IMAGE_AXES)


def resolve_vgg_config(config: VisionConfig) -> VisionConfig:
    """The config with the variant's shape filled in; refuses sizes VGG cannot take."""
    config = resolve_config(config, "vgg")
    if config.depth not in DEPTHS:
        depths = ", ".join(map(str, DEPTHS))
        raise UserError(f"model.depth={config.depth} is not a VGG depth ({depths})")
    if config.image_size % DOWNSAMPLING:
        raise UserError(
            f"model.image_size={config.image_size} does not suit VGG: it must be a multiple "
            f"of {DOWNSAMPLING} (five 2x2 pools)"
        )
    if config.mlp_width < 1:
        raise UserError(f"model.mlp_width must be >= 1, got {config.mlp_width}")
    return config


def classifier_in_features(config: VisionConfig) -> int:
    """Width of the flattened last feature map: (image_size / 32)^2 x last-stage channels."""
    side = config.image_size // DOWNSAMPLING
    return side * side * config.width * STAGE_MULTIPLIERS[-1]


class VGG(nnx.Module):
    """VGG image classifier: NHWC images in, fp32 logits (B x N) out."""

    def __init__(
        self, config: VisionConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
    ) -> None:
        config = resolve_vgg_config(config)
        self.config, self.policy, self.remat_policy = config, policy, remat_policy
        stages, in_features = [], config.channels
        for convs, multiplier in zip(DEPTHS[config.depth], STAGE_MULTIPLIERS, strict=True):
            features = config.width * multiplier
            stages.append(Stage(in_features, features, convs, config.batch_norm, policy, rngs))
            in_features = features
        self.stages = nnx.List(stages)
        F = config.mlp_width
        # Alternating (embed, mlp) / (mlp, embed) like a transformer MLP: FSDP splits the
        # 25,088-wide input of fc1 and tensor parallelism the hidden width.
        dense = dict(policy=policy, rngs=rngs, kernel_init=DENSE_INIT)
        self.fc1 = Dense(classifier_in_features(config), F, names=("embed", "mlp"), **dense)
        self.fc2 = Dense(F, F, names=("mlp", "embed"), **dense)
        self.head = Dense(
            F, config.num_classes, names=("embed", "classes"), fp32_output=True, **dense
        )

    def __call__(self, images_BxHxWxC: jax.Array, *, train: bool | None = None) -> jax.Array:
        """Class logits (fp32) for a batch of normalised image_size x image_size images."""
        check_image_shape(images_BxHxWxC, self.config)
        x_BxHxWxC = constrain(images_BxHxWxC, IMAGE_AXES)
        for stage in self.stages:
            x_BxHxWxC = run_block(stage, self.remat_policy, x_BxHxWxC, train=train)
        x_BxF = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
        x_BxF = constrain(jax.nn.relu(self.fc1(x_BxF)), ("batch", "act_mlp"))
        x_BxF = constrain(jax.nn.relu(self.fc2(x_BxF)), ("batch", None))
        return constrain(self.head(x_BxF), ("batch", None))

    @staticmethod
    def flops_per_example(config: VisionConfig, param_count: int = 0) -> float:
        """Training FLOPs per image: 3 x forward, 2 FLOPs per multiply-add of convs and dense.

        Counted from the conv and dense shapes (ReLU, pooling and BatchNorm left out).
        VGG-16 at 224 px: 15.47 GMACs forward, so 92.8 GFLOP per training image.
        `param_count` is unused.
        """
        return 6.0 * forward_macs(config)


def forward_macs(config: VisionConfig) -> int:
    """Multiply-adds of the convs and the dense layers in one image's forward pass."""
    config = resolve_vgg_config(config)
    macs, size, in_features = 0, config.image_size, config.channels
    for convs, multiplier in zip(DEPTHS[config.depth], STAGE_MULTIPLIERS, strict=True):
        features = config.width * multiplier
        macs += size * size * 9 * features * (in_features + (convs - 1) * features)
        size, in_features = size // 2, features
    F = config.mlp_width
    return macs + classifier_in_features(config) * F + F * F + F * config.num_classes
