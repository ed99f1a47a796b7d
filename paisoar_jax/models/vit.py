"""Vision Transformer (Dosovitskiy et al., 2020) in Flax NNX: ViT-B/16 and a tiny variant.

Non-overlapping patches (a conv with stride = kernel = patch) become tokens, a learned class
token goes first, learned position embeddings are added, then pre-LN encoder blocks (as in
the GPT, without the causal mask) and a final layer norm; the classifier reads the class
token. ViT-B/16 at 224 px with 1000 classes has 86,567,656 parameters (timm's
vit_base_patch16_224). The blocks' parameters carry the GPT's logical names (embed, qkv,
heads, head_dim, mlp), so the same rules give FSDP and Megatron-style tensor parallelism.
With model.scan_layers=true the blocks are stacked and scanned, as the GPT's are, which is
what pipeline stages (mesh.stage) split.
Shape suffixes: B batch, H height, W width, C channels, P patch, T tokens, D width,
K heads, E head width, F MLP width, N classes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from paisoar_jax.errors import UserError
from paisoar_jax.models.layers import (
    Conv,
    Dense,
    VisionConfig,
    build_blocks,
    check_image_shape,
    layer_norm,
    param,
    resolve_config,
    run_block,
)
from paisoar_jax.numerics import fp8
from paisoar_jax.numerics.precision import Policy, float32_island
from paisoar_jax.numerics.remat import recomputed_activation, wrap_block_call
from paisoar_jax.parallel.pipeline import scan_layers
from paisoar_jax.parallel.sharding import constrain
from paisoar_jax.runtime.platform import compile_platform

LAYER_NORM_EPSILON = 1e-6  # the ViT paper's (PyTorch's default is 1e-5)
TOKEN_AXES = ("batch", "length", "act_embed")


def attention(q_BxTxKxE: jax.Array, k_BxTxKxE: jax.Array, v_BxTxKxE: jax.Array) -> jax.Array:
    """Bidirectional attention via jax.nn.dot_product_attention (fp32 softmax inside).

    As in the GPT: XLA on CPU has no fp16 matmul with fp32 accumulation, so fp16 attention
    on CPU runs in fp32.
    """
    dtype = q_BxTxKxE.dtype
    if dtype == jnp.float16 and compile_platform() == "cpu":
        q_BxTxKxE, k_BxTxKxE, v_BxTxKxE = map(float32_island, (q_BxTxKxE, k_BxTxKxE, v_BxTxKxE))
    return jax.nn.dot_product_attention(q_BxTxKxE, k_BxTxKxE, v_BxTxKxE).astype(dtype)


class EncoderBlock(nnx.Module):
    """One pre-LN encoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: VisionConfig, policy: Policy, rngs: nnx.Rngs):
        D, K, F = config.width, config.heads, config.mlp_width
        E = D // K
        normal = nnx.initializers.truncated_normal(config.init_std)
        zeros = nnx.initializers.zeros
        self.policy = policy
        self.attention_norm = layer_norm(D, LAYER_NORM_EPSILON, rngs)
        self.qkv_kernel = param(rngs, normal, (D, 3, K, E), ("embed", "qkv", "heads", "head_dim"))
        self.qkv_bias = param(rngs, zeros, (3, K, E), ("qkv", "heads", "head_dim"))
        self.out_kernel = param(rngs, normal, (K, E, D), ("heads", "head_dim", "embed"))
        self.out_bias = param(rngs, zeros, (D,), ("embed",))
        self.mlp_norm = layer_norm(D, LAYER_NORM_EPSILON, rngs)
        self.mlp_in_kernel = param(rngs, normal, (D, F), ("embed", "mlp"))
        self.mlp_in_bias = param(rngs, zeros, (F,), ("mlp",))
        self.mlp_out_kernel = param(rngs, normal, (F, D), ("mlp", "embed"))
        self.mlp_out_bias = param(rngs, zeros, (D,), ("embed",))
        # precision.policy=fp8: each of the four matmuls keeps its own fp8 scaling state.
        self.fp8 = fp8.block_dots(policy)

    def __call__(self, x_BxTxD: jax.Array, train: bool | None = None) -> jax.Array:
        """Applies the block (`train` is accepted for a uniform interface: no dropout)."""
        cast = self.policy.cast_to_compute
        matmul = functools.partial(fp8.matmul, policy=self.policy, dots=self.fp8)
        h_BxTxD = cast(self.attention_norm(x_BxTxD))
        qkv_BxTx3xKxE = matmul("btd,dske->btske", h_BxTxD, self.qkv_kernel[...], "qkv")
        qkv_BxTx3xKxE = qkv_BxTx3xKxE + cast(self.qkv_bias[...])
        heads = ("batch", "length", "act_heads", "head_dim")
        q_BxTxKxE, k_BxTxKxE, v_BxTxKxE = (
            constrain(qkv_BxTx3xKxE[:, :, i], heads) for i in range(3)
        )
        attention_BxTxKxE = attention(q_BxTxKxE, k_BxTxKxE, v_BxTxKxE)
        # Tagged for the `minimal` remat policy, which keeps exactly these two values.
        attention_BxTxKxE = checkpoint_name(attention_BxTxKxE, "attention_out")
        out_BxTxD = matmul("btke,ked->btd", attention_BxTxKxE, self.out_kernel[...], "out")
        x_BxTxD = constrain(x_BxTxD + out_BxTxD + cast(self.out_bias[...]), TOKEN_AXES)

        h_BxTxD = cast(self.mlp_norm(x_BxTxD))
        hidden_BxTxF = matmul("btd,df->btf", h_BxTxD, self.mlp_in_kernel[...], "mlp_in")
        # Exact (erf) GELU, as in the ViT paper and timm.
        hidden_BxTxF = recomputed_activation(
            lambda x, bias: jax.nn.gelu(x + bias, approximate=False),
            hidden_BxTxF,
            cast(self.mlp_in_bias[...]),
        )
        hidden_BxTxF = checkpoint_name(
            constrain(hidden_BxTxF, ("batch", "length", "act_mlp")), "mlp_hidden"
        )
        out_BxTxD = matmul("btf,fd->btd", hidden_BxTxF, self.mlp_out_kernel[...], "mlp_out")
        out_BxTxD = out_BxTxD + cast(self.mlp_out_bias[...])
        return constrain(x_BxTxD + out_BxTxD, TOKEN_AXES)


