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
from paisoar_jax.checkpointing.checkpoint import checkpoint_directory
from paisoar_jax.checkpointing.orbax_errors import describe_failure
from paisoar_jax.config import Config
from paisoar_jax.data.mixture import examples_by_source
from paisoar_jax.data.pipeline import check_splits
from paisoar_jax.data.prefetch import DevicePrefetcher
from paisoar_jax.engine.compilation import CompiledStep, one_step_at_a_time, readable_errors_of
from paisoar_jax.engine.evaluation import EvalSet, check_metric_names, evaluate
from paisoar_jax.errors import DivergenceError, HangError, UserError
from paisoar_jax.observe.monitor import IntervalTimer
from paisoar_jax.parallel import sharding
from paisoar_jax.run import oom, run_directory, run_records
from paisoar_jax.run.resume import (
    batch_change_note,
    make_checkpointer,
    resume_input,
    save,
    saved_batch,
    schedule_change,
    starting_point,
)
from paisoar_jax.runtime import full_disk, heartbeat, preemption
from paisoar_jax.runtime.preemption import StopRequest
from paisoar_jax.runtime.run_lock import RunLock
from paisoar_jax.runtime.watchdog import Watchdog, timeout_for
from paisoar_jax.tasks.workload import Setup, Task, Workload, setup
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
    state: Any
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

    def last_saved() -> str:
        newest = heartbeat.newest_checkpoint(str(checkpoint_dir) if checkpoint_dir else None)
        return f"last saved: step {newest} in {checkpoint_dir}" if newest else "no step saved"

    with StopRequest(last_saved, speaks=jax.process_index() == 0) as stop:
        workload = zoo_workload(config) if workload is None else workload
        train_source, eval_sets = open_sources(workload.task, config.train.global_batch)
        built = setup(config, workload)  # below here: sections and built objects only
        return _run(built, train_source, eval_sets, stop, checkpoint_dir)


def open_sources(task: Task, global_batch: int) -> tuple[Any, tuple[EvalSet, ...]]:
    """The task's train source and eval sets, checked (a global batch of train data, ...)."""
    train_source, eval_sets = task.open_sources()
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
        cleanup.enter_context(RunLock(run_dir))
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
        if is_main:  # only now: a run refused above must not overwrite the config it had
            (run_dir / "config.yaml").write_text(config_text(run))
            changed = (
                restored
                and run.lr_schedule is not None
                and schedule_change(restored, train, run.optim)
            )
            if changed:  # (the config's schedule only: a user's optimizer keeps its own)
                output.note(changed)
            if restored and (batch_note := batch_change_note(restored, train)):
                output.note(batch_note)
        if start_step >= train.steps:
            if is_main:
                output.note(
                    f"{run_dir} already finished {start_step} steps (train.steps="
                    f"{train.steps}); raise train.steps to go on, or use another run.dir"
                )
            summary = {"steps": start_step, "run_dir": str(run_dir), "resumed_from": start_step}
            summary |= {"first_loss": None, "final_loss": None, "eval_loss": None}
            return Finished(summary, state)
        batches = open_input(run, train_source, restored)
        cleanup.callback(batches.close)
        limit_bytes = oom.device_limit_bytes(train.memory_limit_gb)
        resumed_batch = saved_batch(restored) if restored else None
        parts = RunParts.of(run, eval_sets, limit_bytes, resumed_batch)
        try:
            summary, state, compiled = _run_loop(
                parts, checkpointer, stop, watchdog, state, start_step, batches
            )
        except oom.OutOfMemoryError as error:  # kept for `doctor`: metrics.jsonl may be empty
            if is_main:
                with contextlib.suppress(OSError):  # (the report is the error; the file a copy)
                    oom.write_record(run_dir, error, start_step + 1)
            raise
    if is_main:
        run_records.print_summary(summary, task)
    return Finished(summary, state, compiled)


def config_text(run: Setup) -> str:
    """What the run writes to <run.dir>/config.yaml: the task's note, then the config."""
    return run.task.config_note + run.config_yaml


def open_input(run: Setup, train_source, restored) -> DevicePrefetcher:
    """The batches this process trains on, moved to the checkpoint's position, on the devices."""
    train, data = run.train, run.data
    host_iterator = iter(
        run.task.host_batches(
            train_source,
            global_batch=train.global_batch,
            seed=train.seed,
            train=True,
            workers=data.workers,
        )
    )
    if restored is not None:
        note = resume_input(host_iterator, restored, data, train)
        if note and jax.process_index() == 0:
            output.note(note)
    return DevicePrefetcher(
        host_iterator, sharding.batch_sharding(run.mesh), data.prefetch, data.check_finite
    )


@dataclasses.dataclass(frozen=True)
class RunParts(Setup):
    """What the loop works with: the run's Setup, and what `run` adds before the first step."""

    eval_sets: tuple[EvalSet, ...] = ()  # the default one first; none: no eval
    limit_bytes: int | None = None  # what one device may hold, for the out-of-memory report
    resumed_batch: int | None = None  # the global batch of the checkpoint resumed from

    @classmethod
    def of(
        cls,
        run: Setup,
        eval_sets: tuple[EvalSet, ...],
        limit_bytes: int | None,
        resumed_batch: int | None = None,
    ) -> RunParts:
        """`run`'s fields, with the eval sets, the memory limit and the resumed batch."""
        fields = {field.name: getattr(run, field.name) for field in dataclasses.fields(run)}
        return cls(
            **fields, eval_sets=eval_sets, limit_bytes=limit_bytes, resumed_batch=resumed_batch
        )


def _run_loop(parts: RunParts, checkpointer, stop, watchdog, state, start_step: int, batches):
    """Compiles the step, then runs it from start_step + 1: log, eval, save, stop.

    Returns (summary, final state, the compiled step). The watchdog hears of each step's
    progress and of the phase the loop is in.
    """
    train_config, steps = parts.train, parts.train.steps
    first_batch = next(batches)
    train_step, eval_step = _compile(parts, state, first_batch, watchdog.paused)
    run_records.say_compiled(parts, train_step.compile_s, start_step)
    instruments = run_records.instruments(parts, start_step)
    history = run_records.start_history(parts, state, start_step)
    stopped_by, step, first_save = None, start_step, True
    train_start = time.perf_counter()
    instruments.timer.restart(step=start_step)
    in_flight: collections.deque = collections.deque()
    for step in range(start_step + 1, steps + 1):
        is_first = step == start_step + 1
        watchdog.phase = "data"
        batch = _next_batch(batches, first_batch if is_first else None, instruments.timer)
        watchdog.phase = "step"
        state, metrics = _run_step(parts, train_step, state, batch, step, is_first, instruments)
        if is_first:  # before any update: a nan comes from the batch or the loss
            _check_first_step(parts, batches, start_step, checkpointer, metrics, instruments)
        stop.stepping = True  # a signal from now on saves the step reached
        in_flight.append(metrics["loss"])
        if len(in_flight) > STEPS_IN_FLIGHT:  # wait for a step long dispatched, not this one
            in_flight.popleft().block_until_ready()
        heartbeat.progress.step = step  # what the launcher names if this process stalls
        watchdog.progressed(step)
        is_last = step == steps
        due = [one for one in parts.eval_sets if one.is_due(step, is_last)]
        # An eval step is also a log step: its eval results join that step's record.
        is_log_step = step % train_config.log_every == 0 or is_last or bool(due)
        if is_log_step:
            watchdog.phase = "log"
            _check_input(batches, start_step, checkpointer)  # before the loss is judged
            _keep_directories(parts, checkpointer, instruments, step, state, batches)
            record = run_records.log_record(parts, step, metrics, train_step, instruments, history)
            record |= examples_by_source(batches.consumed_state())  # a mixture's, per source
            if due:  # after the timings: eval time is not step time
                with watchdog.paused():  # its first call compiles
                    record |= _evaluate(parts, eval_step, state, step, history, due)
            run_records.write_record(record, parts.task, instruments)
        stopped_by = stop_agreed(stop, step, is_log_step)
        stop_now = stopped_by is not None
        if checkpointer is not None and _is_save_step(
            parts.checkpoint.every, steps, step, stop_now
        ):
            if not is_log_step:  # no save holds what a batch of nan made
                _check_input(batches, start_step, checkpointer)
            watchdog.phase = "save"
            with watchdog.paused() if first_save else contextlib.nullcontext():  # it compiles
                _timed_save(checkpointer, step, state, batches, parts, instruments)
            first_save = False
            watchdog.progressed(step)
        if stop_now:
            break
    watchdog.phase = "save"
    if checkpointer is not None:  # committed before we say it is saved
        _commit_last_save(parts, checkpointer, instruments, step, state, batches)
    instruments.close(step)
    stopped_by = _stopped_by(stop, stopped_by)
    train_s = time.perf_counter() - train_start
    if stopped_by == HANG_STOP:  # the hang cleared in time for a save: still a failure
        where = f"saved step {step} to {checkpointer.directory}" if checkpointer else "not saved"
        raise HangError(f"stopped by the hang watchdog after step {step}; {where}")
    run_records.say_stopped(stopped_by, step, checkpointer)
    summary = run_records.summary(parts, history, instruments.timer, step, start_step, train_s)
    summary |= {"compile_s": train_step.compile_s, "stopped_by": stopped_by}
    sample = None
    if not stopped_by:
        with watchdog.paused():  # the sample's decoding compiles
            sample = parts.task.closing_sample(parts.layout, state, parts.mesh)
    summary = summary if sample is None else {**summary, "sample": sample}
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


