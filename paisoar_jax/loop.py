"""The training loop: one straight path from config to a trained model, no hook framework.

mesh -> sharded state -> grain batches prefetched to the devices -> the compiled step, with
explicit `if step % k == 0` actions for logging and eval. The host reads device values only
at log and eval steps, so the step loop never stalls on a device sync otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from paisoar_jax import __version__, heartbeat, oom, sharding
from paisoar_jax.checkpoint import (
    Checkpointer,
    Restored,
    checkpoint_directory,
    describe_failure,
    load_weights,
)
from paisoar_jax.compilation import CompiledStep
from paisoar_jax.config import Config, dump_yaml, to_dict
from paisoar_jax.data.pipeline import GlobalBatches, resume_position
from paisoar_jax.data.prefetch import DevicePrefetcher, global_batch
from paisoar_jax.errors import DivergenceError, UserError
from paisoar_jax.loss_scale import all_finite, parse_mode
from paisoar_jax.metrics import MetricsWriter, device_peak_tflops
from paisoar_jax.monitor import IntervalTimer, StepProfiler, check_health, device_memory
from paisoar_jax.preemption import StopRequest
from paisoar_jax.run_lock import RunLock
from paisoar_jax.sample import generate
from paisoar_jax.state import StateLayout, init_state
from paisoar_jax.step import jit_eval_step, jit_train_step
from paisoar_jax.workload import Task, Workload, setup
from paisoar_jax.zoo import zoo_workload

SAMPLE_PROMPT = b"def "
STOP_CHECK_EVERY = 10  # steps between multi-process agreements on a stop signal


def evaluate(eval_step, state, eval_source, task, config: Config, mesh) -> dict[str, float]:
    """Mean eval metrics (loss, ...) over the first train.eval_batches held-out batches."""
    batches = iter(
        task.host_batches(
            eval_source,
            global_batch=config.train.global_batch,
            seed=config.train.seed,
            train=False,
        )
    )
    results = []
    for _ in range(config.train.eval_batches):
        batch = global_batch(sharding.batch_sharding(mesh), next(batches))
        results.append(eval_step(state.params, state.model_state, batch))
    results = jax.device_get(results)
    return {name: float(np.mean([result[name] for result in results])) for name in results[0]}


def _checkpointer(config: Config) -> Checkpointer | None:
    """The run's checkpointer, or None when checkpointing is off."""
    settings = config.checkpoint
    if not settings.enabled:
        return None
    directory = checkpoint_directory(settings, config.run_dir)
    return Checkpointer(directory, settings.keep, settings.keep_period, settings.async_save)


def _starting_point(
    config: Config, layout: StateLayout, checkpointer: Checkpointer | None, task: Task
) -> tuple[Any, int, Restored | None]:
    """(state, step, what was restored or None): resumed, fine-tuned from params, or fresh."""
    resume, signature = config.checkpoint.resume, input_signature(config, task)
    if checkpointer is not None and resume != "never":
        if resume == "auto":
            restored = checkpointer.restore_latest(layout.abstract_state, signature)
        elif int(resume) not in checkpointer.steps():
            raise UserError(
                f"checkpoint.resume={resume}: no such step in {checkpointer.directory} "
                f"(steps: {checkpointer.steps() or 'none'})"
            )
        else:
            try:
                restored = checkpointer.restore(int(resume), layout.abstract_state, signature)
            except UserError:
                raise
            except Exception as error:  # asked for by name: no silent fallback to another
                raise UserError(
                    f"checkpoint.resume={resume}: step {resume} in {checkpointer.directory} is "
                    f"unreadable ({describe_failure(error)})"
                ) from None
            checkpointer.set_aside_after(int(resume))  # only once the older step restored
        if restored is not None:
            return restored.state, restored.step, restored
    elif checkpointer is not None and checkpointer.steps():
        raise UserError(
            f"checkpoint.resume=never but {checkpointer.directory} already holds steps "
            f"{checkpointer.steps()}: use another run.dir or checkpoint.dir"
        )
    state = init_state(config, layout)
    if config.checkpoint.init_from:
        params, model_state = load_weights(
            pathlib.Path(config.checkpoint.init_from), layout.abstract_state
        )
        state = state.replace(params=params, model_state=model_state or state.model_state)
    return state, 0, None


def input_signature(config: Config, task: Task) -> dict[str, Any]:
    """What a saved input position belongs to; a resume that changes it starts afresh."""
    return {
        "source": config.data.source,
        "workers": config.data.workers,  # grain's state differs with and without workers
        "global_batch": config.train.global_batch,
        **task.signature(),  # seq_len, image size and channels, or a user's data
        "seed": config.train.seed,
    }


