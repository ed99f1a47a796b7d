"""Per-device memory of a sharded train state and a compiled step, in one place.

What `python -m paisoar_jax.plan` reports and what the loop's out-of-memory check and report
(paisoar_jax/run/oom.py) compare with the device's limit: bytes of params, optimizer state and
gradients from their shardings, the rest from XLA's own account of the compiled step
(`compiled.memory_analysis()`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from paisoar_jax.config import MeshConfig, PrecisionConfig, RematConfig, TrainConfig
from paisoar_jax.engine.state import trainable_part


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """The config sections a step's memory depends on: what the out-of-memory fixes change."""

    mesh: MeshConfig  # zero, and the pipeline's stages
    train: TrainConfig  # global_batch, grad_accum, memory_limit_gb, the pipeline's cuts
    precision: PrecisionConfig  # fp32 compute: bf16 halves the activations
    remat: RematConfig  # the policy in effect, and the blocks of a model of one's own
    own_model: bool  # a model of one's own (model.name=custom) names its remat blocks


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
    )


def step_total(analysis: Any) -> int:
    """Device memory a compiled step needs in all, from `compiled.memory_analysis()`.

    Its arguments, its outputs not donated (aliased to an argument), its temporaries and
    its code.
    """
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.generated_code_size_in_bytes
    )


def memory(layout: Any, compiled: Any) -> dict[str, int]:
    """Per-device bytes: the state from its shardings, the rest from XLA's memory analysis."""
    params = per_device_bytes(layout.abstract_state.params)
    optimizer_state = per_device_bytes(layout.abstract_state.opt_state)
    # Only the trainable params have gradients (all of them, unless LoRA froze the rest).
    trained = trainable_part(layout.abstract_state.params, layout.trainable)
    gradients = sum(
        math.prod(grad_sharding.shard_shape(param.shape)) * param.dtype.itemsize
        for param, grad_sharding in zip(
            jax.tree.leaves(trained), jax.tree.leaves(layout.gradient_shardings), strict=True
        )
    )
    analysis = compiled.memory_analysis()
    arguments, outputs = analysis.argument_size_in_bytes, analysis.output_size_in_bytes
    aliased, temporaries = analysis.alias_size_in_bytes, analysis.temp_size_in_bytes
    code = analysis.generated_code_size_in_bytes
    return {
        "params": params,
        "optimizer_state": optimizer_state,
        "gradients": gradients,  # live inside the step: part of the temporaries
        "temporaries": temporaries,
        "other_inputs": arguments - params - optimizer_state,  # batch, step counter
        "outputs_not_donated": outputs - aliased,
        "generated_code": code,
        "total": step_total(analysis),
    }


def format_bytes(count: float) -> str:
    """Bytes in binary units, three significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"
