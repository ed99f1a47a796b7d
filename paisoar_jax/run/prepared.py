"""A run's pieces for a loop of one's own: the state, the batches, the compiled step, a save.

`paisoar_jax.prepare` builds them as `fit` does (the same mesh, shardings, precision, loss
scaling, accumulation, input order and resume) and hands them over; the loop, its logging
and when it saves are the caller's:

    prepared = paisoar_jax.prepare(config, overrides, model=MyModel, loss=my_loss, data=data)
    state = prepared.state                      # sharded; restored when a checkpoint exists
    for step, batch in zip(range(prepared.start_step + 1, 101), prepared.batches()):
        state, metrics = prepared.train_step(state, batch)
        if step % 50 == 0:
            prepared.save(state)
    model = prepared.model(state)               # the NNX module, for inference

`fit` is the same pieces in run/loop.py's loop, with its actions (logging, eval, checkpoints,
signals). Batches continue from the state's step: after a resume, the first batch is the one
the interrupted run would have trained on next.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh

from paisoar_jax.checkpointing.checkpoint import Checkpointer
from paisoar_jax.engine.compilation import CompiledStep, one_step_at_a_time
from paisoar_jax.errors import UserError
from paisoar_jax.run.loop import open_input
from paisoar_jax.run.resume import make_checkpointer, save, starting_point
from paisoar_jax.tasks import trained
from paisoar_jax.tasks.workload import Setup, Workload


@dataclasses.dataclass
class Prepared:
    """The pieces of a prepared run (see the module docstring)."""

    mesh: Mesh
    state: Any  # the train state: sharded, at `start_step`
    start_step: int  # the step the state has done (0, or the checkpoint's)
    run: Setup
    workload: Workload
    train_source: Any
    checkpointer: Checkpointer | None
    restored: Any = None
    _batches: Any = None
    _train_step: CompiledStep | None = None
    _eval_step: Any = None

    def batches(self) -> Iterator[Any]:
        """Global batches on the mesh, from the one after the state's step, for ever."""
        if self._batches is None:
            self._batches = open_input(self.run, self.train_source, self.restored)
        return self._batches

    def train_step(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        """One step: (new state, metrics). `state` is donated: use the state it returns."""
        with jax.set_mesh(self.mesh):
            if self._train_step is None:
                self._train_step = CompiledStep(
                    self.run.jit_train_step(),
                    state,
                    batch,
                    one_at_a_time=one_step_at_a_time(self.run.layout, self.mesh),
                    untimed=contextlib.nullcontext,
                )
            return self._train_step(state, batch)

    def eval_step(self, state: Any, batch: Any) -> Any:
        """The task's per-row eval sums of `batch` (engine/evaluation.py reads them)."""
        with jax.set_mesh(self.mesh):
            if self._eval_step is None:
                self._eval_step = self.run.jit_eval_step()
            return self._eval_step(state, batch)

    def save(self, state: Any) -> int:
        """Saves `state` with the input's position (async); the step saved."""
        if self.checkpointer is None:
            raise UserError("checkpoint.enabled=false: this run has nowhere to save")
        step = int(jax.device_get(state.step))
        with jax.set_mesh(self.mesh):
            self.checkpointer.wait()
            save(self.checkpointer, step, state, self.batches(), self.run)
        return step

    def model(self, state: Any) -> Any:
        """The NNX module of `state`'s weights (a model of one's own's factory builds it)."""
        if not callable(self.workload.model) or self.workload.follows_policy:
            raise UserError("model(state) is for a model of your own; export a zoo run instead")
        return trained.model_with(
            self.workload.model, state.params, state.model_state, self.run.lora
        )

    def close(self) -> None:
        """Waits for a save in flight and stops the input's workers."""
        if self._batches is not None:
            self._batches.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def prepare_run(run: Setup, workload: Workload, train_source: Any) -> Prepared:
    """The Prepared run of a set-up run (`workload.setup`): restored or initialised.

    `train_source`: the task's train source (loop.open_sources opened and checked it).
    """
    checkpointer = make_checkpointer(run.checkpoint, run.run_dir)
    with jax.set_mesh(run.mesh):
        state, start_step, restored = starting_point(run, checkpointer)
    return Prepared(
        run.mesh, state, start_step, run, workload, train_source, checkpointer, restored
    )
