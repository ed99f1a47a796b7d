"""The training loop: one straight path from config to a trained model, no hook framework.

mesh -> sharded state -> grain batches prefetched to the devices -> the compiled step, with
explicit `if step % k == 0` actions for logging and eval. The host reads device values only
at log and eval steps; otherwise it only waits for a step STEPS_IN_FLIGHT steps back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from paisoar_jax import output
from paisoar_jax.checkpointing.checkpoint import Checkpointer, Restored, checkpoint_directory
from paisoar_jax.config import Config
from paisoar_jax.data.mixture import examples_by_source
from paisoar_jax.data.pipeline import check_splits
from paisoar_jax.data.prefetch import DevicePrefetcher
from paisoar_jax.engine.compilation import CompiledStep, one_step_at_a_time, readable_errors_of
from paisoar_jax.engine.evaluation import EvalSet, check_metric_names
from paisoar_jax.engine.state import TrainState
from paisoar_jax.errors import HangError, UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.run import oom, run_records
from paisoar_jax.run.resume import (
    batch_change_note,
    make_checkpointer,
    open_input,
    params_finite,
    saved_batch,
    schedule_change,
    starting_point,
)
from paisoar_jax.run.saving import Saver, config_text
from paisoar_jax.run.setup import Setup, setup
from paisoar_jax.runtime import full_disk, heartbeat, preemption
from paisoar_jax.runtime.preemption import StopRequest
from paisoar_jax.runtime.run_lock import RunLock
from paisoar_jax.runtime.watchdog import Watchdog, timeout_for
from paisoar_jax.tasks import reference
from paisoar_jax.tasks.policy import PolicyOptimisation
from paisoar_jax.tasks.workload import Task, Workload
from paisoar_jax.tasks.zoo import zoo_workload

HANG_STOP = "the hang watchdog"  # the stop request's name when the watchdog asks for it
STOP_CHECK_EVERY = 10  # steps between multi-process agreements on a stop signal
# Steps the host may dispatch ahead of the device. Plenty to keep an accelerator busy; a
# deeper queue (a whole log interval) only holds memory, and on XLA's simulated CPU
# devices starves the threads a collective waits for (a 40 s rendezvous abort).
STEPS_IN_FLIGHT = 8


def stop_agreed(stop: StopRequest, step: int, is_log_step: bool) -> str | None:
    """What stops every process now, if anything: a signal's name, or HANG_STOP.

    Processes must save at the same step, and end alike: when one's hang watchdog asked
    for the stop, every one ends with the hang status (a launcher restarts only a job
    that failed). One process decides alone; several agree with a small collective at
    log steps and every STOP_CHECK_EVERY steps (one per step would cost a host sync each).
    """
    if jax.process_count() == 1:
        return stop.signal_name
    if not (is_log_step or step % STOP_CHECK_EVERY == 0):
        return None
    code = 0 if not stop.requested else 2 if stop.signal_name == HANG_STOP else 1
    agreed = int(np.max(multihost_utils.process_allgather(np.array(code, np.int32))))
    if agreed == 2:
        return HANG_STOP
    return (stop.signal_name or "a stop signal on another process") if agreed else None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A run's end: its summary, the final train state and the compiled train step."""

    summary: dict[str, Any]
    state: TrainState
    compiled: Any = None  # jax.stages.Compiled of the first batch's signature (bench reads it)


def run(config: Config, workload: Workload | None = None) -> Finished:
    """Trains as configured; the summary with the final state (what `fit` hands back).

    `workload`: the model, task and optimizer to train; default: the config's zoo model.
    From here on SIGTERM and Ctrl-C are the StopRequest's (preemption.py): before the first
    step has finished they end the process at once (nothing new to save, and a compile or
    a restore is not worth waiting for); after it, the loop saves the step reached and stops.
    """
    enabled = config.checkpoint.enabled
    checkpoint_dir = checkpoint_directory(config.checkpoint, config.run_dir) if enabled else None

    heartbeat.progress.checkpoint_dir = str(checkpoint_dir) if checkpoint_dir else None
    with StopRequest(speaks=jax.process_index() == 0) as stop:  # (names the newest saved)
        workload = zoo_workload(config) if workload is None else workload
        train_source, eval_sets = open_sources(workload.task, config.train.global_batch)
        built = setup(config, workload)  # below here: sections and built objects only
        return _run(built, train_source, eval_sets, stop, checkpoint_dir)


def open_sources(task: Task, global_batch: int) -> tuple[Any, tuple[EvalSet, ...]]:
    """The task's train source and eval sets, checked (a global batch of train data, ...)."""
    train_source, eval_sets = task.open_sources()
    if isinstance(task, PolicyOptimisation):  # a step draws a prompt per group of answers
        global_batch //= task.settings.generations
    check_splits(task, train_source, eval_sets, global_batch)
    return train_source, eval_sets


def _run(run: Setup, train_source, eval_sets, stop: StopRequest, checkpoint_dir) -> Finished:
    """`run` once the stop signals are caught and the run is set up."""
    task, train = run.task, run.train
    check_metric_names(eval_sets, task)  # the task's metrics are known once setup traced it
    run_dir, is_main = run.run_dir, jax.process_index() == 0

    def save_bytes() -> int:  # asked only when the disk is full
        return full_disk.tree_bytes(run.layout.abstract_state)

    with (
        full_disk.guard(run_dir, checkpoint_dir, save_bytes),
        contextlib.ExitStack() as cleanup,
        jax.set_mesh(run.mesh),
    ):
        # Before anything is written or cleaned up: the run directory is made and locked, and
        # a second run in it stops here.
        lock = cleanup.enter_context(RunLock(run_dir))
        checkpointer = make_checkpointer(run.checkpoint, run_dir)
        heartbeat.progress.run_dir = str(run_dir.absolute())
        if checkpointer is not None:
            heartbeat.progress.checkpoint_dir = str(checkpointer.directory)
            cleanup.callback(checkpointer.close)  # waits for the save in flight, on any exit
        who = f"process {jax.process_index()} of {jax.process_count()}"
        hang_timeout_s = timeout_for(train.hang_timeout_s, jax.process_count())
        watchdog = Watchdog(hang_timeout_s, who, lambda: stop.request(HANG_STOP))
        cleanup.enter_context(watchdog)
        state, start_step, restored = starting_point(run, checkpointer)
        if isinstance(run.task, PolicyOptimisation):  # the rows it learns from next, if held
            run.task.hold(restored.meta.get("held_rows") if restored else None)
        if is_main:  # only now: a run refused above must not overwrite the config it had
            (run_dir / "config.yaml").write_text(config_text(run))
            for note in _resume_notes(run, restored):
                output.note(note)
        if start_step >= train.steps:
            if is_main:
                output.note(
                    f"{run_dir} already finished {start_step} steps (train.steps="
                    f"{train.steps}); raise train.steps to go on, or use another run.dir"
                )
            summary = {"steps": start_step, "run_dir": str(run_dir), "resumed_from": start_step}
            summary |= {"first_loss": None, "final_loss": None, "eval_loss": None}
            return Finished(summary, state)
        # DPO's reference log-probs ride with the rows, scored once at step 0
        train_source, eval_sets = reference.attach(run, state, train_source, eval_sets, start_step)
        batches = open_input(run, train_source, restored)
        cleanup.callback(batches.close)
        loop = Loop(
            run=run,
            eval_sets=eval_sets,
            batches=batches,
            checkpointer=checkpointer,
            lock=lock,
            stop=stop,
            watchdog=watchdog,
            start_step=start_step,
            resumed_batch=saved_batch(restored) if restored else None,
            limit_bytes=oom.device_limit_bytes(train.memory_limit_gb),
        )
        try:
            summary, state, compiled = _run_loop(loop, state)
        except oom.OutOfMemoryError as error:  # kept for `doctor`: metrics.jsonl may be empty
            if is_main:
                with contextlib.suppress(OSError):  # (the report is the error; the file a copy)
                    oom.write_record(run_dir, error, start_step + 1)
            raise
    if is_main:
        run_records.print_summary(summary, task)
    return Finished(summary, state, compiled)


def _resume_notes(run: Setup, restored: Restored | None) -> list[str]:
    """What a resume changed: the config's schedule (not a user optimizer's), the batch."""
    if restored is None:
        return []
    notes = []
    if run.lr_schedule is not None and (changed := schedule_change(restored, run.train, run.optim)):
        notes.append(changed)
    if batch_note := batch_change_note(restored, run.train):
        notes.append(batch_note)
    return notes


@dataclasses.dataclass
class Loop:
    """What the loop works with: the run's Setup, and what `run` opened for it.

    `instruments` and `saver` are made once the step has compiled (the progress bar and
    metrics.jsonl start with the first step).
    """

    run: Setup
    eval_sets: tuple[EvalSet, ...]  # the default one first; none: no eval
    batches: DevicePrefetcher
    checkpointer: Checkpointer | None
    lock: RunLock  # taken again when the run directory is made again
    stop: StopRequest
    watchdog: Watchdog
    start_step: int  # the step the state has done (0, or the checkpoint's)
    resumed_batch: int | None  # the global batch of the checkpoint resumed from
    limit_bytes: int | None  # what one device may hold, for the out-of-memory report
    instruments: run_records.Instruments = dataclasses.field(init=False)
    saver: Saver = dataclasses.field(init=False)
    generators: tuple | None = None  # a policy task's (live, reference): _generators
    # (step, its loss and grad_norm on the device) since the step before the last log step:
    # where a non-finite loss began, read only when one is logged (_blame_the_batch).
    recent: list[tuple[int, dict[str, Any]]] = dataclasses.field(default_factory=list)


def _run_loop(loop: Loop, state) -> tuple[dict[str, Any], Any, Any]:
    """Compiles the step, then runs it from the start step + 1: log, eval, save, stop.

    Returns (summary, final state, the compiled step). The watchdog hears of each step's
    progress and of the phase the loop is in.
    """
    run, batches, watchdog, start_step = loop.run, loop.batches, loop.watchdog, loop.start_step
    steps = run.train.steps
    first_batch = _next_batch(loop, state, start_step + 1)
    train_step, eval_step = _compile(loop, state, first_batch)
    run_records.say_compiled(run, train_step.compile_s, start_step)
    instruments = run_records.instruments(run, state, start_step, loop.resumed_batch)
    loop.instruments = instruments
    loop.saver = saver = Saver(run, loop.checkpointer, batches, instruments, loop.lock)
    stopped_by, step = None, start_step
    train_start = time.perf_counter()
    instruments.timer.restart(step=start_step)
    in_flight: collections.deque = collections.deque()
    for step in range(start_step + 1, steps + 1):
        is_first = step == start_step + 1
        with watchdog.waiting_in("data"):
            batch = first_batch if is_first else _next_batch(loop, state, step)
        with watchdog.waiting_in("step"):
            state, metrics = _run_step(loop, train_step, state, batch, step)
        if is_first:  # before any update: a nan comes from the batch or the loss
            _check_input(batches, start_step, loop.checkpointer)
            run_records.check_first_step(run, step, metrics, instruments)
        loop.stop.stepping = True  # a signal from now on saves the step reached
        in_flight.append(metrics["loss"])
        loop.recent.append((step, {name: metrics[name] for name in ("loss", "grad_norm")}))
        if len(in_flight) > STEPS_IN_FLIGHT:  # wait for a step long dispatched, not this one
            in_flight.popleft().block_until_ready()
        heartbeat.progress.step = step  # what the launcher names if this process stalls
        watchdog.progressed(step)
        due = [one for one in loop.eval_sets if one.is_due(step, step == steps)]
        # An eval step is also a log step: its eval results join that step's record.
        is_log_step = step % run.train.log_every == 0 or step == steps or bool(due)
        if is_log_step:
            _check_input(batches, start_step, loop.checkpointer)  # before the loss is judged
            with watchdog.waiting_in("log"):
                saver.keep_directories(step, state)
                # The one host sync between log steps: this step's metrics, the recent losses.
                values, recent = jax.device_get((metrics, loop.recent))
                _check_recent_losses(loop, step, recent, state)  # a batch that made it nan
                record = run_records.log_record(run, step, values, train_step, instruments)
                del loop.recent[:-1]  # the step before the next ones
                record |= examples_by_source(batches.consumed_state())  # a mixture's, per source
                if due:  # after the timings: eval time is not step time
                    with watchdog.paused():  # its first call compiles
                        record |= _evaluate(loop, eval_step, state, step, due)
                run_records.write_record(record, run.task, instruments)
        stopped_by = stop_agreed(loop.stop, step, is_log_step)
        stop_now = stopped_by is not None
        if saver.is_due(step, stop_now):
            if not is_log_step:  # no save holds what a batch of nan made
                _check_input(batches, start_step, loop.checkpointer)
            with watchdog.waiting_in("save", untimed=not saver.has_saved):  # the first compiles
                saver.save(step, state)
            watchdog.progressed(step)
        if stop_now:
            break
    with watchdog.waiting_in("save"):
        saver.finish(step, state)  # committed before we say it is saved
    instruments.close(step)
    stopped_by = _stopped_by(loop.stop, stopped_by)
    train_s = time.perf_counter() - train_start
    if stopped_by == HANG_STOP:  # the hang cleared in time for a save: still a failure
        checkpointer = loop.checkpointer
        where = f"saved step {step} to {checkpointer.directory}" if checkpointer else "not saved"
        raise HangError(f"stopped by the hang watchdog after step {step}; {where}")
    run_records.say_stopped(stopped_by, step, loop.checkpointer)
    summary = run_records.summary(run, instruments, step, train_s)
    summary |= {"compile_s": train_step.compile_s, "stopped_by": stopped_by}
    if not stopped_by:
        with watchdog.paused():  # the sample's decoding compiles
            sample = run.task.closing_sample(run.layout, state, run.mesh)
        summary |= {} if sample is None else {"sample": sample}
    return summary, state, train_step.compiled


def _stopped_by(stop: StopRequest, agreed: str | None) -> str | None:
    """What stopped the run, its save committed: the agreed stop, or a signal after the last step.

    (A late signal counts on one process; several agreed theirs in the loop.) From here on
    more signals end the process with that stop's status (preemption.stop_saved).
    """
    late = stop.signal_name not in (None, HANG_STOP) and jax.process_count() == 1
    stopped_by = agreed if agreed is not None or not late else stop.signal_name
    if stopped_by is not None:
        preemption.stop_saved(stopped_by)
    return stopped_by


def _compile(loop: Loop, state, first_batch) -> tuple[CompiledStep, Any]:
    """The train step compiled for the first batch (out of memory: a readable error).

    Its later compiles (a new batch shape) run with the watchdog paused.
    """
    run, limit_bytes = loop.run, loop.limit_bytes
    with oom.readable_out_of_memory(run.memory, run.layout, limit_bytes):
        train_step = CompiledStep(
            run.jit_train_step(),
            state,
            first_batch,
            one_at_a_time=one_step_at_a_time(run.layout, run.mesh),
            untimed=loop.watchdog.paused,
        )
    if run.train.memory_limit_gb:  # the device's own limit: its allocator is the judge
        oom.check_fits(run.memory, run.layout, train_step.compiled, limit_bytes)
    return train_step, readable_errors_of(run.jit_eval_step())


def _next_batch(loop: Loop, state, step: int):
    """Step `step`'s batch; the time waited counts as data wait (from the second step).

    A policy task's batch is its prompts: the rows are its rollout on `state`'s weights, or
    the rows it holds from an earlier step's.
    """
    task = loop.run.task
    if isinstance(task, PolicyOptimisation) and task.reuses(step):  # grpo.iterations > 1
        return task.held_rows(loop.run)
    wait_start = time.perf_counter()
    batch = next(loop.batches)
    if hasattr(loop, "instruments"):  # (made once the first step's batch has compiled)
        loop.instruments.timer.wait_s += time.perf_counter() - wait_start
    if isinstance(task, PolicyOptimisation):
        batch = task.rollout(loop.run, batch, step, *_generators(loop, state))
    return batch


def _generators(loop: Loop, state) -> tuple:
    """A policy task's generator over the weights as they are, and its reference's (or None).

    Made once (their compiles are kept); the live one reads `state`'s weights each step.
    """
    if loop.generators is None:
        task = loop.run.task
        reference = Generator(task.init_from) if task.settings.beta else None
        loop.generators = (Generator.of_run(loop.run, state), reference)
    live, reference = loop.generators
    live.params, live.model_state = state.params, state.model_state or {}
    return live, reference


def _run_step(loop: Loop, train_step: CompiledStep, state, batch, step: int):
    """One train step; dispatch only, except the first, which waits (and may run out of memory)."""
    run, instruments = loop.run, loop.instruments
    dispatch_start = time.perf_counter()
    instruments.profiler.before(step)
    if step == loop.start_step + 1:  # XLA reports running out of memory once the step runs
        compiled, limit_bytes = train_step.compiled, loop.limit_bytes
        with oom.readable_out_of_memory(run.memory, run.layout, limit_bytes, compiled):
            state, metrics = jax.block_until_ready(train_step(state, batch))
    else:  # (the first step waited for the device: its time is not host time)
        state, metrics = train_step(state, batch)
        instruments.timer.dispatch_s += time.perf_counter() - dispatch_start
    instruments.profiler.after(step, metrics)
    instruments.progress.update(1)
    return state, metrics


def _evaluate(loop: Loop, eval_step, state, step: int, due) -> dict[str, float]:
    """The metrics of the eval sets `due` at this step, shown above the progress bar.

    The default set's are eval_loss, ...; a named set's eval_<name>_loss, ...
    """
    history = loop.instruments.history
    start = time.perf_counter()
    shown = run_records.evaluate_sets(loop.run, eval_step, state, due, step)
    history.eval_results |= shown  # each set's latest, for the summary
    history.eval_s += time.perf_counter() - start
    return shown