def _resume_input(host_iterator, restored: Restored, config: Config) -> str | None:
    """Moves the input to where the checkpoint left it; a line to print when it cannot."""
    step = restored.step
    if isinstance(host_iterator, GlobalBatches):
        saved_batch = restored.meta.get("config", {}).get("train", {}).get("global_batch")
        examples, note = resume_position(
            restored.data_state,
            host_iterator,
            step,
            saved_batch or config.train.global_batch,
            config.data.on_change,
        )
        host_iterator.set_state({"examples": examples})
        return note
    if not hasattr(host_iterator, "set_state"):
        return (
            f"resumed at step {step}, but the input has no position to save (a plain "
            f"iterable): it restarts from its first batch"
        )
    if (restored.data_state or {}).get("sampler") == "global":
        return (
            f"checkpoint step {step} holds a position of examples in the global order, but "
            f"the input is now ready batches: they restart from their first batch"
        )
    if restored.data_state is None:
        why = f" (the input changed since: {restored.input_changes})"
        return (
            f"checkpoint step {step} holds no input position this run can continue"
            f"{why if restored.input_changes else ''}: the input restarts from its first batch"
        )
    host_iterator.set_state(restored.data_state)
    return None


def _stop_agreed(stop: StopRequest, step: int, is_log_step: bool) -> bool:
    """Whether every process saw a stop signal (processes must save at the same step).

    One process decides alone; several agree with a small collective at log steps and
    every STOP_CHECK_EVERY steps (a collective per step would cost a host sync each).
    """
    if jax.process_count() == 1:
        return stop.requested
    if not (is_log_step or step % STOP_CHECK_EVERY == 0):
        return False
    flags = multihost_utils.process_allgather(np.array(stop.requested))
    return bool(np.any(flags))


_params_finite = jax.jit(all_finite)


def _save(checkpointer, step, state, batches, config, mesh, task) -> None:
    """Starts an async save of `step`; params that are no longer finite are never saved."""
    if not bool(_params_finite(state.params)):
        raise DivergenceError(
            f"the params are not finite after step {step}: training diverged; the "
            f"checkpoints before it are kept in {checkpointer.directory}"
        )
    meta = {
        "step": step,
        "mesh": dict(mesh.shape),
        "version": __version__,
        "config": to_dict(config),
    }
    checkpointer.save(step, state, batches.consumed_state(), meta, input_signature(config, task))


def train(config: Config, workload: Workload | None = None) -> dict[str, Any]:
    """Trains as configured and returns the run's summary (also printed as one line).

    `workload`: the model, task and optimizer to train; default: the config's zoo model.
    """
    workload = zoo_workload(config) if workload is None else workload
    train_config, task = config.train, workload.task
    train_source, eval_source = task.open_sources()
    _check_split_sizes(task, train_source, eval_source, train_config.eval_every)
    run = setup(config, workload)
    mesh, layout = run.mesh, run.layout
    run_dir, is_main = config.run_dir, jax.process_index() == 0

    with contextlib.ExitStack() as cleanup, jax.set_mesh(mesh):
        # Before anything is written or cleaned up: the run directory is made and locked, and
        # a second run in it stops here.
        cleanup.enter_context(RunLock(run_dir))
        checkpointer = _checkpointer(config)
        heartbeat.progress.run_dir = str(run_dir.absolute())
        if checkpointer is not None:
            heartbeat.progress.checkpoint_dir = str(checkpointer.directory)
            cleanup.callback(checkpointer.close)  # waits for the save in flight, on any exit
        # From here on Ctrl-C / SIGTERM only raise a flag: a restore is never cut half-way,
        # and a signal that comes before the first step saves right after it.
        stop = cleanup.enter_context(StopRequest())
        state, start_step, restored = _starting_point(config, layout, checkpointer, task)
        if is_main:  # only now: a run refused above must not overwrite the config it had
            (run_dir / "config.yaml").write_text(dump_yaml(config))
        if start_step >= train_config.steps:
            if is_main:
                print(
                    f"paisoar_jax: {run_dir} already finished {start_step} steps (train.steps="
                    f"{train_config.steps}); raise train.steps to go on, or use another run.dir",
                    flush=True,
                )
            return {"steps": start_step, "run_dir": str(run_dir), "resumed_from": start_step}
        host_iterator = iter(
            task.host_batches(
                train_source,
                global_batch=train_config.global_batch,
                seed=train_config.seed,
                train=True,
                workers=config.data.workers,
            )
        )
        if restored is not None:
            note = _resume_input(host_iterator, restored, config)
            if note and is_main:
                print(f"paisoar_jax: {note}", flush=True)
        batches = DevicePrefetcher(
            host_iterator, sharding.batch_sharding(mesh), config.data.prefetch
        )
        cleanup.callback(batches.close)
        parts = RunParts(config, mesh, task, layout, run.schedule, eval_source, checkpointer, stop)
        summary = _run_loop(parts, state, start_step, batches)
    if is_main:
        _print_summary(summary)
    return summary


