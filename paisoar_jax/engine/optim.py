"""The optax chain: clipping, then AdamW, SGD, LAMB, LARS or Muon on a warmup-then-schedule lr.

The schedule is a linear warmup, then cosine, linear or constant (optim.schedule).

Weight decay is masked off norms and biases. The learning rate can be rescaled for the global
batch (linear or sqrt against `optim.base_batch`), so a recipe tuned at one batch size moves
to another. Gradient accumulation is not an optax wrapper here: step.py accumulates the
micro-batches inside the one jitted step. Muon needs the parameters' logical axes
(engine/muon.py): its chain is built once the model is traced (muon.NeedsAxes).
"""

from __future__ import annotations

import math

import jax
import optax

from paisoar_jax.config import OptimConfig, PrecisionConfig
from paisoar_jax.engine.muon import NeedsAxes, build_muon, muon_axes_tree
from paisoar_jax.engine.spikes import spike_skipped
from paisoar_jax.numerics import loss_scale

NO_DECAY_NAMES = ("bias", "scale")  # layer-norm scales and every bias


def scaled_lr(optim_config: OptimConfig, global_batch: int) -> float:
    """The peak learning rate after the global-batch scaling rule."""
    if optim_config.lr_scaling == "none":
        return optim_config.lr
    ratio = global_batch / optim_config.base_batch
    return optim_config.lr * (ratio if optim_config.lr_scaling == "linear" else math.sqrt(ratio))


def build_lr_schedule(
    optim_config: OptimConfig, total_steps: int, global_batch: int
) -> optax.Schedule:
    """Linear warmup to the (scaled) peak lr, then cosine, linear or constant."""
    peak = scaled_lr(optim_config, global_batch)
    warmup = min(optim_config.warmup_steps, total_steps)
    final = peak * optim_config.final_lr_fraction
    decay_steps = max(total_steps - warmup, 1)
    if optim_config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim_config.final_lr_fraction)
    elif optim_config.schedule == "linear":
        decay = optax.linear_schedule(peak, final, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    # Warmup starts at peak / warmup rather than 0, so the first step already learns.
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, decay], [warmup])