def _check_input(
    batches: DevicePrefetcher, start_step: int, checkpointer: Checkpointer | None
) -> None:
    """Stops once a batch holding nan or inf was trained on: the data is the cause.

    Called at log and save steps, so a non-finite loss is blamed on the data rather than the
    learning rate, and no checkpoint holds what such a batch did. Each process looks at its
    own rows; several agree on the first step any of them saw (every process must stop).
    """
    first = batches.first_nonfinite  # (its number among the batches handed out, what)
    bad_step, what = (start_step + first[0], first[1]) if first else (0, "")
    if jax.process_count() > 1:  # (int32: jax gathers without x64)
        steps = np.asarray(multihost_utils.process_allgather(np.array(bad_step, np.int32)))
        if not steps.any():
            return
        process = int(np.where(steps > 0, steps, np.iinfo(np.int32).max).argmin())
        if process != jax.process_index():
            bad_step, what = int(steps[process]), f"in the rows process {process} reads"
    if not bad_step:
        return
    saved = checkpointer is not None and checkpointer.steps()
    kept = f"; the checkpoints before it are kept in {checkpointer.directory}" if saved else ""
    raise UserError(
        f"the batch of step {bad_step} holds non-finite values ({what}): the data is the "
        f"cause, not the learning rate; drop or repair those examples (or set "
        f"data.check_finite=false if your loss masks them){kept}"
    )


def _check_recent_losses(loop: Loop, step: int, recent: list, state: TrainState) -> None:
    """A loss that turned non-finite in one step, from sane weights: the batch is the cause.

    `recent`: loop.recent, read at each log step with the logged metrics (one host sync),
    judged when no loss scaler skips steps. The loss of step k is computed with the weights
    step k - 1 left. They were sane when step k - 1's loss was finite and no higher than
    twice the run's first, its gradient norm finite and within 100 times the first's (no
    explosion under way), and the weights are finite still (a learning rate that blew them
    up leaves them not finite; a bad label's gradients are finite). Then the non-finite
    loss comes from step k's batch, not from the learning rate: its inputs are finite
    (data.check_finite saw to that), so an integer field, a label out of the loss's range.
    Raises a UserError naming the step and its examples; else the logged loss is judged as
    before.
    """
    if loop.run.precision.loss_scale_mode()[0] != "none":
        return  # a scaler skips a step of non-finite gradients: a nan loss is its business
    values = recent
    first_bad = next(
        (index for index, (_, one) in enumerate(values) if not np.isfinite(one["loss"])), None
    )
    if first_bad is None or first_bad == 0:
        return  # none, or no finite step before it since the last log: not to be told apart
    (bad_step, bad), (_, before) = values[first_bad], values[first_bad - 1]
    # Where the run started (a fresh model's loss is about chance): an explosion under way
    # has left it far behind, a bad batch comes out of the blue.
    start, start_norm = loop.instruments.first_step_loss, loop.instruments.first_step_grad_norm
    if start is None or start_norm is None or not np.isfinite([start, start_norm]).all():
        return
    grad_norm = float(before["grad_norm"])
    sane = np.isfinite(grad_norm) and grad_norm <= 100 * max(start_norm, 1e-6)
    sane = sane and float(before["loss"]) <= 2 * abs(start)
    if not (np.isfinite(before["loss"]) and sane and params_finite(state.params)):
        return
    examples = loop.batches.examples_of(step - bad_step)
    loop.instruments.writer.write(
        {"step": bad_step, "loss": float(bad["loss"]), "bad_batch": True, "examples": examples}
    )
    named = ""
    if examples:
        named = f"; its examples: {_listed(examples)} of the data (all in metrics.jsonl)"
    raise UserError(
        f"the loss is {float(bad['loss'])} at step {bad_step}, computed with the finite weights "
        f"of step {bad_step - 1} (loss {float(before['loss']):.4g} there): the batch of step "
        f"{bad_step} is the cause, not the learning rate; its inputs hold no nan or inf, so "
        f"its labels or other integer fields are outside what the loss accepts (labels "
        f"outside [0, classes), an index past a table){named}"
    )


def _listed(examples: list[int], shown: int = 8) -> str:
    """`3, 17, 40` (sorted; `and N more` past `shown`)."""
    ordered = sorted(examples)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return ", ".join(str(index) for index in ordered[:shown]) + more