def _check_split_sizes(task: Task, train_source, eval_source, eval_every: int) -> None:
    """Every split the run reads holds at least one example (sources of known length)."""
    for split, source in (("train", train_source), ("eval", eval_source)):
        if split == "eval" and (not eval_every or source is None):
            continue
        if hasattr(source, "__len__") and len(source) == 0:
            raise UserError(f"the {split} split has no {task.unit_of_data}")


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What the loop works with, built once by `train` before the first step."""

    config: Config
    mesh: Any
    task: Task
    layout: StateLayout
    schedule: Any  # None: a user's optimizer whose learning rate is its own
    eval_source: Any
    checkpointer: Checkpointer | None
    stop: StopRequest


def _run_loop(parts: RunParts, state, start_step: int, batches) -> dict[str, Any]:
    """Compiles the step and runs it from start_step + 1, logging, evaluating and saving."""
    config, mesh, task, layout = parts.config, parts.mesh, parts.task, parts.layout
    schedule, eval_source = parts.schedule, parts.eval_source
    checkpointer, stop = parts.checkpointer, parts.stop
    train_config, run_dir = config.train, config.run_dir
    is_main = jax.process_index() == 0
    first_batch = next(batches)
    limit_bytes = oom.device_limit_bytes(train_config.memory_limit_gb)
    with oom.readable_out_of_memory(config, layout, limit_bytes):
        jitted = jit_train_step(layout, task, schedule, train_config.grad_accum, mesh)
        train_step = CompiledStep(jitted, state, first_batch)
    compile_s = train_step.compile_s
    if train_config.memory_limit_gb:  # the device's own limit: its allocator is the judge
        oom.check_fits(config, layout, train_step.compiled, limit_bytes)
    eval_step = jit_eval_step(layout, task, mesh)
    resumed = f", resumed from step {start_step}" if start_step else ""
    if is_main:
        print(
            f"paisoar_jax: {layout.param_count / 1e6:.2f}M params, mesh {dict(mesh.shape)}, "
            f"{jax.device_count()} {jax.devices()[0].platform} devices, "
            f"compiled in {compile_s:.1f}s{resumed}",
            flush=True,
        )
    profiler = StepProfiler(train_config.profile_steps, run_dir / "profile")
    timer = IntervalTimer(
        units_per_step=train_config.global_batch * task.units_per_example(),
        flops_per_unit=task.flops_per_unit(layout.param_count),
        peak_tflops=device_peak_tflops(train_config.peak_tflops),
        unit=task.unit,
    )
    writer = MetricsWriter(run_dir, config.run.tensorboard, resume_step=start_step)
    progress = tqdm(
        total=train_config.steps,
        initial=start_step,
        desc="train",
        disable=not (config.run.progress and is_main),
        mininterval=1.0,
    )
    every = config.checkpoint.every
    eval_every = train_config.eval_every if eval_source is not None else 0  # None: no eval data
    losses: list[float] = []
    scale_history: list[tuple[int, float]] = []
    scaled = parse_mode(config.precision.loss_scale, config.precision.policy)[0] != "none"
    eval_results: dict[str, float] = {}
    stopped_by = None
    train_start = time.perf_counter()
    timer.restart(step=start_step)
    step = start_step
    for step in range(start_step + 1, train_config.steps + 1):
        wait_start = time.perf_counter()
        batch = first_batch if step == start_step + 1 else next(batches)
        dispatch_start = time.perf_counter()
        timer.wait_s += dispatch_start - wait_start
        profiler.before(step)
        if step == start_step + 1:  # XLA reports running out of memory once the step runs
            with oom.readable_out_of_memory(config, layout, limit_bytes, train_step.compiled):
                state, metrics = jax.block_until_ready(train_step(state, batch))
        else:  # (the first step waited for the device: its time is not host time)
            state, metrics = train_step(state, batch)
            timer.dispatch_s += time.perf_counter() - dispatch_start
        profiler.after(step, metrics)
        progress.update(1)
        heartbeat.progress.step = step  # what the launcher names if this process stalls
        is_last = step == train_config.steps
        is_eval_step = bool(eval_every) and (step % eval_every == 0 or is_last)
        # An eval step is also a log step: its eval_loss joins that step's metrics record.
        is_log_step = step % train_config.log_every == 0 or is_last or is_eval_step

        if is_log_step:
            values = jax.device_get(metrics)  # the only host sync between logs
            record = {
                "step": step,
                "loss": float(values["loss"]),
                **{name: float(values[name]) for name in task.metric_names},
                "lr": float(values["lr"]) if "lr" in values else None,
                "grad_norm": float(values["grad_norm"]),
                "loss_scale": float(values["loss_scale"]),
                "skipped_steps": int(values["skipped_steps"]),
                **timer.timings(step),
                "checkpoint_s": timer.save_s,  # the loop blocked on saves since the last log
                **device_memory(),
                "recompiles": train_step.recompiles,
            }
            if not losses:
                platform = jax.devices()[0].platform
                record.update(
                    compile_s=compile_s, param_count=layout.param_count, platform=platform
                )
            try:
                check_health(record, scaled, scale_history)
            except DivergenceError:
                writer.write(record)  # the record that shows the divergence is kept
                raise
            losses.append(record["loss"])
            if is_eval_step:  # after the timings: eval time is not step time
                eval_results = evaluate(eval_step, state, eval_source, task, config, mesh)
                record.update({f"eval_{name}": value for name, value in eval_results.items()})
                if is_main:
                    shown = ", ".join(f"eval_{k} {v:.4f}" for k, v in eval_results.items())
                    progress.write(f"step {step}: {shown}")
            writer.write(record)
            rate = f"{record[timer.throughput_key]:,.0f}"
            progress.set_postfix({"loss": f"{record['loss']:.3f}", task.rate_name: rate})
            timer.restart(step)

        stop_now = _stop_agreed(stop, step, is_log_step)
        if checkpointer is not None and ((every and step % every == 0) or is_last or stop_now):
            save_start = time.perf_counter()
            _save(checkpointer, step, state, batches, config, mesh, task)
            save_s = time.perf_counter() - save_start
            timer.start_time += save_s  # not step time
            timer.save_s += save_s
        if stop_now:
            stopped_by = stop.signal_name or "a stop signal on another process"
            break

    progress.close()
    profiler.close(step)
    writer.close()
    if checkpointer is not None:
        checkpointer.wait()  # committed before we say it is saved
    if stopped_by and is_main:
        where = f"saved step {step} to {checkpointer.directory}" if checkpointer else "not saved"
        print(f"paisoar_jax: stopped by {stopped_by} after step {step}; {where}", flush=True)
    train_s = time.perf_counter() - train_start
    steps_run = step - start_step
    summary = {
        "steps": step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": eval_results.get("loss"),
        **{f"eval_{name}": value for name, value in eval_results.items() if name != "loss"},
        timer.throughput_key: timer.units_per_step * steps_run / train_s,
        "compile_s": compile_s,
        "train_s": train_s,
        "run_dir": str(run_dir),
        "resumed_from": start_step,
        "stopped_by": stopped_by,
        "param_count": layout.param_count,
    }
    is_embedded_text = config.data.source == "embedded" and task.unit == "tokens"
    if train_config.sample_bytes and is_embedded_text and not stopped_by:
        text = generate(
            layout,
            state.params,
            state.model_state,
            mesh,
            SAMPLE_PROMPT,
            train_config.sample_bytes,
            config.model.seq_len,
            seed=train_config.seed,
        )
        summary["sample"] = text.decode("utf-8", errors="replace")
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    """The sample, if any, then the one-line summary that closes every run."""
    if "sample" in summary:
        print(f"sample:\n{summary['sample']}\n", flush=True)
    eval_loss, first_loss = summary["eval_loss"], summary["first_loss"]
    eval_text = f", eval_loss {eval_loss:.4f}" if eval_loss is not None else ""
    for key, value in summary.items():
        if key.startswith("eval_") and key != "eval_loss":
            eval_text += f", {key} {value:.4f}"
    unit = "tokens" if "tokens_per_s" in summary else "examples"
    loss_text = (
        f"loss {first_loss:.4f} -> {summary['final_loss']:.4f}"
        if first_loss is not None
        else "no loss logged"
    )
    print(
        f"paisoar_jax: done: {summary['steps']} steps in {summary['train_s']:.1f}s, "
        f"{loss_text}{eval_text}, "
        f"{summary[f'{unit}_per_s']:,.0f} {unit}/s, compile {summary['compile_s']:.1f}s, "
        f"run dir {summary['run_dir']}",
        flush=True,
    )