def decay_mask(params) -> object:
    """True for every parameter that gets weight decay (not norms, not biases)."""

    def decays(path, _) -> bool:
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", str(last)))
        return not any(str(name).endswith(suffix) for suffix in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(decays, params)


def build_optimizer(
    optim_config: OptimConfig,
    total_steps: int,
    global_batch: int,
    precision: PrecisionConfig | None = None,
    skip_spikes: float = 0.0,
) -> tuple[optax.GradientTransformation | NeedsAxes, optax.Schedule]:
    """The optimizer chain (loss-scaled where the precision asks) and its lr schedule.

    Muon's is a NeedsAxes: the chain once the parameters' logical axes are known.
    `skip_spikes`: train.skip_spikes (wrap_optimizer).
    """
    lr_schedule = build_lr_schedule(optim_config, total_steps, global_batch)
    clip_norm = optim_config.clipping(own_optimizer=False)
    if optim_config.name == "muon":

        def with_axes(logical_specs, shapes) -> optax.GradientTransformation:
            axes = muon_axes_tree(logical_specs, shapes)
            muon = build_muon(optim_config, lr_schedule, axes, _adam(optim_config, lr_schedule))
            return wrap_optimizer(muon, clip_norm, precision, skip_spikes)

        return NeedsAxes(with_axes), lr_schedule
    if optim_config.name in ("adamw", "lamb"):  # lamb: Adam with a per-layer trust ratio
        optimizer = _adam(optim_config, lr_schedule, optim_config.name)
    elif optim_config.name == "lars":  # momentum SGD with a per-layer trust ratio
        optimizer = optax.lars(
            lr_schedule,
            weight_decay=optim_config.weight_decay,
            weight_decay_mask=decay_mask,
            trust_coefficient=optim_config.trust_coefficient,
            # Norms and biases keep plain SGD steps, as in the LARS paper's practice.
            trust_ratio_mask=decay_mask,
            momentum=optim_config.momentum,
            nesterov=optim_config.nesterov,
        )
    else:
        optimizer = optax.chain(
            optax.add_decayed_weights(optim_config.weight_decay, mask=decay_mask),
            optax.sgd(lr_schedule, momentum=optim_config.momentum, nesterov=optim_config.nesterov),
        )
    return wrap_optimizer(optimizer, clip_norm, precision, skip_spikes), lr_schedule


def _adam(
    optim_config: OptimConfig, lr_schedule: optax.Schedule, name: str = "adamw"
) -> optax.GradientTransformation:
    """AdamW (or LAMB) with the config's moments and decoupled decay, never on norms, biases."""
    adam_like = optax.adamw if name == "adamw" else optax.lamb
    return adam_like(
        lr_schedule,
        b1=optim_config.b1,
        b2=optim_config.b2,
        eps=optim_config.eps,
        weight_decay=optim_config.weight_decay,
        mask=decay_mask,
    )


def wrap_optimizer(
    optimizer: optax.GradientTransformation,
    clip_norm: float,
    precision: PrecisionConfig | None = None,
    skip_spikes: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """`optimizer` (the config's or a user's) in clipping, spike skipping and loss scaling.

    Clipping at `clip_norm` (0: none), the spike skipper at `skip_spikes` (0: none). The
    scaler only unscales the gradients and skips the steps whose gradients overflow.
    Its `update` takes the step's `loss` (optax's extra argument), which the spike skipper
    reads and any other part may ignore.
    """
    if clip_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
    if skip_spikes > 0:
        optimizer = spike_skipped(optimizer, skip_spikes)
    if precision is not None:
        mode, static_scale = precision.loss_scale_mode()
        if mode != "none":
            # Outermost, so clipping and the optimizer see unscaled gradients.
            optimizer = loss_scale.loss_scaled(
                optimizer,
                dynamic=mode == "dynamic",
                initial_scale=precision.initial_scale if mode == "dynamic" else static_scale,
                growth_interval=precision.growth_interval,
                hysteresis=precision.hysteresis,
                min_scale=min(precision.min_scale, static_scale),
                max_scale=max(precision.max_scale, static_scale),
            )
    return optax.with_extra_args_support(optimizer)


def describe_given(
    optimizer: optax.GradientTransformation, factory: object, clip_norm: float
) -> dict[str, object]:
    """What the trackers record of an optimizer given to fit, in place of the optim section.

    Its states' names in chain order (ScaleByAdam, Trace, ...), the hyperparameters it
    injects (optax.inject_hyperparams) at their start values, the factory's name when one
    built it, and the clipping the run adds (0: none).
    """
    try:  # on no parameters: the states' kinds and the injected values, nothing sized
        state = optimizer.init({})
    except Exception:  # a chain that needs the parameters' structure: its kinds unknown
        state = None
    hyperparams: dict[str, float] = {}
    described = {
        "given_to_fit": getattr(factory, "__qualname__", "an optax GradientTransformation"),
        "transforms": ", ".join(_state_names(state, hyperparams)) or "unknown",
    }
    return described | {"hyperparams": hyperparams, "clip_norm": clip_norm}


def _state_names(state: object, hyperparams: dict[str, float]) -> list[str]:
    """The optax state kinds in `state`, outermost first; injected values into hyperparams."""
    if isinstance(state, dict):
        return [name for value in state.values() for name in _state_names(value, hyperparams)]
    if not isinstance(state, tuple):
        return []
    names = []
    kind = type(state).__name__
    if hasattr(state, "_fields") and kind != "EmptyState":
        names.append(kind.removesuffix("State"))
    if kind.startswith("Inject") and isinstance(getattr(state, "hyperparams", None), dict):
        for key, value in state.hyperparams.items():
            if getattr(value, "shape", None) == ():
                hyperparams[key] = float(f"{float(value):.7g}")  # float32's digits
    for value in state:
        if kind.startswith("Inject") and value is getattr(state, "hyperparams", None):
            continue
        names += _state_names(value, hyperparams)
    return names
