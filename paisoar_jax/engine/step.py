"""The pure train and eval steps, and their jit with explicit shardings.

`train_step(state, batch) -> (state, metrics)` is one optimizer step. With
`train.grad_accum = k` it splits the batch into k micro-batches and accumulates their
gradients in a `lax.scan` inside the same compiled program, so the optimizer sees exactly
the gradient of the whole batch. What a batch is and what the loss is belong to the task
(tasks.py): token windows for a language model, images and labels for a classifier.
Variables the forward pass updates (BatchNorm's running statistics) and the fp8 scaling
state the backward pass updates (fp8.py) are threaded through the micro-batches in order and
come back as the new `model_state`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paisoar_jax.engine import lora, spikes
from paisoar_jax.engine.state import StateLayout, TrainState
from paisoar_jax.numerics import fp8, loss_scale
from paisoar_jax.parallel import grad_comm, pipeline, sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_where_stored(weight: jax.Array, dtype, where: NamedSharding) -> jax.Array:
    """`weight` in `dtype`, pinned to its own (sharded) layout.

    The cast comes before any gather, so FSDP moves bf16 weights, not fp32 ones (half the
    all-gather bytes).
    """
    return jax.lax.with_sharding_constraint(weight.astype(dtype), where)


def _cast_forward(weight, dtype, where):
    return _cast_where_stored(weight, dtype, where), None


def _cast_backward(dtype, where, _, cotangent):
    # Back to fp32 with no layout pinned: the gradient is reduced (reduce-scattered into the
    # optimizer's layout) in fp32, not in the compute dtype.
    return (cotangent.astype(jnp.float32),)


_cast_where_stored.defvjp(_cast_forward, _cast_backward)


def params_for_compute(params, layout: StateLayout):
    """Params cast to their layout.compute_dtypes where they are stored (else unchanged).

    Zoo models: only weights that are split over devices (FSDP, ZeRO-3) under a narrower
    compute dtype, so the gather moves that dtype; each layer casts the rest as it uses
    them. Models of one's own: every weight that is not a norm or a bias.
    """
    if layout.compute_dtypes is None:
        return params
    weights, treedef = jax.tree.flatten(params)
    wheres = treedef.flatten_up_to(layout.shardings.params)
    dtypes = treedef.flatten_up_to(layout.compute_dtypes)  # None leaves: kept as stored
    cast = [
        weight if dtype is None else _cast_where_stored(weight, dtype, where)
        for weight, where, dtype in zip(weights, wheres, dtypes, strict=True)
    ]
    return treedef.unflatten(cast)


def loss_fn(
    params,
    model_state,
    graphdef: nnx.GraphDef,
    batch,
    task,
    key: jax.Array,
    pipeline_schedule=None,
):
    """(loss, (metrics, new model_state)) of the model on one batch, the loss in fp32.

    With a `pipeline_schedule` (pipeline.Pipeline) the model's stack runs through it.
    """
    model = nnx.merge(graphdef, params, model_state)
    with pipeline.active(pipeline_schedule, type(model).__name__), lora.dropout_key(key):
        loss, metrics = task.loss(model, batch, key)
    return loss, (metrics, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2]))


def _split_micro_batches(batch, count: int):
    """(B, ...) -> (count, B / count, ...) per array, micro-batch j = rows j, j + count, ...

    Interleaving (rather than cutting B into contiguous blocks) keeps every device's rows in
    every micro-batch, so no data moves between devices.
    """

    def split(array):
        micro = array.reshape(array.shape[0] // count, count, *array.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(micro, (None, "batch"))

    return jax.tree.map(split, batch)


def loss_and_grads(
    params,
    model_state,
    graphdef: nnx.GraphDef,
    batch,
    task,
    *,
    grad_accum: int = 1,
    scale: jax.Array | float = 1.0,
    gradient_shardings=None,
    key: jax.Array | None = None,
    layout: StateLayout | None = None,
    total_weight: jax.Array | None = None,
    frozen=None,
):
    """(loss, grads, metrics, model_state) of `scale` x loss of the batch, over micro-batches.

    The returned loss and metrics are unscaled means over the micro-batches; the gradients
    stay scaled (loss_scale.py unscales them once per optimizer step). With
    `gradient_shardings` (ZeRO >= 1) the accumulator lives in the optimizer-state layout, so
    each micro-batch's gradients are reduce-scattered into it rather than all-reduced, and
    each device holds only its slice of the sum. Micro-batch j draws from fold_in(key, j).
    With `layout`, weights are cast where they are stored first (`params_for_compute`).

    A task whose loss is a mean over a varying number of targets (`task.loss_weight`: a
    language model's learned tokens) has each micro-batch's loss weighed by its share of
    them, so the result is the mean over the whole batch's targets, not a mean of means;
    `total_weight` (per data shard: the whole batch's targets over the shards) sets the
    whole.

    `frozen`: params that take part in the loss but get no gradient (LoRA's frozen model,
    lora.py); `params` are then only the trainable ones, and the gradients are theirs.
    """
    key = jax.random.PRNGKey(0) if key is None else key
    if total_weight is None:
        total_weight = task.loss_weight(batch)

    def scaled_loss(params, model_state, micro_batch, micro_key):
        params = params if frozen is None else lora.join(params, frozen)
        compute_params = params if layout is None else params_for_compute(params, layout)
        pipeline_schedule = None if layout is None else layout.pipeline
        loss, aux = loss_fn(
            compute_params, model_state, graphdef, micro_batch, task, micro_key, pipeline_schedule
        )
        if total_weight is not None:  # this micro-batch's share of the targets, x grad_accum
            weight = task.loss_weight(micro_batch)
            loss = loss * (grad_accum * weight / jnp.maximum(total_weight, 1))
        return loss * scale, (loss, aux)

    # fp8 scaling state (fp8.Fp8Meta) is differentiated too: its "gradient" is its next value.
    every_param = params if frozen is None else lora.join(params, frozen)
    overwritten = fp8.meta_mask(graphdef, every_param, model_state)
    argnums = (0, 1) if any(jax.tree.leaves(overwritten)) else 0

    def grad_fn(model_state, micro_batch, micro_key):
        (_, (loss, (metrics, new_model_state))), grads = jax.value_and_grad(
            scaled_loss, argnums=argnums, has_aux=True
        )(params, model_state, micro_batch, micro_key)
        if argnums != 0:
            grads, next_values = grads
            new_model_state = jax.tree.map(
                lambda is_meta, next_value, updated: next_value if is_meta else updated,
                overwritten,
                next_values,
                new_model_state,
            )
        return loss, grads, metrics, new_model_state

    if grad_accum == 1:
        return grad_fn(model_state, batch, key)
    micro_batches = _split_micro_batches(batch, grad_accum)
    return _accumulated(
        grad_fn, params, model_state, micro_batches, key, task.metric_names, gradient_shardings
    )


def _accumulated(grad_fn, params, model_state, micro_batches, key, metric_names, shardings):
    """`grad_fn` over the micro-batches in a scan (see loss_and_grads).

    Returns the means of the loss, the metrics and the gradients, and the model state after
    the last micro-batch.
    """
    count = jax.tree.leaves(micro_batches)[0].shape[0]

    def in_layout(grads):
        if shardings is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, shardings)

    def accumulate(carry, micro):
        sums, grad_sum, model_state = carry
        index, micro_batch = micro
        loss, grads, metrics, model_state = grad_fn(
            model_state, micro_batch, jax.random.fold_in(key, index)
        )
        sums = jax.tree.map(jnp.add, sums, {"loss": loss, **metrics})
        return (sums, jax.tree.map(jnp.add, grad_sum, in_layout(grads)), model_state), None

    zero_sums = {name: jnp.zeros((), jnp.float32) for name in ("loss", *metric_names)}
    zeros = (zero_sums, in_layout(jax.tree.map(jnp.zeros_like, params)), model_state)
    (sums, grad_sum, model_state), _ = jax.lax.scan(
        accumulate, zeros, (jnp.arange(count), micro_batches)
    )
    means = jax.tree.map(lambda total: total / count, sums)
    loss = means.pop("loss")
    return loss, jax.tree.map(lambda g: g / count, grad_sum), means, model_state


def train_step(
    state: TrainState,
    batch,
    *,
    layout: StateLayout,
    task,
    lr_schedule: optax.Schedule | None,
    grad_accum: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch; returns the new state and scalar metrics."""
    scale = loss_scale.current_scale(state.opt_state)
    key = jax.random.fold_in(state.rng, state.step)
    comm = state.comm
    # LoRA: the adapters train; the frozen rest only takes part in the loss.
    trained, frozen = _trained_and_frozen(state.params, layout)
    if layout.exchange is None:
        loss, grads, task_metrics, model_state = loss_and_grads(
            trained,
            state.model_state,
            layout.graphdef,
            batch,
            task,
            grad_accum=grad_accum,
            scale=scale,
            gradient_shardings=layout.gradient_shardings,
            key=key,
            layout=layout,
            frozen=frozen,
        )
    else:  # mesh.grad_comm: each data shard's gradient, then the compressed exchange
        shard_losses, shard_grads, shard_metrics, model_state = _per_shard(
            state, batch, task, grad_accum, scale, key, layout
        )
        # Loss and metrics ride with the gradients: their means need no collective of their
        # own (grad_comm._reduce_scatter says why that matters).
        names = sorted(shard_metrics)
        shard_stats = jnp.stack([shard_losses, *(shard_metrics[name] for name in names)], 1)
        mesh = layout.shardings.step.mesh
        grads, stats, comm = grad_comm.exchange_gradients(
            shard_grads, shard_stats, state.comm, scale, layout.exchange, mesh
        )
        loss, task_metrics = stats[0], dict(zip(names, stats[1:], strict=True))
    # ZeRO >= 1: gradients go straight to the optimizer-state layout (a reduce-scatter).
    grads = jax.lax.with_sharding_constraint(grads, layout.gradient_shardings)
    updates, opt_state = layout.optimizer.update(grads, state.opt_state, trained, loss=loss)
    params = optax.apply_updates(trained, updates)
    params = params if frozen is None else lora.join(params, frozen)
    metrics = {
        "loss": loss,
        **task_metrics,
        "grad_norm": optax.tree.norm(grads) / scale,
        **_learning_rate(lr_schedule, state.step, opt_state),
        **loss_scale.scale_metrics(opt_state),
        **spikes.spike_metrics(opt_state),
    }
    if jax.tree.leaves((model_state, comm)):
        # A skipped step (non-finite gradients, or a spike) keeps the old statistics and
        # error-feedback residual too: they saw the same forward pass.
        kept = loss_scale.all_finite(grads)
        spiked = spikes.spiked(state.opt_state, opt_state)
        kept = kept if spiked is None else kept & ~spiked
        model_state, comm = jax.tree.map(
            lambda new, old: jnp.where(kept, new, old),
            (model_state, comm),
            (state.model_state, state.comm),
        )
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        comm=comm,
        ema=_moved_average(state.ema, params, layout.ema_decay),
    )
    return new_state, metrics


def _moved_average(ema: dict[str, Any], params, decay: float) -> dict[str, Any]:
    """The weights' moving average one step on: average * decay + new * (1 - decay)."""
    if not ema:
        return ema
    move = lambda average, new: average * decay + new.astype(average.dtype) * (1 - decay)
    return {"params": jax.tree.map(move, ema["params"], params)}


def _trained_and_frozen(params, layout: StateLayout) -> tuple[Any, Any]:
    """(the params that train, the frozen ones or None): all of them train without LoRA."""
    if layout.trainable is None:
        return params, None
    return lora.split(params, layout.trainable)


def _per_shard(state: TrainState, batch, task, grad_accum: int, scale, key, layout):
    """(losses, gradients, metrics, model_state), each [P, ...]: the data shards on their own.

    The loss is vmapped over the data shards (`spmd_axis_name`: shard p runs on its data
    devices, split further over fsdp), with the params shared, so each gradient leaf comes
    back per shard, split over data, for grad_comm.py to exchange. Gradient accumulation
    runs inside each shard: the exchange is once per optimizer step. Shard p's randomness
    is fold_in(key, p). The model state comes back as it was: the model has none its
    forward pass updates (grad_comm.check_model_state).
    """
    shards = layout.exchange.shards
    # A masked loss: each shard's mean weighed by its share of the batch's learned targets.
    total = task.loss_weight(batch)
    total_weight = None if total is None else total / shards

    trained, frozen = _trained_and_frozen(state.params, layout)

    def one_shard(shard_batch, index):
        with sharding.batch_vmapped(sharding.BATCH_AXES[1:]):
            return loss_and_grads(
                trained,
                state.model_state,
                layout.graphdef,
                shard_batch,
                task,
                grad_accum=grad_accum,
                scale=scale,
                key=jax.random.fold_in(key, index),
                layout=layout,
                total_weight=total_weight,
                frozen=frozen,
            )

    per_shard = jax.vmap(one_shard, spmd_axis_name=grad_comm.DATA_AXIS)
    losses, grads, metrics, _ = per_shard(grad_comm.shard_batch(batch, shards), jnp.arange(shards))
    return losses, grads, metrics, state.model_state


def _learning_rate(lr_schedule: optax.Schedule | None, step, opt_state) -> dict[str, jax.Array]:
    """{"lr": ...} that this step used: the schedule's, or a user optimizer's injected one.

    `step` is the count before the update; `opt_state` the optimizer state after it, whose
    injected hyperparameters are the ones the update just used.
    """
    if lr_schedule is not None:
        return {"lr": lr_schedule(step)}
    # optax.inject_hyperparams keeps the value in its hyperparams (and, for a schedule, the
    # schedule's own state under the same name: not a value). Several values (a
    # multi_transform of injected optimizers): none of them is "the" lr.
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    values = [value for _, value in found if isinstance(value, jax.Array)]
    return {"lr": jnp.asarray(values[0], jnp.float32)} if len(values) == 1 else {}


def eval_step(
    params, model_state, batch, real_B: jax.Array, *, layout: StateLayout, task
) -> dict[str, jax.Array]:
    """The task's eval metrics summed over the batch's real rows, with "rows": their count.

    `real_B` marks the rows that are the eval set's (False: the rows that fill the last
    batch's shape); the caller divides the sums of all batches by the rows of all batches.
    """
    compute_params = params_for_compute(params, layout)
    model = nnx.merge(layout.graphdef, compute_params, model_state)
    with pipeline.active(layout.pipeline, type(model).__name__):
        per_row = task.eval_rows(model, batch)
    # A task's "weight" per row (a language model's learned targets) weighs its metrics.
    weights_B = real_B.astype(jnp.float32) * per_row.pop("weight", 1.0)
    sums = {name: jnp.sum(values_B * weights_B) for name, values_B in per_row.items()}
    return sums | {"rows": jnp.sum(weights_B)}


def jit_train_step(
    layout: StateLayout,
    task,
    lr_schedule: optax.Schedule | None,
    grad_accum: int,
    mesh: Mesh,
    compiler_options: dict[str, Any] | None = None,
) -> jax.stages.Wrapped:
    """train_step jitted once: explicit in/out shardings, the state donated.

    `compiler_options`: XLA options of this compile (gpu_flags.compiler_options on a GPU).
    """
    step = functools.partial(
        train_step, layout=layout, task=task, lr_schedule=lr_schedule, grad_accum=grad_accum
    )
    return jax.jit(
        step,
        in_shardings=(layout.shardings, sharding.batch_sharding(mesh)),
        out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
        compiler_options=compiler_options or None,
    )


def jit_eval_step(
    layout: StateLayout, task, mesh: Mesh, compiler_options: dict[str, Any] | None = None
) -> jax.stages.Wrapped:
    """eval_step jitted with the state's shardings (`compiler_options` as jit_train_step's)."""
    return jax.jit(
        functools.partial(eval_step, layout=layout, task=task),
        in_shardings=(
            layout.shardings.params,
            layout.shardings.model_state,
            sharding.batch_sharding(mesh),
            sharding.batch_sharding(mesh),
        ),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
        compiler_options=compiler_options or None,
    )
