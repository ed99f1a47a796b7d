"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular schedules, in SPMD.

A model runs its stack of identical blocks through `scan_layers(step, x, stacked)`. Outside a
pipelined run that is `jax.lax.scan`; with `mesh.stage = S > 1` the same call runs the stack
as a pipeline inside the one jitted train step. The formulation is SPMD rather than
shard_map, so the stage axis composes with data, FSDP and tensor sharding by the same jit
shardings as everything else, and the backward pass is plain autodiff of the forward:

- The stack's leading `layers` axis is split over `stage` (the sharding rule `layers ->
  stage`), so stage s holds layers s L/S .. (s+1) L/S - 1 and its optimizer state.
- The batch is cut into M micro-batches (`train.pipeline_microbatches`). A buffer with one
  row per stage, split over `stage`, carries the stream: at each of the M R + S - 1
  iterations every stage applies its layers to its row, then the rows move one stage on
  (`jnp.roll` over the split axis: one collective-permute of a micro-batch's activations
  per device, and one back in the backward pass). Stage 0 takes a fresh micro-batch each
  time. The stage function is vmapped twice, over the stages (`spmd_axis_name="stage"`) and
  over the batch shards (the data and fsdp axes), so each device computes its own cell, and
  each cell works with its own copy of its stage's weights: their gradients add up inside
  the cell through the loop and are summed over the batch shards once, after it (a
  per-iteration all-reduce otherwise). Under FSDP that copy is also one gather of the
  stage's weights per step, not one per iteration.
- gpipe (`train.pipeline_repeats = 1`): bubble (S - 1) / (M + S - 1). circular (R > 1):
  the stack is cut into S R groups and group g runs on stage g mod S, so each micro-batch
  goes round the stages R times and the bubble is (S - 1) / (M R + S - 1). The last stage's
  output wraps round to stage 0 and waits there in a buffer of M slots until its next lap,
  which needs M >= S. The parameters stay stored in layer order, split contiguously, so a
  checkpoint is the same with or without stages; circular therefore moves each device's
  layer groups into place once per step (an all-to-all of the stack's weights forward and
  of their gradients backward). gpipe moves no weights.
- Embedding, head and loss are outside the stack: they are replicated over `stage` (each
  stage computes them on the same batch, split over data and fsdp as ever). The finished
  micro-batches are collected on stage 0 and broadcast to the others once per step (an
  all-reduce over `stage` of the batch's activations); in the backward pass the input's
  gradient comes back from stage 0 the same way, a micro-batch per iteration.

What crosses between stages per device and step, then: 2 (M R + S - 1) micro-batch
activations point to point (plan's collective-permute bytes), plus about two batch
activations over the stage axis for the replicated embedding and head. The weights and
their gradients stay on their stage (gpipe).

1F1B and zero-bubble schedules reorder the backward pass per micro-batch; in this
formulation the backward is the autodiff transpose of the forward scan, so their order
cannot be expressed without a hand-written backward. Their bubble is GPipe's; what they
save is activation memory, which `remat.policy` serves here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from paisoar_jax.config import MeshConfig, TrainConfig, check_stage_groups
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding

STAGE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule: S stages, M micro-batches, R laps round the stages."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def schedule(self) -> str:
        """The schedule's name: "gpipe" (one lap) or "circular" (several)."""
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def iterations(self) -> int:
        """Steps of the pipeline loop: every micro-batch's laps plus the fill."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of the stages' time spent idle: (S - 1) / (M R + S - 1)."""
        return (self.stages - 1) / self.iterations


def schedule(mesh: MeshConfig, train: TrainConfig) -> Pipeline | None:
    """The run's pipeline (mesh.stage x mesh.dcn_stage > 1), or None."""
    stages = mesh.stages
    if stages == 1:
        return None
    microbatches = train.pipeline_microbatches or 2 * stages
    return Pipeline(stages, microbatches, train.pipeline_repeats)


@dataclasses.dataclass
class _Active:
    """The pipeline of the step being traced, and how many stacks ran through it."""

    pipeline: Pipeline
    stacks: int = 0


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "paisoar_jax_pipeline", default=None
)


@contextlib.contextmanager
def active(
    pipeline: Pipeline | None, model_name: str = "", reset: bool = False
) -> Iterator[_Active | None]:
    """While a step is traced: `scan_layers` pipelines over `pipeline` (None: plain scan).

    `model_name`: the model traced inside; a pipeline it ran no stack through is refused
    on the way out (`check_used`). `reset`: with None, also turns an enclosing pipeline
    off (inside a pipeline's cell).
    """
    if pipeline is None and not reset:
        yield None
        return
    token = _ACTIVE.set(None if pipeline is None else _Active(pipeline))
    try:
        yield _ACTIVE.get()
        if model_name:
            check_used(_ACTIVE.get(), model_name)
    finally:
        _ACTIVE.reset(token)


def is_active() -> bool:
    """Whether a pipelined step is being traced (its stack splits the batch into micro-batches)."""
    return _ACTIVE.get() is not None


def check_used(context: _Active | None, model_name: str) -> None:
    """Raises UserError when a pipelined run's model ran no stack through `scan_layers`."""
    if context is not None and context.stacks == 0:
        raise UserError(
            f"{context.pipeline.stages} pipeline stages (mesh.stage x mesh.dcn_stage) need a "
            f"stack of identical blocks, and {model_name} runs none through "
            f"paisoar_jax.scan_layers (set mesh.stage=1 and mesh.dcn_stage=1)"
        )


def scan_layers(step: Callable, x: Any, stacked: Any, *, with_outputs: bool = False) -> Any:
    """`step(x, layer) -> (x, y)` over the leading axis of `stacked`; returns the final x.

    In a pipelined run (mesh.stage > 1) the layers run as a pipeline over the stage axis
    and x's leading axis is the batch; elsewhere this is `jax.lax.scan`. `with_outputs`:
    returns (x, every layer's y stacked); each y a dict of fp32 scalars (a mixture of
    experts' router statistics), which a pipeline averages over its micro-batches and
    batch shards.

    Args:
        step: `(x, layer) -> (x, y)`: one layer's computation on the carried activations.
        x: the activations entering the first layer.
        stacked: the layers' parameters, stacked on a leading axis (nnx.vmap'd modules).
        with_outputs: also return every layer's y.

    Returns:
        The final x; with `with_outputs`, (x, the ys stacked).

    Example:
        ```python
        import jax
        from flax import nnx

        import paisoar_jax


        class Stack(nnx.Module):
            def __init__(self, rngs):
                @nnx.split_rngs(splits=4)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def blocks(rngs):  # 4 blocks, their weights stacked on a leading axis
                    return nnx.Linear(32, 32, rngs=rngs)

                self.blocks = blocks(rngs)

            def __call__(self, x):
                graphdef, stacked = nnx.split(self.blocks)

                def step(x, layer):
                    return x + jax.nn.gelu(nnx.merge(graphdef, layer)(x)), None

                return paisoar_jax.scan_layers(step, x, stacked)  # pipelined: mesh.stage > 1


        print(Stack(nnx.Rngs(0))(jax.numpy.ones((2, 32))).shape)  # (2, 32)
        ```

    """
    context = _ACTIVE.get()
    if context is None:
        final, outputs = jax.lax.scan(step, x, stacked)
        return (final, outputs) if with_outputs else final
    context.stacks += 1
    final, outputs = _pipelined(step, x, stacked, context.pipeline, with_outputs)
    return (final, outputs) if with_outputs else final


def _batch_shards() -> int:
    """How many ways the mesh splits the batch (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else sharding.batch_shards(mesh)


def _pin(tree, *leading):
    """Pins the leading axes of every array to `leading` mesh axes, the rest left to XLA."""
    if jax.sharding.get_abstract_mesh().empty:
        return tree

    def pin(array):
        rest = (PartitionSpec.UNCONSTRAINED,) * (array.ndim - len(leading))
        return jax.lax.with_sharding_constraint(array, PartitionSpec(*leading, *rest))

    return jax.tree.map(pin, tree)


def _stage_weights(stacked, pipeline: Pipeline, shards: int):
    """[L, ...] -> [S, P, R, L / (S R), ...]: stage s's groups s, s + S, ..., per batch shard.

    The copy per batch shard (P of them, over the data and fsdp axes) is what keeps each
    device's weight gradient its own through the pipeline loop: the gradients are summed
    over the shards once, after the loop, instead of at every iteration. Under FSDP it also
    gathers the stage's weights once per step, not once per iteration. Weights that arrive
    in a 16-bit compute dtype (cast where stored, step.params_for_compute) enter the loop in
    fp32, so their gradients add up over the iterations in fp32; each iteration casts them
    back (`_compute_weights`).
    """
    stages, repeats = pipeline.stages, pipeline.repeats
    layers = jax.tree.leaves(stacked)[0].shape[0]
    check_stage_groups("a stack of layers", layers, stages, repeats)
    per_group = layers // (stages * repeats)

    def regroup(weight):
        grouped = weight.reshape(repeats, stages, per_group, *weight.shape[1:])
        grouped = grouped.swapaxes(0, 1)  # circular: the only weight movement of the schedule
        copies = jnp.broadcast_to(grouped[:, None], (stages, shards, *grouped.shape[1:]))
        return copies.astype(jnp.float32) if _is_half(weight) else copies

    return _pin(jax.tree.map(regroup, stacked), STAGE_AXIS, sharding.BATCH_AXES)


def _is_half(array) -> bool:
    return array.dtype in (jnp.bfloat16, jnp.float16)


def _compute_weights(stage_weights, stacked, lap):
    """One lap's layer group of a cell's weights, in the dtype the stack came in."""
    return jax.tree.map(lambda w, given: w[lap].astype(given.dtype), stage_weights, stacked)


def _split_batch(x, count: int, shards: int):
    """[B, ...] -> [count, P, B / (count P), ...]: micro-batch j = rows j, j + count, ...

    Interleaved, so every batch shard keeps its own rows (no data moves); P is the shard.
    """

    def split(array):
        rows = array.shape[0]
        if rows % (count * shards):
            raise UserError(
                f"a batch of {rows} does not split into train.pipeline_microbatches={count} "
                f"micro-batches over {shards} batch shards (mesh data x fsdp)"
            )
        micro = array.reshape(rows // count, count, *array.shape[1:]).swapaxes(0, 1)
        micro = micro.reshape(count, shards, rows // (count * shards), *array.shape[1:])
        return _pin(micro, None, sharding.BATCH_AXES)

    return jax.tree.map(split, x)


def _join_batch(micro):
    """The inverse of `_split_batch`: [count, P, b, ...] -> [B, ...]."""

    def join(array):
        count, shards, rows = array.shape[:3]
        whole = array.reshape(count, shards * rows, *array.shape[3:]).swapaxes(0, 1)
        return sharding.constrain(whole.reshape(-1, *array.shape[3:]), ("batch",))

    return jax.tree.map(join, micro)


@jax.custom_vjp
def _next_stage(rows: jax.Array) -> jax.Array:
    """Each stage's row to the next stage, the last one's to stage 0: one collective-permute.

    Its own backward pass sends the summed cotangent back in one permute too (autodiff of
    `jnp.roll` would permute each use's cotangent separately).
    """
    return jnp.roll(rows, 1, axis=0)


def _next_stage_forward(rows):
    return _next_stage(rows), None


def _next_stage_backward(_, cotangent):
    return (jnp.roll(cotangent, -1, axis=0),)


_next_stage.defvjp(_next_stage_forward, _next_stage_backward)


def _zeros(like, *leading):
    """Zeros shaped as `like` with `leading` axes before, over the stage and batch axes."""
    rows = jax.tree.map(lambda a: jnp.zeros((*leading, *a.shape), a.dtype), like)
    return _pin(rows, STAGE_AXIS, sharding.BATCH_AXES)


def _output_sums(step: Callable, one_row, weights, stacked, pipeline: Pipeline, shards: int):
    """Zeros for the layers' outputs summed per cell and lap: [S, P, R, L / (S R)] each."""
    stages, repeats = pipeline.stages, pipeline.repeats
    per_group = jax.tree.leaves(stacked)[0].shape[0] // (stages * repeats)
    cell_weights = jax.tree.map(lambda w: w[0, 0], weights)
    outputs_shape = jax.eval_shape(
        lambda: jax.lax.scan(step, one_row, _compute_weights(cell_weights, stacked, 0))[1]
    )
    return jax.tree.map(
        lambda y: jnp.zeros((stages, shards, repeats, per_group), jnp.float32), outputs_shape
    )


def _park(parked_row, received, t, *, stages: int, micro: int):
    """Stage 0 keeps what the last stage finished at t (lap k // M of micro-batch k % M)."""
    finished = t - (stages - 1)
    slot = jnp.maximum(finished, 0) % micro
    kept = jax.tree.map(lambda p, r: p.at[slot].set(r), parked_row, received)
    return jax.tree.map(lambda new, old: jnp.where(finished >= 0, new, old), kept, parked_row)


def _pipelined(step: Callable, x, stacked, pipeline: Pipeline, with_outputs: bool = False):
    """(the stack as a pipeline, its layers' outputs or None); see the module docstring.

    `with_outputs`: each layer's y (a dict of fp32 scalars) averaged over the micro-batches
    and the batch shards, stacked in layer order; without, the ys are dropped.
    """
    stages, micro, repeats = pipeline.stages, pipeline.microbatches, pipeline.repeats
    if repeats > 1 and micro < stages:
        raise UserError(
            f"the circular schedule needs train.pipeline_microbatches >= mesh.stage, "
            f"got {micro} < {stages}"
        )
    shards = _batch_shards()
    weights = _stage_weights(stacked, pipeline, shards)  # [S, P, R, L / (S R), ...]
    inputs = _split_batch(x, micro, shards)  # [M, P, b, ...], replicated over stage

    one_row = jax.tree.map(lambda a: a[0, 0], inputs)
    stream = _zeros(one_row, stages, shards)  # [S, P, b, ...]: each stage's row
    parked = _zeros(jax.tree.map(lambda a: a[:, 0], inputs), stages, shards)  # [S, P, M, b, ...]
    # The layers' outputs (router statistics), summed per cell and lap: [S, P, R, L / (S R)].
    sums = _output_sums(step, one_row, weights, stacked, pipeline, shards) if with_outputs else None

    def run_stage(stage, row, parked_row, stage_weights, shard_inputs, t):
        """One stage's work at iteration t: its layers of lap (t - stage) // M on its row."""
        lap, slot = t // micro, t % micro
        fresh = jax.tree.map(lambda a: a[slot], shard_inputs)
        returning = jax.tree.map(lambda a: a[slot], parked_row)
        first = jax.tree.map(lambda f, r: jnp.where(lap == 0, f, r), fresh, returning)
        row = jax.tree.map(lambda f, r: jnp.where(stage == 0, f, r), first, row)
        # Fill and drain: a stage with no micro-batch at t computes on zeros, not on
        # leftovers (whose zero cotangents could meet an inf in fp16: 0 x inf = nan).
        working = (t - stage >= 0) & (t - stage < micro * repeats)
        row = jax.tree.map(lambda r: jnp.where(working, r, jnp.zeros_like(r)), row)
        own_lap = jnp.clip((t - stage) // micro, 0, repeats - 1)
        row, outputs = jax.lax.scan(step, row, _compute_weights(stage_weights, stacked, own_lap))
        if not with_outputs:
            return row, None
        # The cell's layers' outputs, in its lap's slot; nothing from a fill or drain turn.
        slot = jax.nn.one_hot(own_lap, repeats) * working
        return row, jax.tree.map(lambda y: slot[:, None] * y.astype(jnp.float32), outputs)

    # Over the batch shards (inner) and the stages (outer): each device runs its own cell.
    per_shard = jax.vmap(
        run_stage, in_axes=(None, 0, 0, 0, 1, None), spmd_axis_name=sharding.BATCH_AXES
    )
    per_cell = jax.vmap(per_shard, in_axes=(0, 0, 0, 0, None, None), spmd_axis_name=STAGE_AXIS)
    park = functools.partial(_park, stages=stages, micro=micro)
    park_cells = jax.vmap(
        jax.vmap(park, in_axes=(0, 0, None), spmd_axis_name=sharding.BATCH_AXES),
        in_axes=(0, 0, None),
        spmd_axis_name=STAGE_AXIS,
    )
    stage_ids = jnp.arange(stages)

    def iteration(carry, t):
        stream, parked, sums = carry
        with sharding.batch_vmapped(), active(None, reset=True):  # a nested stack: a scan
            done, outputs = per_cell(stage_ids, stream, parked, weights, inputs, t)
        # Each row moves one stage on; the last stage's wraps round to stage 0.
        stream = _pin(jax.tree.map(_next_stage, done), STAGE_AXIS, sharding.BATCH_AXES)
        if with_outputs:
            sums = _pin(jax.tree.map(jnp.add, sums, outputs), STAGE_AXIS, sharding.BATCH_AXES)
        return (stream, park_cells(parked, stream, t), sums), None

    carry = (stream, parked, sums)
    (_, parked, sums), _ = jax.lax.scan(iteration, carry, jnp.arange(pipeline.iterations))
    finished = jax.tree.map(lambda a: a[0].swapaxes(0, 1), parked)  # [M, P, b, ...]
    if not with_outputs:
        return _join_batch(finished), None
    return _join_batch(finished), jax.tree.map(functools.partial(_layer_means, micro), sums)


def _layer_means(microbatches: int, sums: jax.Array) -> jax.Array:
    """[S, P, R, L / (S R)] sums over the micro-batches -> [L] means, in layer order.

    Group (lap r, stage s) holds layers (r S + s) L / (S R) .. (see `_stage_weights`); each
    layer's outputs are averaged over the micro-batches and the batch shards.
    """
    per_cell = jnp.mean(sums, axis=1) / microbatches  # [S, R, L / (S R)]
    return per_cell.swapaxes(0, 1).reshape(-1)
