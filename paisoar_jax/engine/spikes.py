"""Steps skipped on loss spikes (train.skip_spikes=K), as an optax wrapper of the optimizer.

A step whose loss exceeds the mean of the last WINDOW steps' losses by K standard deviations
is skipped: its update is zeros and the wrapped optimizer's state (moments, counts) stays as
it was, as a loss-scaled step with non-finite gradients is (numerics/loss_scale.py). A
spike's loss does not enter the window, so a run of spikes is judged against the losses
before it. Nothing is judged before MIN_LOSSES steps are in the window. The window, its
count and the skips so far are optimizer state: a checkpoint holds them and a resumed run
judges its next step as the uninterrupted one would.

The loss comes to `update` as optax's extra argument `loss` (the train step passes it);
the sum over the window is one reduction of a replicated vector, the same on every device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

WINDOW = 128  # the losses the mean and the deviation are taken over
MIN_LOSSES = 16  # steps in the window before a loss is judged


class SpikeState(NamedTuple):
    """The last WINDOW losses (a ring), how many were written, the skips, the inner state."""

    losses: jax.Array  # WINDOW fp32
    seen: jax.Array  # int32: losses written so far (the ring's next slot is seen % WINDOW)
    skipped_spikes: jax.Array  # int32, cumulative
    inner_state: optax.OptState


def spike_skipped(
    inner: optax.GradientTransformation, deviations: float
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner`: skip a step whose `loss` is `deviations` standard deviations high."""
    inner = optax.with_extra_args_support(inner)

    def init(params) -> SpikeState:
        return SpikeState(
            losses=jnp.zeros((WINDOW,), jnp.float32),
            seen=jnp.zeros((), jnp.int32),
            skipped_spikes=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
        )

    def update(grads, state: SpikeState, params=None, *, loss, **extra_args):
        loss = jnp.asarray(loss, jnp.float32)
        spike = is_spike(state.losses, state.seen, loss, deviations)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        keep = lambda new, old: jnp.where(spike, old, new)  # noqa: E731
        inner_state = jax.tree.map(keep, inner_state, state.inner_state)
        updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), updates)
        # A spike, or a loss that is not finite, stays out of the window.
        written = ~spike & jnp.isfinite(loss)
        losses = state.losses.at[state.seen % WINDOW].set(
            jnp.where(written, loss, state.losses[state.seen % WINDOW])
        )
        return updates, SpikeState(
            losses=losses,
            seen=state.seen + written.astype(jnp.int32),
            skipped_spikes=state.skipped_spikes + spike.astype(jnp.int32),
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def is_spike(losses_W: jax.Array, seen: jax.Array, loss: jax.Array, deviations: float):
    """Whether `loss` exceeds the window's mean by `deviations` of its standard deviations."""
    held_W = jnp.arange(WINDOW) < jnp.minimum(seen, WINDOW)
    count = jnp.maximum(jnp.sum(held_W), 1)
    mean = jnp.sum(jnp.where(held_W, losses_W, 0.0)) / count
    variance = jnp.sum(jnp.where(held_W, (losses_W - mean) ** 2, 0.0)) / count
    judged = seen >= MIN_LOSSES
    return judged & (loss > mean + deviations * jnp.sqrt(variance))


def spike_metrics(opt_state) -> dict[str, jax.Array]:
    """skipped_spikes for metrics.jsonl: the spike wrapper's count (within a loss scaler)."""
    for state in (opt_state, getattr(opt_state, "inner_state", None)):
        if isinstance(state, SpikeState):
            return {"skipped_spikes": state.skipped_spikes}
    return {}


def spiked(old_opt_state, new_opt_state) -> jax.Array | None:
    """Whether the step from `old` to `new` was skipped as a spike (None: no wrapper).

    The train step keeps such a step's model state too (a router's bias, BatchNorm's).
    """
    old, new = spike_metrics(old_opt_state), spike_metrics(new_opt_state)
    return new["skipped_spikes"] > old["skipped_spikes"] if new else None
