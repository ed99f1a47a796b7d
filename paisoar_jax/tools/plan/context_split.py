"""What `plan` and `doctor` say of a sequence split over mesh.context (long context).

Each device holds T / C of every sequence's tokens and needs the keys and values of the
other C - 1 slices in every layer: an all-gather of them (model.context_attention=gather)
or C - 1 hops round the ring (ring). Either way a device receives (C - 1) slices of K and
V per layer and pass, and the backward pass sends their gradients back; a forward pass
recomputed under remat moves them once more. A slice's transfer (a ring hop, or the
gather's share of it) can hide behind the attention to a slice only while

    2 x local x kv_heads x head_width x bytes / bandwidth
        <= 4 x local^2 x heads x head_width / (peak x efficiency)

so each device needs at least a minimum number of tokens (`min_tokens_per_device`):
split further, and communication bounds the layer. This module computes those numbers
from the config (a model, not a measurement: the compiled step's collectives are in
plan's table beside them), `context_sizes` compiles the step at a target length for each
context size (`plan --context-for LENGTH`), and `context_bound` is doctor's check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from paisoar_jax.config import Config, LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.parallel.sharding import BATCH_AXES
from paisoar_jax.tools.doctor.findings import Finding, Run
from paisoar_jax.tools.plan.fit_search import apply, limit_bytes


def context_report(
    config: Config, mesh_shape: dict[str, int], platform: str, gb_per_s: float, peak: float
) -> dict[str, Any] | None:
    """The split's tokens per device, K/V bytes per step and per-hop times; None unsplit.

    `peak`: TFLOP/s the compute reaches (peak x efficiency); `platform`: where the step
    was compiled (XLA:CPU moves the keys and values in fp32).
    """
    shards = mesh_shape.get("context", 1)
    if shards == 1:
        return None
    model, train = config.model, config.train
    local = model.seq_len // shards
    tensor = mesh_shape.get("tensor", 1)
    heads = max(model.heads // tensor, 1)
    kv_heads = max(model.key_value_heads // tensor, 1)
    batch_shards = math.prod(mesh_shape.get(axis, 1) for axis in BATCH_AXES)
    rows = train.global_batch // train.grad_accum // batch_shards  # per micro-batch
    wire = 4 if platform == "cpu" or config.precision.policy == "fp32" else 2
    hop_bytes = rows * 2 * local * kv_heads * model.head_size * wire  # K and V, one slice
    passes = 2 + (config.remat.policy != "none")  # forward, backward, recomputed forward
    step_bytes = model.layers * train.grad_accum * passes * (shards - 1) * hop_bytes
    hop_seconds = hop_bytes / (gb_per_s * 1e9)
    hop_flops = 4 * rows * local * local * heads * model.head_size  # scores and values
    attention_seconds = hop_flops / (peak * 1e12)
    return {
        "context_shards": shards,
        "strategy": model.context_attention,
        "balanced": model.context_balance,
        "tokens_per_device": local,
        "kv_bytes_per_hop": hop_bytes,
        "kv_bytes_per_step": step_bytes,
        "kv_seconds_per_step": step_bytes / (gb_per_s * 1e9),
        "hop_seconds": hop_seconds,
        "hop_attention_seconds": attention_seconds,
        # A slice's transfer scales with local, the attention to it with local^2.
        "min_tokens_per_device": int(local * hop_seconds / attention_seconds) + 1,
    }


def context_sizes(
    config: Config, length: int, devices: int, plan_of: Callable[[Config], dict[str, Any]]
) -> dict[str, Any]:
    """The step at `length` tokens compiled for each context size: its memory, its split.

    train.global_batch stays, and each size C takes its devices from mesh.data (data x
    context stays as configured), so a device holds the same tokens at every size (B x
    length / devices); what changes is how: whole rows, or slices of more rows. A split
    pays where a device would hold less than one row, and where the weights need the
    context devices' share. The proposal is the smallest C that fits the device (or
    train.memory_limit_gb): it moves the least. A size the window or the batch cannot
    take is listed with the reason.
    """
    check_decoder(config)
    mesh = config.mesh
    others = mesh.stage * mesh.fsdp * mesh.expert * mesh.tensor * mesh.hosts()
    spare = mesh.data * mesh.context if mesh.data > 0 else devices // others
    rows = []
    for shards in (size for size in range(1, spare + 1) if spare % size == 0):
        row: dict[str, Any] = {"context": shards}
        rows.append(row)
        pieces = 2 * shards if config.model.context_balance and shards > 1 else shards
        batch_shards = spare // shards * mesh.fsdp * mesh.expert
        if length % pieces:
            row["skipped"] = f"{length} tokens do not cut into {pieces} equal pieces"
            continue
        if config.train.global_batch % batch_shards:
            row["skipped"] = (
                f"train.global_batch={config.train.global_batch} does not split over "
                f"{batch_shards} batch shards"
            )
            continue
        overrides = [f"model.seq_len={length}", f"mesh.context={shards}"]
        overrides += [f"mesh.data={spare // shards}"]
        if config.model.max_positions and config.model.max_positions < length:
            overrides.append(f"model.max_positions={length}")
        variant = apply(config, overrides)
        result = plan_of(variant)
        limit = _limit(variant, result)
        row |= {"overrides": overrides, "bytes": result["memory_bytes"]["total"]}
        row["fits"] = None if limit is None else row["bytes"] <= limit
        row["split"] = result.get("context")
    fitting = [row for row in rows if row.get("fits")]
    return {
        "length": length,
        "global_batch": config.train.global_batch,
        "limited": any(row.get("fits") is not None for row in rows),
        "sizes": rows,
        "proposal": fitting[0]["overrides"] if fitting else None,
    }


def check_decoder(config: Config) -> None:
    """Raises UserError unless the config's model reads sequences (gpt, llama)."""
    if not isinstance(config.model, LanguageModelConfig):
        raise UserError(
            "--context-for plans a decoder's window (model.name gpt or llama); this model "
            "reads no sequences"
        )


