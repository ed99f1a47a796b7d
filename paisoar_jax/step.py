"""The pure train and eval steps, and their jit with explicit shardings.

`train_step(state, batch) -> (state, metrics)` is one optimizer step. With
`train.grad_accum = k` it splits the batch into k micro-batches and accumulates their
gradients in a `lax.scan` inside the same compiled program, so the optimizer sees exactly
the gradient of the whole batch. A batch is int32 tokens of shape (B, T + 1): inputs are the
first T, targets the last T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paisoar_jax import loss_scale, sharding
from paisoar_jax.state import StateLayout, TrainState


def loss_fn(params, graphdef: nnx.GraphDef, tokens_BxT1: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of the model on one batch."""
    model = nnx.merge(graphdef, params)
    logits_BxTxV = model(tokens_BxT1[:, :-1])
    losses_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, tokens_BxT1[:, 1:])
    return losses_BxT.mean()


def _split_micro_batches(tokens_BxT1: jax.Array, count: int) -> jax.Array:
    """(B, ...) -> (count, B / count, ...), micro-batch j = rows j, j + count, j + 2 count...

    Interleaving (rather than cutting B into contiguous blocks) keeps every device's rows in
    every micro-batch, so no data moves between devices.
    """
    batch = tokens_BxT1.shape[0]
    micro = tokens_BxT1.reshape(batch // count, count, *tokens_BxT1.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(micro, (None, "batch", None))


def loss_and_grads(
    params,
    graphdef: nnx.GraphDef,
    tokens_BxT1: jax.Array,
    grad_accum: int,
    scale: jax.Array | float = 1.0,
    gradient_shardings=None,
):
    """Loss and gradients of `scale` x loss of the whole batch, over `grad_accum` micro-batches.

    The returned loss is unscaled; the gradients stay scaled (loss_scale.py unscales them once
    per optimizer step). With `gradient_shardings` (ZeRO >= 1) the accumulator lives in the
    optimizer-state layout, so each micro-batch's gradients are reduce-scattered into it
    rather than all-reduced, and each device holds only its slice of the sum.
    """

    def scaled_loss(params, tokens):
        loss = loss_fn(params, graphdef, tokens)
        return loss * scale, loss

    def grad_fn(params, tokens):
        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params, tokens)
        return loss, grads

    if grad_accum == 1:
        return grad_fn(params, tokens_BxT1)

    def in_layout(grads):
        if gradient_shardings is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, gradient_shardings)

    def accumulate(carry, micro_tokens):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, micro_tokens)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, in_layout(grads))), None

    zeros = (jnp.zeros((), jnp.float32), in_layout(jax.tree.map(jnp.zeros_like, params)))
    micro_batches = _split_micro_batches(tokens_BxT1, grad_accum)
    (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, zeros, micro_batches)
    return loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum)


def train_step(
    state: TrainState,
    tokens_BxT1: jax.Array,
    *,
    layout: StateLayout,
    schedule: optax.Schedule,
    grad_accum: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch; returns the new state and scalar metrics."""
    scale = loss_scale.current_scale(state.opt_state)
    loss, grads = loss_and_grads(
        state.params, layout.graphdef, tokens_BxT1, grad_accum, scale, layout.gradient_shardings
    )
    # ZeRO >= 1: gradients go straight to the optimizer-state layout (a reduce-scatter).
    grads = jax.lax.with_sharding_constraint(grads, layout.gradient_shardings)
    updates, opt_state = layout.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads) / scale,
        "lr": schedule(state.step),
        **loss_scale.scale_metrics(opt_state),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, tokens_BxT1: jax.Array, *, layout: StateLayout) -> jax.Array:
    """Mean loss on one held-out batch."""
    return loss_fn(params, layout.graphdef, tokens_BxT1)


def jit_train_step(
    layout: StateLayout, schedule: optax.Schedule, grad_accum: int, mesh: Mesh
) -> jax.stages.Wrapped:
    """train_step jitted once: explicit in/out shardings, the state donated."""
    step = functools.partial(train_step, layout=layout, schedule=schedule, grad_accum=grad_accum)
    return jax.jit(
        step,
        in_shardings=(layout.shardings, sharding.batch_sharding(mesh)),
        out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )


def jit_eval_step(layout: StateLayout, mesh: Mesh) -> jax.stages.Wrapped:
    """eval_step jitted with the params' shardings."""
    return jax.jit(
        functools.partial(eval_step, layout=layout),
        in_shardings=(layout.shardings.params, sharding.batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )
