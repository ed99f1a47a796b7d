"""Multi-token prediction (DeepSeek-V3's MTP): modules that each predict one token further.

Module k (1 .. model.mtp_depth) takes the stream of module k - 1 (the decoder's last block's
for k = 1) and the embeddings of the tokens k ahead, each normed; the two are joined and
projected back to the width, then run through one more block of the decoder's own kind
(its attention, MLP or experts); its normed output goes through the decoder's head to
predict the token k + 1 ahead. The embedding table and the head are the decoder's, shared.
The loss adds model.mtp_loss x the modules' mean cross-entropy (tasks/builtin.py) and
reports each as mtp_loss/k. Training only: generation and evaluation use the decoder
alone, and an export leaves the modules out. Shape suffixes: B batch, T time, D width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.models.layers import param
from paisoar_jax.models.stack import stream_of, with_stream
from paisoar_jax.numerics.precision import Policy


class PredictionModule(nnx.Module):
    """One depth of multi-token prediction: norms, a projection of both, a block, a norm."""

    def __init__(
        self, config: LanguageModelConfig, policy: Policy, rngs: nnx.Rngs, block_class, norm
    ):
        D = config.width
        self.policy = policy
        self.stream_norm = norm(D, config.norm_eps, rngs)
        self.embedding_norm = norm(D, config.norm_eps, rngs)
        normal = nnx.initializers.normal(config.init_std)
        # the normed stream's and the embeddings' halves of DeepSeek's 2D x D projection
        self.projection_kernel = param(rngs, normal, (2, D, D), ("mtp", "embed", "mtp"))
        self.block = block_class(config, policy, rngs, config.layers - 1)  # the last's kind
        self.out_norm = norm(D, config.norm_eps, rngs)

    def __call__(self, x, embeddings_BxTxD: jax.Array, run_block: Callable) -> tuple:
        """(the module's stream or PackedRows, its normed stream for the head, statistics).

        `x` the previous depth's stream (or PackedRows of it); `run_block(block, x)` runs a
        block as the decoder runs its own (rotary tables, remat).
        """
        cast = self.policy.cast_to_compute
        joined_BxTx2xD = jnp.stack(
            [cast(self.stream_norm(stream_of(x))), cast(self.embedding_norm(embeddings_BxTxD))],
            axis=2,
        )
        kernel_2xDxD = cast(self.projection_kernel[...])
        projected_BxTxD = jnp.einsum("btkd,kde->bte", joined_BxTx2xD, kernel_2xDxD)
        x, statistics = run_block(self.block, with_stream(x, projected_BxTxD))
        return x, cast(self.out_norm(stream_of(x))), statistics


def ahead(x_BxT: jax.Array, k: int, fill=0) -> jax.Array:
    """Each position's value k positions on (`fill` past the end): x[:, t + k]."""
    padding = jnp.full((x_BxT.shape[0], k), fill, x_BxT.dtype)
    return jnp.concatenate([x_BxT[:, k:], padding], axis=1)


def metric_names(model_config: LanguageModelConfig) -> tuple[str, ...]:
    """The metrics.jsonl fields of multi-token prediction: mtp_loss/k for each module."""
    return tuple(f"mtp_loss/{k}" for k in range(1, model_config.mtp_depth + 1))


def targets_ahead(
    targets_BxT: jax.Array, learned_BxT: jax.Array, segments_BxT: jax.Array | None, k: int
) -> tuple[jax.Array, jax.Array]:
    """Module k's targets (the token k + 1 ahead of each input) and their weights.

    A target past the window, one the loss skips, or one in another packed document than
    the input's is not learned.
    """
    learned_BxT = ahead(learned_BxT, k)
    if segments_BxT is not None:
        learned_BxT = learned_BxT * (ahead(segments_BxT, k, -1) == segments_BxT)
    return ahead(targets_BxT, k), learned_BxT