def resolve_vit_config(config: VisionConfig) -> VisionConfig:
    """The config with the variant's shape filled in; refuses shapes ViT cannot take."""
    config = resolve_config(config, "vit")
    for key in ("heads", "mlp_width", "patch"):
        if getattr(config, key) < 1:
            raise UserError(f"model.{key} must be >= 1, got {getattr(config, key)}")
    if config.width % config.heads:
        raise UserError(
            f"model.width={config.width} is not divisible by model.heads={config.heads}"
        )
    if config.image_size % config.patch:
        raise UserError(
            f"model.image_size={config.image_size} does not suit {config.variant}: it must be "
            f"a multiple of model.patch={config.patch}"
        )
    return config


def token_count(config: VisionConfig) -> int:
    """Tokens per image: one per patch, plus the class token."""
    return (config.image_size // config.patch) ** 2 + 1


class ViT(nnx.Module):
    """Vision Transformer image classifier: NHWC images in, fp32 logits (B x N) out."""

    def __init__(
        self, config: VisionConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
    ) -> None:
        config = resolve_vit_config(config)
        self.config, self.policy, self.remat_policy = config, policy, remat_policy
        D, P = config.width, config.patch
        # The patch embedding is a dense layer over each P x P x C patch: LeCun init.
        self.patch_embedding = Conv(
            config.channels,
            D,
            P,
            policy,
            rngs,
            stride=P,
            padding=0,
            use_bias=True,
            kernel_init=nnx.initializers.lecun_normal(),
            names=("conv_in", "embed"),
        )
        self.class_token = param(rngs, nnx.initializers.zeros, (D,), ("embed",))
        position_init = nnx.initializers.normal(config.init_std)
        self.position_embedding = param(
            rngs, position_init, (token_count(config), D), ("length", "embed")
        )
        self.blocks = build_blocks(
            lambda rngs, _layer: EncoderBlock(config, policy, rngs),
            config.depth,
            config.scan_layers,
            rngs,
        )
        self.final_norm = layer_norm(D, LAYER_NORM_EPSILON, rngs)
        self.head = Dense(
            D,
            config.num_classes,
            policy,
            rngs,
            names=("embed", "classes"),
            kernel_init=nnx.initializers.truncated_normal(config.init_std),
            fp32_output=True,
        )

    def __call__(self, images_BxHxWxC: jax.Array, *, train: bool | None = None) -> jax.Array:
        """Class logits (fp32) for a batch of normalised image_size x image_size images."""
        check_image_shape(images_BxHxWxC, self.config)
        cast = self.policy.cast_to_compute
        images_BxHxWxC = constrain(images_BxHxWxC, ("batch", None, None, None))
        patches_BxHPxWPxD = self.patch_embedding(images_BxHxWxC)
        B, D = patches_BxHPxWPxD.shape[0], patches_BxHPxWPxD.shape[-1]
        tokens_BxTxD = patches_BxHPxWPxD.reshape(B, -1, D)
        class_token_Bx1xD = jnp.broadcast_to(cast(self.class_token[...]), (B, 1, D))
        x_BxTxD = jnp.concatenate([class_token_Bx1xD, tokens_BxTxD], axis=1)
        x_BxTxD = constrain(x_BxTxD + cast(self.position_embedding[...]), TOKEN_AXES)
        if self.config.scan_layers:  # a plain scan, or the pipeline of mesh.stage > 1
            graphdef, stacked_state = nnx.split(self.blocks)

            def step(x_BxTxD, block_state):
                return nnx.merge(graphdef, block_state)(x_BxTxD).astype(x_BxTxD.dtype), None

            block_step = wrap_block_call(step, self.remat_policy, scanned=True)
            x_BxTxD = scan_layers(block_step, x_BxTxD, stacked_state)
        else:
            for block in self.blocks:
                x_BxTxD = run_block(block, self.remat_policy, x_BxTxD, train=train)
        class_BxD = self.final_norm(x_BxTxD[:, 0])
        return constrain(self.head(class_BxD), ("batch", None))

    @staticmethod
    def flops_per_example(config: VisionConfig, param_count: int = 0) -> float:
        """Training FLOPs per image: 3 x forward, 2 FLOPs per multiply-add of every matmul.

        Counted from the shapes: the patch embedding, per block the qkv, output and MLP
        matmuls of every token (4 D^2 + 2 D F) plus attention's scores and mix (2 T^2 D),
        and the classifier. ViT-B/16 at 224 px (T = 197): 17.56 GMACs forward, so 105.4
        GFLOP per training image. `param_count` is unused.
        """
        return 6.0 * forward_macs(config)


def forward_macs(config: VisionConfig) -> int:
    """Multiply-adds of every matmul (and the patch conv) in one image's forward pass."""
    config = resolve_vit_config(config)
    D, F, T, P = config.width, config.mlp_width, token_count(config), config.patch
    patch_macs = (T - 1) * P * P * config.channels * D
    block_macs = T * (4 * D * D + 2 * D * F) + 2 * T * T * D
    return patch_macs + config.depth * block_macs + D * config.num_classes
