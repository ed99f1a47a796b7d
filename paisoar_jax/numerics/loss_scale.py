"""Loss scaling for fp16 training, as an optax transformation around the optimizer.

fp16 has a narrow range: small gradients underflow to zero. The step multiplies the loss by
`scale` before differentiating (`scale_loss`), and this transformation divides the gradients
back, once per optimizer step (so it composes with gradient accumulation, and clipping inside
the wrapped optimizer sees unscaled gradients). Dynamic mode:

- a step whose gradients hold an inf or nan is skipped: params and the wrapped optimizer's
  state (moments, counts) stay bit-identical, and the scale backs off (x0.5 by default, after
  `hysteresis` consecutive bad steps);
- after `growth_interval` finite steps in a row the scale grows (x2), never above max_scale.

Non-finite detection reduces over the whole global gradient: under jit on a sharded mesh
(and across processes) XLA makes that reduction global, so every device agrees.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from paisoar_jax.errors import UserError


class LossScaleState(NamedTuple):
    """Scale, counters and the wrapped optimizer's state."""

    scale: jax.Array  # fp32 scalar
    good_steps: jax.Array  # finite steps since the last change of scale
    bad_steps: jax.Array  # consecutive non-finite steps (for hysteresis)
    skipped_steps: jax.Array  # cumulative skipped steps
    last_finite: jax.Array  # bool: was the last step's gradient finite
    inner_state: optax.OptState


def all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite (a global reduction under jit)."""
    leaves = jax.tree.leaves(tree)
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]).all()


def loss_scaled(
    inner: optax.GradientTransformation,
    *,
    dynamic: bool = True,
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> optax.GradientTransformation:
    """Wraps `inner`: unscale, skip non-finite steps, adapt the scale (or keep it static).

    Extra arguments of `update` (the step's loss) go on to `inner`.
    """
    if not (min_scale <= initial_scale <= max_scale) or min_scale <= 0:
        raise UserError(
            f"loss scale {initial_scale} is outside [min_scale={min_scale}, max_scale={max_scale}]"
        )

    def init(params) -> LossScaleState:
        return LossScaleState(
            scale=jnp.asarray(initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            bad_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            last_finite=jnp.ones((), jnp.bool_),
            inner_state=inner.init(params),
        )

    inner = optax.with_extra_args_support(inner)

    def update(scaled_grads, state: LossScaleState, params=None, **extra_args):
        grads = jax.tree.map(lambda g: g / state.scale.astype(g.dtype), scaled_grads)
        finite = all_finite(grads)
        # Feed zeros to the inner optimizer on a bad step so no nan enters its math; its
        # result is discarded below anyway.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, inner_state = inner.update(safe_grads, state.inner_state, params, **extra_args)
        keep = lambda new, old: jnp.where(finite, new, old)
        inner_state = jax.tree.map(keep, inner_state, state.inner_state)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        scale, good_steps, bad_steps = state.scale, state.good_steps, state.bad_steps
        if dynamic:
            bad_steps = jnp.where(finite, 0, bad_steps + 1)
            back_off = bad_steps >= hysteresis
            good_steps = jnp.where(finite, good_steps + 1, 0)
            grow = good_steps >= growth_interval
            scale = jnp.where(grow, scale * growth_factor, scale)
            scale = jnp.where(back_off, scale * backoff_factor, scale)
            scale = jnp.clip(scale, min_scale, max_scale)
            good_steps = jnp.where(grow, 0, good_steps)
            bad_steps = jnp.where(back_off, 0, bad_steps)
        return updates, LossScaleState(
            scale=scale,
            good_steps=good_steps,
            bad_steps=bad_steps,
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
            last_finite=finite,
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def current_scale(opt_state) -> jax.Array | float:
    """The scale to multiply the loss by: the loss-scaled optimizer's, else 1."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else 1.0


def scale_metrics(opt_state) -> dict[str, jax.Array]:
    """loss_scale and the cumulative skipped_steps, for metrics.jsonl (1 and 0 unscaled)."""
    if not isinstance(opt_state, LossScaleState):
        return {"loss_scale": jnp.ones((), jnp.float32), "skipped_steps": jnp.zeros((), jnp.int32)}
    return {"loss_scale": opt_state.scale, "skipped_steps": opt_state.skipped_steps}
