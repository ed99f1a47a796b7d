"""Your own small transformer, sharded by rules in the config: FSDP x tensor parallel.

    python examples/own_transformer.py [section.key=value ...]

The model knows nothing of meshes: plain flax NNX layers, no sharding annotations. The
`sharding.rules` below say where each weight goes (regex on its path -> mesh axis per
dimension; paisoar_jax.plan_fit prints the table of what went where), and
the mesh is 2-way FSDP x 2-way tensor parallel. On a machine with one CPU this script
simulates 4 devices. The data: byte windows of the Python standard library's own source.
"""

import json
import os
import pathlib
import sys

# Simulated CPU devices for the 2 x 2 mesh (must be set before jax starts; GPUs ignore it).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import paisoar_jax  # noqa: E402

SEQ_LEN, VOCAB, WIDTH, HEADS, LAYERS = 64, 256, 128, 4, 2

RULES = [
    [r"attention\.(query|key|value)\.kernel", ["fsdp", "tensor", None]],  # (D, H, Dh)
    [r"attention\.(query|key|value)\.bias", ["tensor", None]],
    [r"attention\.out\.kernel", ["tensor", None, "fsdp"]],  # (H, Dh, D)
    [r"mlp_in\.kernel", ["fsdp", "tensor"]],  # (D, 4D)
    [r"mlp_in\.bias", ["tensor"]],
    [r"mlp_out\.kernel", ["tensor", "fsdp"]],  # (4D, D)
    [r"token_embedding\.embedding", [None, "fsdp"]],  # (V, D)
]


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=WIDTH, decode=False, rngs=rngs
        )
        self.mlp_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.mlp_in = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x_BxTxD, mask_1x1xTxT):
        """The residual stream after attention and MLP."""
        x_BxTxD = x_BxTxD + self.attention(self.attention_norm(x_BxTxD), mask=mask_1x1xTxT)
        h_BxTxF = jax.nn.gelu(self.mlp_in(self.mlp_norm(x_BxTxD)))
        return x_BxTxD + self.mlp_out(h_BxTxF)


class TinyDecoder(nnx.Module):
    """Token and position embeddings, a few blocks, a tied output head."""

    def __init__(self, rngs: nnx.Rngs):
        self.token_embedding = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (SEQ_LEN, WIDTH)) * 0.02
        )
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens_BxT):
        """Next-byte logits at every position."""
        T = tokens_BxT.shape[1]
        x_BxTxD = self.token_embedding(tokens_BxT) + self.position_embedding[:T]
        mask_1x1xTxT = nnx.make_causal_mask(jnp.ones((1, T)))
        for block in self.blocks:
            x_BxTxD = block(x_BxTxD, mask_1x1xTxT)
        return self.token_embedding.attend(self.final_norm(x_BxTxD))


def loss(model, tokens_BxT1, rng):
    """Next-byte cross-entropy; perplexity-free, just the mean loss."""
    logits_BxTxV = model(tokens_BxT1[:, :-1]).astype(jnp.float32)
    losses_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, tokens_BxT1[:, 1:])
    return losses_BxT.mean(), {}


def stdlib_windows(max_bytes: int = 1 << 21) -> np.ndarray:
    """Non-overlapping windows of SEQ_LEN + 1 bytes of the standard library's source."""
    text = bytearray()
    for path in sorted(pathlib.Path(os.__file__).parent.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    tokens = np.frombuffer(bytes(text[:max_bytes]), np.uint8).astype(np.int32)
    count = len(tokens) // (SEQ_LEN + 1)
    return tokens[: count * (SEQ_LEN + 1)].reshape(count, SEQ_LEN + 1)


if __name__ == "__main__":
    windows = stdlib_windows()
    held_out = len(windows) // 20
    overrides = [
        "run.name=own_transformer",
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        f"sharding.rules={json.dumps(RULES)}",  # YAML (so JSON too) on the command line
        "train.steps=200",
        "train.global_batch=16",
        "train.log_every=20",
        "train.eval_every=100",
        "optim.lr=1e-3",
        *sys.argv[1:],
    ]
    paisoar_jax.fit(
        None,
        overrides,
        model=lambda rngs: TinyDecoder(rngs),
        loss=loss,
        data=windows[held_out:],
        eval_data=windows[:held_out],
    )
