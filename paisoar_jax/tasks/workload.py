"""What is trained: the `Task` protocol and the `Workload` a run trains.

A `Workload` is the user's side of a run: a model factory (`rngs -> nnx.Module`), a `Task`
(what a batch is, the loss, eval, the throughput unit) and optionally an optimizer. The zoo's
models are workloads like any other (zoo.py), and `paisoar_jax.fit` makes one of a user's
own model, loss and data (custom.py). run/setup.py builds the run on a workload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from paisoar_jax.engine.evaluation import EvalSet
from paisoar_jax.engine.state import StateLayout

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
# An optax transformation, or a factory that takes the config's learning-rate schedule.
Optimizer = optax.GradientTransformation | Callable[[optax.Schedule], optax.GradientTransformation]


class Task(Protocol):
    """What a model learns from its batches: the step, loop, plan and bench ask the task."""

    unit: str  # the throughput unit: "tokens" or "examples"
    rate_name: str  # the progress bar's name for the rate: tok_s, img_s, ex_s
    unit_of_data: str  # what a source holds, for messages: windows, images, examples
    metric_names: tuple[str, ...]  # the fp32 scalars `loss` returns beside the loss
    reports_perplexity: bool  # eval adds exp(eval_loss): a mean loss per token
    config_note: str  # comment lines atop the run's config.yaml ("" for none)

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The train source and the eval sets (the default one first; none: no eval)."""

    def host_batches(
        self, source: Any, *, global_batch: int, seed: int, train: bool, workers: int = 0
    ) -> Iterator:
        """The rows of endless global batches this process reads (get_state/set_state)."""

    def batch_shape(self, global_batch: int) -> Any:
        """The shapes and dtypes of one global batch (a ShapeDtypeStruct or a dict of them)."""

    def units_per_example(self) -> int:
        """Throughput units per example (tokens per sequence, or 1)."""

    def flops_per_unit(self, param_count: int) -> float | None:
        """Training FLOPs per unit, for MFU; None when unknown."""

    def loss(self, model: nnx.Module, batch: Any, key: jax.Array) -> tuple[jax.Array, dict]:
        """(fp32 scalar loss, {name: fp32 scalar}) of the model on one batch."""

    def loss_weight(self, batch: Any) -> jax.Array | None:
        """The targets a batch's loss is a mean over, when that count varies; else None.

        The step weighs each micro-batch's (and data shard's) mean by it, so the step's loss
        is the mean over the whole batch's targets (a masked language model's tokens).
        """

    def eval_rows(self, model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
        """{"loss", ...} on one held-out batch: fp32 arrays of one value per row, (B,)."""

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""

    def prepare(self, layout: StateLayout, global_batch: int) -> None:
        """Called once by `setup` before anything compiles (checks against the model)."""

    def closing_sample(self, layout: StateLayout, state: Any, mesh: Mesh) -> str | None:
        """What the trained model makes of a prompt, shown at the end of a run; or None."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model factory, its task and optionally an optimizer (default: the config's)."""

    model: ModelFactory
    task: Task
    optimizer: Optimizer | None = None
    # The zoo's modules cast to the precision policy and checkpoint their blocks themselves;
    # for other models the step casts the weights and remat.blocks names the blocks.
    follows_policy: bool = False