def _compile(parts: RunParts, state, first_batch, untimed) -> tuple[CompiledStep, Any]:
    """The train step compiled for the first batch (out of memory: a readable error).

    `untimed`: a context the step's later compiles (a new batch shape) run in.
    """
    layout, mesh, limit_bytes = parts.layout, parts.mesh, parts.limit_bytes
    with oom.readable_out_of_memory(parts.memory, layout, limit_bytes):
        jitted = parts.jit_train_step()
        one_at_a_time = one_step_at_a_time(layout, mesh)
        train_step = CompiledStep(
            jitted, state, first_batch, one_at_a_time=one_at_a_time, untimed=untimed
        )
    if parts.train.memory_limit_gb:  # the device's own limit: its allocator is the judge
        oom.check_fits(parts.memory, layout, train_step.compiled, limit_bytes)
    return train_step, readable_errors_of(parts.jit_eval_step())


def _next_batch(batches, ready, timer: IntervalTimer):
    """The next batch (`ready` when given); the time waited counts as data wait."""
    wait_start = time.perf_counter()
    batch = ready if ready is not None else next(batches)
    timer.wait_s += time.perf_counter() - wait_start
    return batch


def _run_step(parts, train_step, state, batch, step: int, is_first: bool, instruments):
    """One train step; dispatch only, except the first, which waits (and may run out of memory)."""
    dispatch_start = time.perf_counter()
    instruments.profiler.before(step)
    if is_first:  # XLA reports running out of memory once the step runs
        compiled, limit_bytes = train_step.compiled, parts.limit_bytes
        with oom.readable_out_of_memory(parts.memory, parts.layout, limit_bytes, compiled):
            state, metrics = jax.block_until_ready(train_step(state, batch))
    else:  # (the first step waited for the device: its time is not host time)
        state, metrics = train_step(state, batch)
        instruments.timer.dispatch_s += time.perf_counter() - dispatch_start
    instruments.profiler.after(step, metrics)
    instruments.progress.update(1)
    return state, metrics


def _check_first_step(
    parts: RunParts, batches, start_step: int, checkpointer, metrics, instruments
):
    """The batch first (it names a non-finite value), then the loss and gradient norm."""
    _check_input(batches, start_step, checkpointer)
    run_records.check_first_step(parts, start_step + 1, metrics, instruments)


