"""A run's pieces for a loop of one's own: the state, the batches, the compiled step, a save.

`paisoar_jax.prepare` builds them as `fit` does (the same mesh, shardings, precision, loss
scaling, accumulation, input order and resume) and hands them over; the loop is the
caller's, with fit's actions a call each:

    prepared = paisoar_jax.prepare(config, overrides, model=MyModel, loss=my_loss, data=data,
                                   eval_data=held_out)
    state = prepared.state                      # sharded; restored when a checkpoint exists
    for step, batch in zip(range(prepared.start_step + 1, 101), prepared.batches()):
        state, metrics = prepared.train_step(state, batch)
        if step % 10 == 0:
            prepared.log(step, metrics)         # a metrics.jsonl record, as fit's
        if step % 50 == 0:
            prepared.log(step, prepared.evaluate(state, step))   # every eval set, whole
        if step % 50 == 0 or prepared.should_stop(step):         # SIGTERM: saves, then ends
            prepared.save(state)
        if prepared.should_stop(step):
            break
    prepared.close()                            # the last save committed
    model = prepared.model(state)               # the NNX module, for inference

The run directory holds what fit's does (config.yaml, metrics.jsonl, checkpoints/, the
run's lock), so `paisoar_jax.load`, `generate`, `export` and the doctor read it. Batches
continue from the state's step: after a resume, the first batch is the one the interrupted
run would have trained on next. A state or batch that does not belong to this run is one
line naming what differs (run_checks.py), never a silent new compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import jax

from paisoar_jax.checkpointing.checkpoint import Checkpointer, Restored
from paisoar_jax.engine.compilation import CompiledStep, one_step_at_a_time, readable_errors_of
from paisoar_jax.engine.evaluation import EvalSet
from paisoar_jax.engine.state import TrainState
from paisoar_jax.errors import UserError, one_line_errors
from paisoar_jax.run import run_records
from paisoar_jax.run.loop import stop_agreed
from paisoar_jax.run.resume import make_checkpointer, open_input, saved_batch, starting_point
from paisoar_jax.run.run_checks import check_batch, check_state
from paisoar_jax.run.saving import Saver, config_text
from paisoar_jax.run.setup import Setup
from paisoar_jax.runtime import preemption
from paisoar_jax.runtime.preemption import StopRequest
from paisoar_jax.runtime.run_lock import RunLock
from paisoar_jax.tasks import reference, trained
from paisoar_jax.tasks.policy import PolicyOptimisation
from paisoar_jax.tasks.workload import Workload


@dataclasses.dataclass
class Opened:
    """What `prepare` opened for a run: its checkpoints, lock, stop signals and eval sets."""

    checkpointer: Checkpointer | None
    lock: RunLock
    stop: StopRequest
    eval_sets: tuple[EvalSet, ...]
    restored: Restored | None = None


class Prepared:
    """The pieces of a prepared run, for a training loop of one's own.

    Made by `paisoar_jax.prepare` (not constructed directly): fit's compiled step, its
    batches, evaluation, records, saving and stop signal, each one call; the loop is yours.

    Attributes:
        state (TrainState): the train state, sharded, at `start_step`.
        start_step (int): the step the state has done (0, or the checkpoint's).
        mesh (jax.sharding.Mesh): the device mesh the run is sharded over.
        run (Setup): the run's settings and layout (`run.run_dir`: its directory).

    Args:
        run: the run built from its config (prepare builds it).
        workload: the model, loss and task the run trains.
        train_source: the training examples or batches.
        opened: the checkpointer, eval sets, run lock and stop request prepare opened.

    Example:
        ```python
        import paisoar_jax

        overrides = ["model.layers=2", "train.steps=10", "run.dir=runs/own-loop"]
        with paisoar_jax.prepare(None, overrides) as prepared:  # prepare's example ran first
            print(prepared.start_step)  # 10: restored from its last save
            print(prepared.evaluate(prepared.state))  # {"eval_loss": ..., ...}
        ```

    """

    def __init__(self, run: Setup, workload: Workload, train_source: Any, opened: Opened):
        self.run, self.mesh, self.workload = run, run.mesh, workload
        self._train_source, self._opened = train_source, opened
        with jax.set_mesh(run.mesh):
            self.state, self.start_step, opened.restored = starting_point(run, opened.checkpointer)
            # DPO's reference log-probs ride with the rows, scored once at step 0
            train_source, opened.eval_sets = reference.attach(
                run, self.state, train_source, opened.eval_sets, self.start_step
            )
        self._train_source = train_source
        if jax.process_index() == 0:  # what load, export and the doctor read
            (run.run_dir / "config.yaml").write_text(config_text(run))
        self._batches: Any = None
        self._train_step: CompiledStep | None = None
        self._eval_step: Any = None
        self._instruments: run_records.Instruments | None = None
        self._saver = Saver(run, opened.checkpointer, None, None, opened.lock)
        self._last_state: Any = None  # the state train_step returned last (checked once)
        self._step = self.start_step  # the steps this run has done
        self._saved: tuple[int, TrainState] | None = None  # the last (step, state) saved
        self._closed = False

    def batches(self) -> Iterator[Any]:
        """Global batches on the mesh, from the one after the state's step, for ever."""
        if self._batches is None:
            self._batches = open_input(self.run, self._train_source, self._opened.restored)
            self._saver.batches = self._batches
        return self._timed(self._batches)

    def _timed(self, batches: Any) -> Iterator[Any]:
        """The batches; the time waited for each counts as data wait in the records."""
        while True:
            wait_start = time.perf_counter()
            batch = next(batches)
            if self._instruments is not None:
                self._instruments.timer.wait_s += time.perf_counter() - wait_start
            yield batch

    @one_line_errors("paisoar_jax.prepare")
    def train_step(self, state: TrainState, batch: Any) -> tuple[Any, dict[str, Any]]:
        """One step: (new state, metrics). `state` is donated: use the state it returns.

        A state of another run (another model, mesh or optimizer) or a batch of another
        shape is refused in one line naming what differs.

        Args:
            state: the state `prepare` gave, or the last one this returned.
            batch: a global batch from `batches()`.

        Returns:
            (the new state, the step's metrics: loss, grad_norm, lr, loss_scale, ...).
        """
        if state is not self._last_state:
            check_state(state, self.run.layout)
        check_batch(batch, self.run.task.batch_shape(self.run.train.global_batch))
        with jax.set_mesh(self.mesh):
            if self._train_step is None:
                self._compile(state, batch)
            instruments = self._instruments
            instruments.profiler.before(self._step + 1)
            state, metrics = self._train_step(state, batch)
        if self._step == self.start_step:  # before any update: a nan is the batch's or loss's
            run_records.check_first_step(self.run, self._step + 1, metrics, instruments)
            self._opened.stop.stepping = True  # a signal from now on waits for should_stop
        self._step += 1
        instruments.profiler.after(self._step, metrics)
        instruments.progress.update(1)
        self._last_state = state
        return state, metrics

    def _compile(self, state: TrainState, batch: Any) -> None:
        """Fit's train step compiled for `batch`, and the records opened as fit opens them."""
        self._train_step = CompiledStep(
            self.run.jit_train_step(),
            state,
            batch,
            one_at_a_time=one_step_at_a_time(self.run.layout, self.mesh),
            untimed=contextlib.nullcontext,
        )
        run_records.say_compiled(self.run, self._train_step.compile_s, self.start_step)
        restored = self._opened.restored
        self._instruments = run_records.instruments(
            self.run, state, self.start_step, saved_batch(restored) if restored else None
        )
        self._saver.instruments = self._instruments
        self._instruments.timer.restart(step=self.start_step)

    @one_line_errors("paisoar_jax.prepare")
    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Writes a metrics.jsonl record of `step`, as fit's loop does; the record.

        Args:
            step: the step the metrics are of.
            metrics: what train_step returned (the record then has fit's fields: loss, lr,
                grad_norm, loss_scale, step_time_s, tokens_per_s or examples_per_s, mfu,
                data_wait_frac, ...), or what `evaluate` returned (eval_loss, ...), or both
                merged.

        Returns:
            The record written.
        """
        if self._instruments is None:
            raise UserError("log(step, metrics) comes after the first train_step")
        evals = {name: value for name, value in metrics.items() if name.startswith("eval_")}
        record = {"step": step}
        if "loss" in metrics:
            values = jax.device_get(metrics)
            record = run_records.log_record(
                self.run, step, values, self._train_step, self._instruments
            )
        run_records.write_record(record | evals, self.run.task, self._instruments)
        return record | evals

    @one_line_errors("paisoar_jax.prepare")
    def eval_step(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
        """The task's eval sums over the rows of one global batch, with "rows": their count.

        Each metric's mean over the batch is its sum / rows. `evaluate` does this over
        whole eval sets, as fit does (the last batch's padding rows left out).

        Args:
            state: the train state to evaluate.
            batch: a global batch, shaped as `batches()` gives them.

        Returns:
            {metric: its sum over the batch's rows, "rows": the count}.
        """
        if state is not self._last_state:
            check_state(state, self.run.layout)
        check_batch(batch, self.run.task.batch_shape(self.run.train.global_batch))
        with jax.set_mesh(self.mesh):
            real_B = jax.numpy.ones((self.run.train.global_batch,), bool)
            real_B = jax.device_put(real_B, self._batch_sharding())
            return self._eval()(state.params, state.model_state, batch, real_B)

    @one_line_errors("paisoar_jax.prepare")
    def evaluate(self, state: TrainState, step: int | None = None) -> dict[str, float]:
        """The eval of every eval set (eval_data, eval_sets), each whole, as fit evaluates.

        Args:
            state: the train state to evaluate.
            step: the step whose mixture weights weigh a mixture's eval (None: the step
                reached).

        Returns:
            Each metric's mean, named as fit names them in metrics.jsonl (`eval_loss`,
            `eval_NAME_loss`, ...); {} without eval sets.
        """
        eval_sets, step = self._opened.eval_sets, self._step if step is None else step
        if not eval_sets:
            return {}
        with jax.set_mesh(self.mesh):
            results = run_records.evaluate_sets(self.run, self._eval(), state, eval_sets, step)
        if self._instruments is not None:
            self._instruments.history.eval_results |= results
        return results

    @one_line_errors("paisoar_jax.prepare")
    def should_stop(self, step: int) -> bool:
        """Whether a stop signal (SIGTERM, Ctrl-C) came: save the state, then leave the loop.

        Several processes agree (a small collective every 10 steps), so all stop at the
        same step; call it at every step, from every process.

        Args:
            step: the step just done.

        Returns:
            True once a stop was asked for (on every process at the same step).
        """
        return stop_agreed(self._opened.stop, step, False) is not None

    @one_line_errors("paisoar_jax.prepare")
    def save(self, state: TrainState) -> int:
        """Saves `state` with the input's position (async); the step saved.

        A step already saved is left as it is (saving it again does nothing).

        Args:
            state: the train state to save.

        Returns:
            The step saved.
        """
        if self._opened.checkpointer is None:
            raise UserError("checkpoint.enabled=false: this run has nowhere to save")
        step = int(jax.device_get(state.step))
        if self._batches is None:
            self.batches()
        with jax.set_mesh(self.mesh):
            self._saver.save(step, state)
        self._saved = (step, state)
        return step

    @one_line_errors("paisoar_jax.prepare")
    def model(self, state: TrainState) -> Any:
        """The NNX module of `state`'s weights (a model of one's own's factory builds it).

        Args:
            state: the train state whose weights the module takes.

        Returns:
            The module, its weights gathered whole.
        """
        if not callable(self.workload.model) or self.workload.follows_policy:
            raise UserError("model(state) is for a model of your own; export a zoo run instead")
        return trained.model_with(
            self.workload.model, state.params, state.model_state, self.run.lora
        )

    def close(self) -> None:
        """Commits the last save, closes the records, stops the input and frees the run.

        The last save is committed as fit commits it (made again, or rescued elsewhere,
        when it failed). After a stop signal whose step was saved, the process then ends
        as fit's would; `with paisoar_jax.prepare(...) as prepared:` closes on any exit.
        """
        if self._closed:
            return
        self._closed = True
        opened = self._opened
        try:
            if self._saved is not None:
                with jax.set_mesh(self.mesh):
                    self._saver.finish(*self._saved)  # waits for the save in flight
            if opened.checkpointer is not None:
                opened.checkpointer.close()
            if self._instruments is not None:
                self._instruments.close(self._step)
            if self._batches is not None:
                self._batches.close()
        finally:
            opened.lock.__exit__(None, None, None)
            stopped = opened.stop.signal_name
            if stopped is not None and self._saved and self._saved[0] == self._step:
                preemption.stop_saved(stopped)  # saved: more signals end the process
            opened.stop.__exit__(None, None, None)

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _eval(self) -> Any:
        if self._eval_step is None:
            self._eval_step = readable_errors_of(self.run.jit_eval_step())
        return self._eval_step

    def _batch_sharding(self) -> Any:
        from paisoar_jax.parallel import sharding

        return sharding.batch_sharding(self.mesh)


def prepare_run(
    run: Setup, workload: Workload, train_source: Any, eval_sets: tuple[EvalSet, ...]
) -> Prepared:
    """The Prepared run of a set-up run (run/setup.py): locked, restored or initialised.

    `train_source`, `eval_sets`: the task's (loop.open_sources opened and checked them).
    """
    if isinstance(workload.task, PolicyOptimisation):
        raise UserError(
            "train.objective=grpo trains through fit and the command line: a loop of one's "
            "own over prepare does not make its rollouts yet"
        )
    stop = StopRequest(speaks=jax.process_index() == 0).__enter__()
    lock = RunLock(run.run_dir)
    try:
        lock.__enter__()
        checkpointer = make_checkpointer(run.checkpoint, run.run_dir)
        return Prepared(run, workload, train_source, Opened(checkpointer, lock, stop, eval_sets))
    except BaseException:
        lock.__exit__(None, None, None)
        stop.__exit__(None, None, None)
        raise
