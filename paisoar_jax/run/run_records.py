"""What a run records and says: metrics.jsonl, the progress bar and the lines a user reads.

The loop (loop.py) calls these at its explicit points: `say_compiled` after compiling,
`instruments` before the first step, `log_record` and `write_record` at each log step,
`say_stopped` after a stop signal, `summary` and `print_summary` at the end. Each reads the
run's Setup and the Instruments, which carry what the run has seen so far.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax

from paisoar_jax import output
from paisoar_jax.checkpointing.checkpoint import Checkpointer
from paisoar_jax.engine.compilation import CompiledStep
from paisoar_jax.engine.evaluation import EvalSet, HarnessTasks, evaluate
from paisoar_jax.engine.state import TrainState
from paisoar_jax.errors import DivergenceError, UserError
from paisoar_jax.numerics import loss_scale
from paisoar_jax.observe.metrics import MetricsWriter, device_peak_tflops
from paisoar_jax.observe.monitor import IntervalTimer, StepProfiler, check_health, device_memory
from paisoar_jax.parallel import sharding
from paisoar_jax.run import oom
from paisoar_jax.run.setup import Setup
from paisoar_jax.runtime import ray_train
from paisoar_jax.tasks.workload import Task


@dataclasses.dataclass
class History:
    """What the loop has seen so far: the logged losses, the loss scales, each eval set's last."""

    losses: list[float] = dataclasses.field(default_factory=list)
    # (step, loss scale, skipped steps) of the log steps (unscaled: those with a finite loss)
    scales: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)
    eval_results: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_s: float = 0.0  # time spent in evals (not step time: left out of the throughput)


def start_history(run: Setup, state: TrainState, start_step: int) -> History:
    """An empty History; with a loss scaler, the scale and skipped steps at start_step.

    So the first log interval counts towards the steps skipped in a row, as the later do.
    """
    history = History()
    if run.precision.loss_scale_mode()[0] != "none":
        values = jax.device_get(loss_scale.scale_metrics(state.opt_state))
        start = (start_step, float(values["loss_scale"]), int(values["skipped_steps"]))
        history.scales.append(start)
    return history


@dataclasses.dataclass
class Instruments:
    """What measures and reports the run: timers, metrics.jsonl, the progress bar, profiler."""

    timer: IntervalTimer
    writer: MetricsWriter
    progress: Any  # tqdm
    profiler: StepProfiler
    history: History
    start_step: int  # the step the run started from (0, or the checkpoint's)
    resumed_batch: int | None = None  # the global batch of the checkpoint resumed from
    first_step_loss: float | None = None  # before any update: about chance for a fresh model
    first_step_grad_norm: float | None = None

    def close(self, step: int) -> None:
        """Ends the bar, the trace and the metrics files."""
        self.progress.close()
        self.profiler.close(step)
        self.writer.close()


def instruments(
    run: Setup, state: TrainState, start_step: int, resumed_batch: int | None = None
) -> Instruments:
    """Timers in the task's unit, the metrics writer, the progress bar, profiler and history.

    `state`: the state the run starts from; `resumed_batch`: the global batch of the
    checkpoint it resumed from (a change is recorded in the first record).
    """
    task, train_config, run_dir = run.task, run.train, run.run_dir
    timer = IntervalTimer(
        units_per_step=train_config.global_batch * task.units_per_example(),
        flops_per_unit=task.flops_per_unit(run.layout.flops_param_count),
        peak_tflops=device_peak_tflops(train_config.peak_tflops),
        unit=task.unit,
    )
    progress = output.progress_bar(
        total=train_config.steps,
        initial=start_step,
        desc="train",
        disable=not (
            run.reporting.progress and output.shows_progress() and jax.process_index() == 0
        ),
    )
    return Instruments(
        timer=timer,
        writer=MetricsWriter(
            run_dir,
            resume_step=start_step,
            reporting=run.reporting,
            record=run.record,
            optimizer=run.given_optimizer,
        ),
        progress=progress,
        profiler=StepProfiler(train_config.profile_steps, run_dir / "profile"),
        history=start_history(run, state, start_step),
        start_step=start_step,
        resumed_batch=resumed_batch,
    )


def say_compiled(run: Setup, compile_s: float, start_step: int) -> None:
    """The line after compiling: model size, mesh, devices, compile time."""
    if jax.process_index() != 0:
        return
    resumed = f", resumed from step {start_step}" if start_step else ""
    output.note(
        f"{run.layout.describe_size()}, "
        f"mesh {sharding.mesh_sizes(run.mesh)}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, "
        f"compiled in {compile_s:.1f}s{resumed}"
    )


def log_record(
    run: Setup, step: int, values: Any, train_step: CompiledStep, instruments: Instruments
) -> dict[str, Any]:
    """The metrics.jsonl record of a log step, health-checked.

    `values`: the step's metrics on the host (the caller's jax.device_get: the one host
    sync between log steps).
    """
    timer, history = instruments.timer, instruments.history
    record = {
        "step": step,
        "loss": float(values["loss"]),
        **{name: float(values[name]) for name in run.task.metric_names},
        "lr": float(values["lr"]) if "lr" in values else None,
        "grad_norm": float(values["grad_norm"]),
        "loss_scale": float(values["loss_scale"]),
        "skipped_steps": int(values["skipped_steps"]),
        **({"skipped_spikes": int(values["skipped_spikes"])} if "skipped_spikes" in values else {}),
        **timer.timings(step),
        "checkpoint_s": timer.save_s,  # the loop blocked on saves since the last log
        **device_memory(),
        "recompiles": train_step.recompiles,
    }
    if not history.losses:  # the first record also says what ran
        platform = jax.devices()[0].platform
        layout = run.layout
        record |= {"compile_s": train_step.compile_s, "param_count": layout.param_count}
        record["platform"] = platform
        # What the doctor compares with: the loss before any update (a fresh model's is about
        # chance), and where the run ran (its cores bound the input workers it proposes).
        record["first_step_loss"] = instruments.first_step_loss
        record["process_count"], record["device_count"] = jax.process_count(), jax.device_count()
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        record["host_cores"] = len(affinity(0)) if affinity else os.cpu_count()
        batch, resumed_batch = run.train.global_batch, instruments.resumed_batch
        record["global_batch"] = batch
        if resumed_batch is not None and resumed_batch != batch:  # said in a line at start
            record["global_batch_changed"] = [resumed_batch, batch]
        # Whether optim.lr sets the learning rate (the doctor's advice depends on it).
        record["lr_source"] = "config" if run.lr_schedule is not None else "optimizer"
        if record["lr"] is None and jax.process_index() == 0:
            output.note(
                "lr is not logged: your optimizer's learning rate cannot be read; build it "
                "with optax.inject_hyperparams to log it"
            )
    # A user's own optimizer (fit's optimizer=optax...) has its own learning rate.
    lower_lr = "lower optim.lr" if run.lr_schedule is not None else "lower your optimizer's lr"
    try:
        check_health(record, run.precision, history.scales, lower_lr)
    except DivergenceError:
        instruments.writer.write(record)  # the record that shows the divergence is kept
        raise
    history.losses.append(record["loss"])
    return record


def evaluate_sets(
    run: Setup, eval_step: Any, state: TrainState, eval_sets: Sequence[EvalSet], step: int
) -> dict[str, float]:
    """Each eval set's metrics, whole, named as metrics.jsonl names them, in a line.

    The default set's are eval_loss, ...; a named set's eval_<name>_loss, .... `step`: the
    step evaluated (a mixture's weights are the ones at it). The line goes above the bar.
    """
    shown = {}
    for one in eval_sets:
        if isinstance(one.source, HarnessTasks):  # lm-eval's tasks on the weights as they are
            from paisoar_jax.inference.harness import evaluate_state

            results = evaluate_state(run, state, one.source, step)
        else:
            results = evaluate(eval_step, state, one.source, run.task, run.train, run.mesh, step)
        shown |= {f"{one.prefix}{name}": value for name, value in results.items()}
    if jax.process_index() == 0:
        line = f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items())
        output.note(line, prefixed=False)
    return shown


def write_record(record: dict[str, Any], task: Task, instruments: Instruments) -> None:
    """Writes the record, shows its loss and rate on the bar, and starts the next interval."""
    instruments.writer.write(record)
    ray_train.report(record)  # inside a Ray Train worker: Ray hears of it too
    rate = f"{record[instruments.timer.throughput_key]:,.0f}"
    postfix = {"loss": f"{record['loss']:.3f}", task.rate_name: rate}
    instruments.progress.set_postfix(postfix, refresh=False)  # drawn at the bar's own pace
    instruments.timer.restart(record["step"])


