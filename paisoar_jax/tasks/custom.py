"""The task of a model of one's own: the user's loss on the user's data.

`loss(model, batch, rng) -> (loss, metrics)` is the user's function: the model is their NNX
module (its weights already in the compute dtype, see state.compute_casts), the batch their
arrays as the data holds them (each in its own dtype; `precision.cast_inputs=true` casts the
floating ones to the compute dtype), and rng a key that differs per step and micro-batch.
The loss and each metric must be scalars; they are taken in fp32. `setup` checks that once,
abstractly, before anything compiles (`prepare`). Eval runs the same loss with the model
switched to eval mode (`model.eval()`: dropout off, BatchNorm on its running statistics)
and a fixed key, row by row (`eval_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.config import FIT_CONFIG_NOTE
from paisoar_jax.data.user_data import BatchData, ExampleData
from paisoar_jax.engine.evaluation import EvalSet
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.precision import Policy
from paisoar_jax.parallel import pipeline

# Names the loop's records (and the eval step's row count) use: a user's metric may not.
RESERVED_METRICS = (
    *("loss", "lr", "grad_norm", "loss_scale", "skipped_steps", "skipped_spikes", "step"),
    *("rows", "weight"),
)
Loss = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


class CustomTask:
    """A user's loss and data as a Task (workload.Task): throughput in examples."""

    unit = "examples"
    rate_name = "ex_s"
    unit_of_data = "examples"
    reports_perplexity = False  # a loss of one's own: its exp need mean nothing
    config_note = FIT_CONFIG_NOTE  # atop config.yaml: the program made this run

    def __init__(
        self,
        loss: Loss,
        data: ExampleData | BatchData,
        eval_sets: tuple[EvalSet, ...],  # their sources ExampleData or BatchData
        policy: Policy,
        flops_per_example: float | None = None,
        cast_inputs: bool = False,
    ):
        self.user_loss = loss
        self.data, self.eval_sets = data, eval_sets
        self.policy = policy
        self.cast_inputs = cast_inputs
        self.flops_per_example = flops_per_example
        self.metric_names: tuple[str, ...] = ()  # known once `prepare` traced the loss

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The data given to fit, and its eval sets (eval_data's first; none if none given)."""
        return self.data, self.eval_sets

    def host_batches(self, source, *, global_batch: int, seed: int, train: bool, workers=0):
        """The rows of endless global batches of `source` this process reads."""
        return source.batches(global_batch, seed=seed, shuffle=train, workers=workers)

    def batch_shape(self, global_batch: int) -> Any:
        """The shapes and dtypes of one global batch, from the data's first example or batch."""
        return self.data.batch_spec(global_batch)

    def units_per_example(self) -> int:
        """Throughput counts examples."""
        return 1

    def flops_per_unit(self, param_count: int) -> float | None:
        """The FLOPs per example given to fit (for MFU), else None."""
        return self.flops_per_example

    def loss(self, model: nnx.Module, batch: Any, key: jax.Array) -> tuple[jax.Array, dict]:
        """The user's loss and metrics in fp32, on the batch as `inputs` gives it."""
        loss, metrics = self.user_loss(model, self.inputs(batch), key)
        as_float32 = lambda value: jnp.asarray(value).astype(jnp.float32)
        return as_float32(loss), {name: as_float32(metrics[name]) for name in self.metric_names}

    def inputs(self, batch: Any) -> Any:
        """The batch as the loss sees it: as is, or floats in the compute dtype (cast_inputs)."""
        return jax.tree.map(self.policy.cast_to_compute, batch) if self.cast_inputs else batch

    def loss_weight(self, batch) -> None:
        """None: the loss is a mean over the batch's rows, a count that does not vary."""
        return None

    def eval_rows(self, model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
        """{"loss", *metrics} of the model in eval mode, one value per row of the batch.

        The loss is vmapped over the rows, each a batch of one: the same ops batched, so
        the partial last batch of an eval counts its real rows alone. A pipelined model
        splits its batch into micro-batches, which a row cannot be: there each row gets
        the batch's value (an eval's wrapped-round rows then weigh in its last batch).
        """
        model.eval()  # outside the vmap: NNX refuses a module changed in another trace
        # Each row's model is merged inside the vmap from the weights: a module built in the
        # outer trace, called there, would refuse the checkpointed blocks' (remat.blocks,
        # remat_block) writes to it from the vmap's trace level.
        graphdef, weights = nnx.split(model)

        def metrics_of(rows: Any) -> dict[str, jax.Array]:
            row_model = nnx.merge(graphdef, weights, copy=True)
            loss, metrics = self.loss(row_model, rows, jax.random.PRNGKey(0))
            return {"loss": loss, **metrics}

        if pipeline.is_active():
            rows = len(jax.tree.leaves(batch)[0])
            return jax.tree.map(lambda value: jnp.full((rows,), value), metrics_of(batch))
        add_row_axis = lambda row: jax.tree.map(lambda leaf: leaf[None], row)
        return jax.vmap(lambda row: metrics_of(add_row_axis(row)))(batch)

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""
        size = len(self.data) if isinstance(self.data, ExampleData) else None
        return {"user_data": self.data.kind, "examples": size}

    def closing_sample(self, layout, state, mesh) -> None:
        """A model of one's own: what it makes of a prompt is for its own code to show."""
        return None

    def prepare(self, layout, global_batch: int) -> None:
        """Checks the batches of data and of each eval set against the loss, abstractly.

        Before the first step (and not at the first eval, 50 steps in): the loss is traced
        on one global batch of each, in train mode and in eval mode, and must return
        (scalar, {name: scalar}); then the eval step's row-by-row form (`eval_rows`) is
        traced on the eval sets. An error the loss raises on a batch names that input.
        """
        batch = self.batch_shape(global_batch)

        def probe(params, model_state, batch, key, train):
            model = nnx.merge(layout.graphdef, params, model_state)
            if not train:
                model.eval()
            return self.user_loss(model, self.inputs(batch), key)

        def probe_rows(params, model_state, batch, key):
            return self.eval_rows(nnx.merge(layout.graphdef, params, model_state), batch)

        # The key is the kind the step passes (raw uint32[2]), traced like the step's: a loss
        # may hand it to nnx.Dropout or jax.random as it will in training. Abstract: an eager
        # key would be placed on the mesh, which a GPU target's compile-only devices refuse.
        abstract, key = layout.abstract_state, jax.eval_shape(lambda: jax.random.PRNGKey(0))

        def trace(name: str, function: Callable, spec: Any, how: str = "on its batches") -> Any:
            try:
                return jax.eval_shape(function, abstract.params, abstract.model_state, spec, key)
            except UserError:
                raise
            except Exception as error:  # the whole traceback stays as the cause
                raise UserError(
                    f"{name}: the loss fails {how} ({_shapes(spec)}): "
                    f"{type(error).__name__}: {_first_line(error)}"
                ) from error

        self.metric_names = _check_loss_result(
            trace("data", functools.partial(probe, train=True), batch)
        )
        for eval_set in self.eval_sets:
            name, eval_batch = eval_set.source.name, eval_set.source.batch_spec(global_batch)
            result = trace(name, functools.partial(probe, train=False), eval_batch)
            missing = set(self.metric_names) - set(_check_loss_result(result))
            if missing:
                raise UserError(f"{name}: the loss returns no {sorted(missing)[0]} on it")
            # It ran on a whole batch: a failure here is the row-by-row form, not the data.
            how = "on one row at a time (eval's jax.vmap over the rows), not on a whole batch"
            trace(name, probe_rows, eval_batch, how)


def _check_loss_result(result: Any) -> tuple[str, ...]:
    """The metric names of a valid (scalar loss, {name: scalar}) result; else UserError."""
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise UserError(
            f"loss must return (loss, metrics): a scalar and a dict of scalars; it returned "
            f"{_describe(result)}"
        )
    loss, metrics = result
    if not _is_scalar(loss):
        raise UserError(f"loss must return a scalar loss first; it returned {_describe(loss)}")
    if not isinstance(metrics, dict) or not all(isinstance(name, str) for name in metrics):
        raise UserError(
            f"loss must return a dict of named metrics second; got {_describe(metrics)}"
        )
    for name, value in metrics.items():
        if name in RESERVED_METRICS:
            raise UserError(f"loss: metric {name!r} takes a name the run's records use")
        if not _is_scalar(value):
            raise UserError(f"loss: metric {name!r} must be a scalar, got {_describe(value)}")
    return tuple(metrics)


def _shapes(spec: Any) -> str:
    """A batch's structure in short: `x: float32[16, 8], y: int32[16]`."""
    flat = jax.tree_util.tree_leaves_with_path(spec)
    return ", ".join(
        f"{jax.tree_util.keystr(path).strip('[]').strip(chr(39)) or 'batch'}: "
        f"{leaf.dtype}{list(leaf.shape)}"
        for path, leaf in flat
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _is_scalar(value: Any) -> bool:
    return hasattr(value, "shape") and value.shape == () and jnp.issubdtype(value.dtype, jnp.number)


def _describe(value: Any) -> str:
    """A short account of what a loss returned: shapes and dtypes, not values."""
    if hasattr(value, "shape"):
        return f"an array of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}: " + ", ".join(map(_describe, value))
    if isinstance(value, dict):
        return "a dict of " + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items())
    return type(value).__name__
