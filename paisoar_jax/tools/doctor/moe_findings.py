"""The doctor's checks of a mixture of experts: imbalanced, dropping, a collapsing router.

They read the per-layer fields a MoE run logs (models/moe.py: moe_layer_load/L, the busiest
expert's tokens over the mean expert's in layer L; moe_layer_dropped/L, the share of that
layer's choices its capacity dropped; moe_layer_entropy/L, its router's entropy over its
maximum), as medians over the later half of the log steps: the router is still learning to
balance in the first ones.
"""

from __future__ import annotations

import statistics

from paisoar_jax.tools.doctor.findings import Finding, Run, lower_lr, percent

LOAD_LIMIT = 2.0  # the busiest expert over twice the mean expert's tokens
DROP_LIMIT = 0.03  # over 3% of a layer's choices dropped
ENTROPY_LIMIT = 0.5  # a router's entropy under half its maximum (ln experts) ...
ENTROPY_FALL = 0.1  # ... and fallen by more than this since the first log step


def _layer_values(records, prefix: str) -> dict[int, list[float]]:
    """{layer: the values of its `prefix/layer` field in `records`, in order}."""
    values: dict[int, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(f"{prefix}/") and value is not None:
                values.setdefault(int(key.rsplit("/", 1)[1]), []).append(value)
    return values


def _layer_medians(run: Run, prefix: str) -> dict[int, float]:
    """{layer: the median of its `prefix/layer` field over the later half of the logs}."""
    later = _layer_values(run.records[len(run.records) // 2 :], prefix)
    return {layer: statistics.median(found) for layer, found in later.items()}


def _worst_over(run: Run, prefix: str, limit: float) -> tuple[int, float, str] | None:
    """(the worst layer, its median, "n of m MoE layers") where a layer is over `limit`."""
    medians = _layer_medians(run, prefix)
    over = {layer: value for layer, value in medians.items() if value > limit}
    if not over:
        return None
    worst = max(over, key=over.get)
    return worst, over[worst], f"{len(over)} of {len(medians)} MoE layers"


def _stronger_balance(run: Run) -> str:
    weight = run.config.model.router_aux_loss
    stronger = 0.01 if weight == 0 else 2 * weight
    return (
        f"`model.router_aux_loss={stronger:g}`: weigh the balance loss more "
        f"(now {weight:g}), so the router spreads the tokens"
    )


def _bias_balancing(run: Run) -> list[str]:
    """DeepSeek-V3's balancing, where the run has none: the fix, or nothing."""
    if run.config.model.router_bias_rate:
        return []
    return [
        "`model.router_bias_rate=0.001`: DeepSeek-V3's balancing without a loss (a "
        "per-expert bias moves the choices toward the even load, not the gradients)"
    ]


def expert_imbalance(run: Run) -> Finding | None:
    """A layer's busiest expert takes over twice the tokens of the mean expert."""
    found = _worst_over(run, "moe_layer_load", LOAD_LIMIT)
    if found is None:
        return None
    worst, load, layers = found
    fixes = [_stronger_balance(run), *_bias_balancing(run)]
    if run.config.model.expert_capacity_factor == 0:
        capacity = "`model.expert_capacity_factor=1.25`"
        if run.config.model.moe_impl == "dropless":
            capacity = "`model.moe_impl=capacity model.expert_capacity_factor=1.25`"
        fixes.append(
            f"{capacity}: cap each expert's tokens, so the busiest one no longer sets the "
            "layer's time (its overflow is dropped: watch moe_dropped_fraction)"
        )
    evidence = (
        f"layer {worst}'s busiest expert takes {load:.1f}x the mean expert's tokens "
        f"(median of the later log steps; {layers} over {LOAD_LIMIT:g}x)"
    )
    title = f"the experts of layer {worst} are imbalanced"
    return Finding("expert-imbalance", title, evidence, tuple(fixes))


def dropped_tokens(run: Run) -> Finding | None:
    """A layer's capacity drops over 3% of its tokens' expert choices."""
    found = _worst_over(run, "moe_layer_dropped", DROP_LIMIT)
    if found is None:
        return None
    worst, share, layers = found
    factor = run.config.model.expert_capacity_factor
    fixes = (
        f"`model.expert_capacity_factor={max(2 * factor, factor + 0.5):g}`: more seats per "
        f"expert (now {factor:g})",
        _stronger_balance(run) + " and overflows less",
        "`model.moe_impl=dropless model.expert_capacity_factor=0`: drop nothing (grouped "
        "matmuls over each expert's own tokens, models/dropless.py)",
    )
    evidence = (
        f"layer {worst} drops {percent(share)} of its expert choices (median of the later "
        f"log steps; {layers} over {DROP_LIMIT:.0%})"
    )
    title = f"layer {worst} drops tokens"
    return Finding("dropped-tokens", title, evidence, fixes)


def collapsing_router(run: Run) -> Finding | None:
    """A layer's router sends its tokens to fewer and fewer experts: its entropy falls."""
    later = _layer_medians(run, "moe_layer_entropy")
    first = {
        layer: found[0] for layer, found in _layer_values(run.records, "moe_layer_entropy").items()
    }
    collapsing = {
        layer: value
        for layer, value in later.items()
        if value < ENTROPY_LIMIT and first[layer] - value > ENTROPY_FALL
    }
    if not collapsing:
        return None
    worst = min(collapsing, key=collapsing.get)
    experts = run.config.model.experts
    evidence = (
        f"layer {worst}'s router entropy fell from {first[worst]:.2f} to {collapsing[worst]:.2f} "
        f"of its maximum (ln {experts}; median of the later log steps; "
        f"{len(collapsing)} of {len(later)} MoE layers under {ENTROPY_LIMIT:g}): each token "
        "group goes to fewer and fewer experts"
    )
    fixes = [_stronger_balance(run)]
    if run.config.model.router_z_loss == 0:
        fixes.append(
            "`model.router_z_loss=0.001`: keep the router's logits small (ST-MoE), so one "
            "expert's score cannot run away"
        )
    fixes += _bias_balancing(run)
    fixes.append(lower_lr(run, ": a router that collapses early often follows too large steps"))
    title = f"the router of layer {worst} is collapsing"
    return Finding("collapsing-router", title, evidence, tuple(fixes))