def _limit(config: Config, result: dict[str, Any]) -> int | None:
    """The bytes a step must fit: the GPU target's memory, else train.memory_limit_gb."""
    if "target" in result:
        return limit_bytes(config, result["target"]["device_memory_bytes"])
    limit = config.train.memory_limit_gb
    return int(limit * 2**30) if limit > 0 else None


def context_bound(run: Run) -> Finding | None:
    """plan.json says a slice's keys and values take longer to move than to attend to."""
    split = (run.plan or {}).get("context")
    if not split or split["hop_seconds"] <= split["hop_attention_seconds"]:
        return None
    shards, local, needed = (
        split["context_shards"],
        split["tokens_per_device"],
        split["min_tokens_per_device"],
    )
    link = run.plan.get("link", {}).get("name", "the link")
    evidence = (
        f"mesh.context={shards} leaves {local} tokens per device: each slice's keys and "
        f"values take {split['hop_seconds'] * 1e6:.3g} us on {link} against "
        f"{split['hop_attention_seconds'] * 1e6:.3g} us of attention to it to hide behind "
        f"(plan.json, {split.get('strategy', 'ring')}); the split needs at least {needed} "
        "tokens per device"
    )
    fewer = max(1, run.config.model.seq_len // max(needed, 1))
    fixes = [
        f"`mesh.context={_power_of_two_below(fewer, shards)}`: fewer, longer slices (the "
        "devices this frees split the batch over mesh.data, or the weights over mesh.fsdp)",
        "`model.seq_len` longer for the same split: the attention grows with the square of "
        "the slice, its keys and values only linearly",
    ]
    return Finding("context-bound", "communication bounds the context split", evidence, fixes)


def _power_of_two_below(limit: int, shards: int) -> int:
    """The largest power of two below `shards` and at most `limit` (at least 1)."""
    size = 1
    while size * 2 < shards and size * 2 <= limit:
        size *= 2
    return size
