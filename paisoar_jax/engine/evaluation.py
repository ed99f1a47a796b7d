"""Eval over the whole held-out set: the exact mean over its rows, whatever the batch size.

The eval source is read in order, as ceil(N / B) global batches of B = train.global_batch
rows; the last one wraps round to the set's first rows to fill its shape. Each process marks
which of its rows are the set's own (`real_B`), the eval step sums every metric over those
rows alone, and the result is the sums of all batches over the rows of all batches: the mean
over the N rows, on any batch size, device or process count. `train.eval_batches` caps the
batches read (the first ones, the same at every eval; 0: no cap). Ready batches without a
length (fit's eval_data as a re-iterable) are read for one pass, every row their own.

A run has eval sets (`EvalSet`): the default one (held out, data.eval_source or fit's
eval_data; its metrics eval_loss, ...) and named ones (data.eval_sets, fit's eval_sets;
eval_<name>_loss, ...), each on its own cadence and all at the last step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from paisoar_jax.config import TrainConfig
from paisoar_jax.data.mixture import MixtureEval
from paisoar_jax.data.prefetch import global_batch
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding

# Eval batches dispatched before the host waits for their sums: enough to keep the device
# busy, few enough that a long eval does not queue hundreds of executions (on XLA's CPU
# devices a deep queue starves the threads a collective waits for).
IN_FLIGHT = 8
MAX_LOG_PERPLEXITY = 700.0  # exp() of more overflows a float: the perplexity is then inf


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One eval set of a run: its source, how often it is evaluated, what its metrics are."""

    source: Any
    every: int  # steps between its evals (it is evaluated at the last step too); 0: never
    name: str = ""  # empty: the default set

    @property
    def prefix(self) -> str:
        """What its metrics are named with: eval_ (eval_loss) or eval_<name>_."""
        return f"eval_{self.name}_" if self.name else "eval_"

    def is_due(self, step: int, is_last: bool) -> bool:
        """Whether this set is evaluated after `step`."""
        return bool(self.every) and (step % self.every == 0 or is_last)


@dataclasses.dataclass(frozen=True)
class HarnessTasks:
    """lm-evaluation-harness tasks as an eval set's source (train.harness_every).

    Evaluated on the weights as they are (inference/harness.py evaluate_state); their
    metrics are eval_harness_<task>/<metric>.
    """

    tasks: tuple[str, ...]
    limit: float = 0.0  # the first N requests of each task (a fraction if < 1); 0: all
    include_path: str = ""  # a folder of task YAMLs of one's own
    batch_size: int = 64


def check_harness(harness: HarnessTasks) -> None:
    """Refuses, before the first step, harness evals that could not run later in the run."""
    if jax.process_count() > 1:
        raise UserError("train.harness_every evaluates in one process for now")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(
            "train.harness_every runs lm-evaluation-harness: pip install 'paisoar-jax[eval]'"
        ) from None
    manager = TaskManager(include_path=harness.include_path or None)
    unknown = [task for task in harness.tasks if not manager.match_tasks([task])]
    if unknown:
        raise UserError(
            f"train.harness_tasks: lm-eval has no task {unknown[0]!r} (train.harness_include_path"
            f" adds a folder of your own YAMLs)"
        )


def check_metric_names(eval_sets: tuple[EvalSet, ...], task: Any) -> None:
    """Refuses eval sets whose metrics would share a name, before the first step.

    Set `a`'s metric b_loss and set `a_b`'s loss would both be eval_a_b_loss. Called once
    the task knows its metrics (after `setup` traced its loss).
    """
    metrics = ("loss", *task.metric_names, *(("perplexity",) if task.reports_perplexity else ()))
    owners: dict[str, str] = {}
    for eval_set in eval_sets:
        for metric in metrics:
            name, owner = f"{eval_set.prefix}{metric}", eval_set.name or "the default eval set"
            if owners.setdefault(name, owner) != owner:
                raise UserError(
                    f"eval sets {owners[name]} and {owner} would both report {name}: rename "
                    f"eval set {owner} (or the loss's metric)"
                )


def eval_batch_count(size: int, global_batch: int, cap: int) -> int:
    """Global batches one eval reads of a set of `size` rows: all of them, at most `cap`."""
    whole = -(-size // global_batch)
    return min(whole, cap) if cap else whole


def evaluate(
    eval_step, state, eval_source, task, train: TrainConfig, mesh, step: int = 0
) -> dict[str, float]:
    """Each eval metric's mean over the eval set's rows (see the module docstring).

    `train`: the train section (the global batch, train.eval_batches and the seed).

    A mixture's sources are evaluated one by one (`loss/<name>`, ...); its `loss` is theirs
    weighted by the mixture's weights at `step`.
    """
    if isinstance(eval_source, MixtureEval):
        return _evaluate_mixture(eval_step, state, eval_source, task, train, mesh, step)
    batch_sharding = sharding.batch_sharding(mesh)
    totals: dict[str, np.float64] = {}
    pending = []
    for host_batch, real_rows in marked_batches(task, eval_source, train):
        batch, real_B = global_batch(batch_sharding, (host_batch, real_rows))
        pending.append(eval_step(state.params, state.model_state, batch, real_B))
        if len(pending) == IN_FLIGHT:
            _add(totals, pending)
    _add(totals, pending)
    rows = totals.pop("rows")
    means = {name: float(total / rows) for name, total in totals.items()}
    if task.reports_perplexity:  # of the mean loss per token, not per row
        loss = means["loss"]
        means["perplexity"] = math.exp(loss) if loss < MAX_LOG_PERPLEXITY else math.inf
    return means


def _evaluate_mixture(eval_step, state, mixture, task, train, mesh, step) -> dict[str, float]:
    """Each source's eval metrics as `<metric>/<name>`, and the loss the weights mix."""
    parts = {
        name: evaluate(eval_step, state, source, task, train, mesh)
        for name, source in mixture.parts.items()
    }
    weights = mixture.weights_at(step)
    if not sum(weights.values()) > 0:  # sources paused at this stage: weigh those evaluated alike
        weights = dict.fromkeys(weights, 1.0)
    loss = sum(weights[name] * parts[name]["loss"] for name in parts) / sum(weights.values())
    means = {"loss": loss}
    if task.reports_perplexity:
        means["perplexity"] = math.exp(loss) if loss < MAX_LOG_PERPLEXITY else math.inf
    for name, results in parts.items():
        means |= {f"{metric}/{name}": value for metric, value in results.items()}
    return means


def _add(totals: dict[str, np.float64], pending: list) -> None:
    """Adds the sums of the batches in flight to `totals` (in float64), and empties `pending`."""
    for result in jax.device_get(pending):
        for name, value in result.items():
            totals[name] = totals.get(name, np.float64(0)) + np.float64(value)
    pending.clear()


def marked_batches(task, source: Any, train: TrainConfig) -> Iterator[tuple[Any, np.ndarray]]:
    """Per eval batch: the rows this process reads, and which of them are the set's own."""
    slot, slots = sharding.input_slot()
    rows = train.global_batch // slots
    if not hasattr(source, "__len__"):  # ready batches: one pass, all rows real
        passes = source.one_pass(train.global_batch)
        for batch in itertools.islice(passes, train.eval_batches or None):
            yield batch, np.ones(rows, dtype=bool)
        return
    size = len(source)
    batches = iter(
        task.host_batches(source, global_batch=train.global_batch, seed=train.seed, train=False)
    )
    mine = slot * rows + np.arange(rows)  # this process's rows within each global batch
    for index in range(eval_batch_count(size, train.global_batch, train.eval_batches)):
        yield next(batches), index * train.global_batch + mine < size