def check_first_step(run: Setup, step: int, metrics: Any, instruments: Instruments) -> None:
    """The first step of a run, before any update: a loss that is not finite, or no gradient.

    The weights were finite (fresh, or a checkpoint save checked them), so a loss that is
    nan or inf here comes from the batch or the loss, not from the learning rate: the run
    stops in one line saying so (its record marked `before_update` for the doctor). A
    gradient of exactly zero reaches no parameter: one line names the usual causes.
    """
    values = jax.device_get({name: metrics[name] for name in ("loss", "grad_norm")})
    loss, grad_norm = float(values["loss"]), float(values["grad_norm"])
    instruments.first_step_loss, instruments.first_step_grad_norm = loss, grad_norm
    if jax.process_index() == 0:  # this step fits: a record of one that did not is old
        oom.clear_record(run.run_dir)
    if not math.isfinite(loss):
        instruments.writer.write(
            {"step": step, "loss": loss, "grad_norm": grad_norm, "before_update": True}
        )
        fp16 = ", or activations beyond fp16's range" if "16" in run.precision.policy else ""
        raise UserError(
            f"the loss is {loss} at step {step}, before any update: the inputs or labels are "
            f"the likely cause, not the learning rate (labels outside [0, classes), a log or "
            f"division of 0 in the loss, non-finite values in the data{fp16})"
        )
    if grad_norm == 0.0 and jax.process_index() == 0:
        output.warning(
            f"the gradient is exactly 0 at step {step}: no parameter receives one, so nothing "
            f"trains (a model output cast to an integer dtype, jax.lax.stop_gradient, or a loss "
            f"that does not use the model's output)"
        )


def say_stopped(stopped_by: str | None, step: int, checkpointer: Checkpointer | None) -> None:
    """After a stop signal: which step was saved, and where."""
    if stopped_by and jax.process_index() == 0:
        where = f"saved step {step} to {checkpointer.directory}" if checkpointer else "not saved"
        output.note(f"stopped by {stopped_by} after step {step}; {where}")


def summary(run: Setup, instruments: Instruments, step: int, train_s: float) -> dict:
    """The run's summary: losses, last eval, throughput in the task's unit, where it wrote."""
    history, timer, start_step = instruments.history, instruments.timer, instruments.start_step
    return {
        "steps": step,
        "first_loss": history.losses[0] if history.losses else None,
        "final_loss": history.losses[-1] if history.losses else None,
        "logged_losses": len(history.losses),  # log steps this process ran (1: first = final)
        "eval_loss": history.eval_results.get("eval_loss"),  # None when no eval ran
        **history.eval_results,
        timer.throughput_key: timer.units_per_step
        * (step - start_step)
        / max(train_s - history.eval_s, 1e-9),
        "train_s": train_s,
        "eval_s": history.eval_s,
        "run_dir": str(run.run_dir),
        "resumed_from": start_step,
        "param_count": run.layout.param_count,
        "flops_param_count": run.layout.flops_param_count,
    }


def print_summary(summary: dict[str, Any], task: Task) -> None:
    """The sample, if any, then the one-line summary that closes every run."""
    if "sample" in summary:
        output.note(f"sample:\n{summary['sample']}\n", prefixed=False)
    eval_loss, first_loss = summary["eval_loss"], summary["first_loss"]
    eval_text = f", eval_loss {eval_loss:.4f}" if eval_loss is not None else ""
    for key, value in summary.items():
        if key.startswith("eval_") and key not in ("eval_loss", "eval_s"):
            eval_text += f", {key} {value:.4f}"
    eval_time = f" (eval {summary['eval_s']:.1f}s)" if summary["eval_s"] else ""
    if first_loss is None:
        loss_text = "no loss logged"
    elif summary.get("logged_losses") == 1:  # not "3.5851 -> 3.5851", as if nothing trained
        loss_text = f"loss {first_loss:.4f} (one log step: lower train.log_every for more)"
    else:
        loss_text = f"loss {first_loss:.4f} -> {summary['final_loss']:.4f}"
    steps, resumed_from = summary["steps"], summary["resumed_from"]
    # This process's steps, apart from those a resumed checkpoint had done already.
    ran = f" ({steps - resumed_from} this run, resumed from {resumed_from})" if resumed_from else ""
    output.note(
        f"done: {steps} steps{ran} in {summary['train_s']:.1f}s{eval_time}, "
        f"{loss_text}{eval_text}, "
        f"{summary[f'{task.unit}_per_s']:,.0f} {task.unit}/s, "
        f"compile {summary['compile_s']:.1f}s, run dir {summary['run_dir']}"
    )
