"""The reference model's log-probabilities, scored once before a preference run's first step.

DPO compares the policy with the model it started from. Rather than keep a second copy of
the weights on the devices (or, under LoRA, run the base a second time each step), the run
scores every row of its train and eval sets with the starting weights before step 1, in
order, `train.global_batch` rows at a time on the mesh, and keeps the scores in the run
directory (reference_logps.npz). The rows then carry them (`ReferencedRows`) through the
same shuffled, resumable input as any other field, so a resumed run reads the file and
continues exactly; a LoRA run's starting weights are its base (the adapters start at zero).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from paisoar_jax import output
from paisoar_jax.data.preferences import PreferenceWindows
from paisoar_jax.data.prefetch import global_batch
from paisoar_jax.engine.evaluation import EvalSet, marked_batches
from paisoar_jax.engine.step import params_for_compute
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import pipeline, sharding
from paisoar_jax.tasks.preference import PreferenceOptimisation

FILE_NAME = "reference_logps.npz"


class ReferencedRows:
    """A source's rows, each with its reference log-probs (2, P) as "reference"."""

    def __init__(self, source: Any, scores: np.ndarray):
        self.source, self.scores = source, scores

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.source[index] | {"reference": self.scores[index]}

    def __getattr__(self, name: str) -> Any:  # pairs_per_row and the like: the source's
        if name == "source":  # (not yet set while unpickling)
            raise AttributeError(name)
        return getattr(self.source, name)


def attach(
    run: Any, state: Any, train_source: Any, eval_sets: tuple[EvalSet, ...], start_step: int
) -> tuple[Any, tuple[EvalSet, ...]]:
    """The train source and eval sets with their rows' reference scores (see the module doc).

    `run`: the Setup; `state`: the train state at `start_step` (its weights are the
    reference when the run starts at step 0).
    """
    task = run.task
    if not (isinstance(task, PreferenceOptimisation) and task.needs_reference):
        return train_source, eval_sets
    # the sets that are evaluated (a set never due is never read)
    evaluated = {
        f"eval_{i}": s.source
        for i, s in enumerate(eval_sets)
        if s.every and isinstance(s.source, PreferenceWindows)  # (not harness tasks)
    }
    sources = {"train": train_source} | evaluated
    path = pathlib.Path(run.run_dir) / FILE_NAME
    if path.is_file():
        with np.load(path) as saved:
            scores = {name: saved[name] for name in saved.files}
        for name, source in sources.items():
            if name not in scores or len(scores[name]) != len(source):  # (eval_every changed)
                raise UserError(
                    f"{path} scores other rows than this run's data ({name}): the data "
                    f"changed since the run began; start a new run.dir"
                )
    elif start_step > 0:
        raise UserError(
            f"{run.run_dir} resumes at step {start_step} but has no {FILE_NAME}: the "
            f"reference log-probs of its starting weights are lost; start a new run.dir"
        )
    else:
        if jax.process_index() == 0:
            rows = sum(len(source) for source in sources.values())
            output.note(f"scoring {rows} rows of preference pairs with the reference weights")
        score = _jit_scores(run)
        scores = {name: _score(run, score, state, source) for name, source in sources.items()}
        if jax.process_index() == 0:  # written whole, then renamed: never half a file
            partial = path.with_suffix(".partial.npz")
            np.savez(partial, **scores)
            os.replace(partial, path)
    train = ReferencedRows(train_source, scores["train"])
    referenced = tuple(
        dataclasses.replace(s, source=ReferencedRows(s.source, scores[f"eval_{i}"]))
        if f"eval_{i}" in evaluated
        else s
        for i, s in enumerate(eval_sets)
    )
    return train, referenced


def _jit_scores(run: Any):
    """The task's pair log-probs of a batch, jitted with the state's shardings."""
    layout, task = run.layout, run.task

    def scores(params, model_state, batch):
        model = nnx.merge(layout.graphdef, params_for_compute(params, layout), model_state)
        with pipeline.active(layout.pipeline, type(model).__name__):
            log_probs, _, _ = task.pair_log_probs(model, batch)
        return log_probs

    return jax.jit(
        scores,
        in_shardings=(
            layout.shardings.params,
            layout.shardings.model_state,
            sharding.batch_sharding(run.mesh),
        ),
        out_shardings=NamedSharding(run.mesh, PartitionSpec()),
    )


def _score(run: Any, score, state, source: Any) -> np.ndarray:
    """(rows, 2, P) float32: every row of `source` scored, in order."""
    train = dataclasses.replace(run.train, eval_batches=0)  # every row, not eval's cap
    batch_sharding = sharding.batch_sharding(run.mesh)
    results = [
        score(state.params, state.model_state, global_batch(batch_sharding, host_batch))
        for host_batch, _ in marked_batches(run.task, source, train)
    ]
    return np.concatenate(jax.device_get(results))[: len(source)].astype(np.float32)