def _evaluate(parts, eval_step, state, step: int, history, due) -> dict[str, float]:
    """The metrics of the eval sets `due` at this step, shown above the progress bar.

    The default set's are eval_loss, ...; a named set's eval_<name>_loss, ...
    """
    start = time.perf_counter()
    shown = {}
    for one in due:
        results = evaluate(eval_step, state, one.source, parts.task, parts.train, parts.mesh, step)
        shown |= {f"{one.prefix}{name}": value for name, value in results.items()}
    history.eval_results |= shown  # each set's latest, for the summary
    history.eval_s += time.perf_counter() - start
    if jax.process_index() == 0:
        line = f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items())
        output.note(line, prefixed=False)
    return shown


def _check_input(batches: DevicePrefetcher, start_step: int, checkpointer) -> None:
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


def _is_save_step(every: int, steps: int, step: int, stop_now: bool) -> bool:
    """Every checkpoint.every (`every`) steps, the last step (`steps`), and a stop."""
    return bool(every and step % every == 0) or step == steps or stop_now


def _timed_save(checkpointer, step: int, state, batches, parts: RunParts, instruments) -> None:
    """Starts the save; the time the loop blocks on it is save time, not step time."""
    save_start = time.perf_counter()
    try:
        checkpointer.wait()  # the save in flight first: what it writes takes room too
    except Exception as error:  # its directory went away under it, most often
        _say_save_failed(checkpointer, error, f"saving step {step} now instead")
        _keep_directories(parts, checkpointer, instruments, step, state, batches)
        run_directory.reopen(checkpointer, step, _saver(parts, step, state, batches), parts.run_dir)
    _keep_directories(parts, checkpointer, instruments, step, state, batches)
    estimate_bytes = full_disk.tree_bytes(parts.layout.abstract_state)
    full_disk.check_room(parts.run_dir, checkpointer.directory, estimate_bytes)
    try:
        save(checkpointer, step, state, batches, parts)
    except (UserError, DivergenceError):
        raise
    except Exception as error:  # the directory went away again while the save started
        _say_save_failed(checkpointer, error, f"saving step {step} again")
        _keep_directories(parts, checkpointer, instruments, step, state, batches)
        run_directory.reopen(checkpointer, step, _saver(parts, step, state, batches), parts.run_dir)
        save(checkpointer, step, state, batches, parts)
    save_s = time.perf_counter() - save_start
    instruments.timer.start_time += save_s
    instruments.timer.save_s += save_s


def _commit_last_save(parts: RunParts, checkpointer, instruments, step: int, state, batches):
    """Waits for the last save; one that failed is made again, or rescued elsewhere."""
    try:
        checkpointer.wait()
        return
    except Exception as error:
        _say_save_failed(checkpointer, error, f"saving step {step} again")
    _keep_directories(parts, checkpointer, instruments, step, state, batches)
    run_directory.reopen(checkpointer, step, _saver(parts, step, state, batches), parts.run_dir)
    try:
        save(checkpointer, step, state, batches, parts)
        checkpointer.wait()
    except UserError:
        raise
    except Exception as error:
        why = describe_failure(error)
        run_directory.rescue(
            checkpointer, step, _saver(parts, step, state, batches), why, parts.run_dir
        )


def _say_save_failed(checkpointer, error: Exception, then: str) -> None:
    if jax.process_index() == 0:
        output.warning(
            f"a checkpoint save in {checkpointer.directory} failed ({describe_failure(error)}); "
            f"{then}"
        )


def _saver(parts: RunParts, step: int, state, batches):
    """save_to(checkpointer): saves the step reached there (for a rescue)."""
    return lambda checkpointer: save(checkpointer, step, state, batches, parts)


def _keep_directories(parts: RunParts, checkpointer, instruments, step: int, state, batches):
    """A vanished run or checkpoint directory is made again (run_directory.py)."""
    run_directory.keep_directories(
        parts.run_dir,
        checkpointer,
        instruments.writer,
        lambda: config_text(parts),
        step,
        _saver(parts, step, state, batches),
    )
