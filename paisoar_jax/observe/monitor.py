"""What the training loop measures and watches: step times, memory, health and traces.

The loop's instruments: the step-time breakdown, device memory, the health of the loss and
the loss scale, and profiler traces of chosen steps.

The step-time breakdown of each log interval (metrics.jsonl):

    step_time_s     wall time per step (saves and eval excluded)
    data_wait_frac  share of it the loop waited for the next batch
    host_frac       share of it the host spent dispatching steps: near 1 - data_wait_frac,
                    the host (Python, dispatch) sets the pace and the device idles
    device_step_s   wall time per step with the input waits taken out: the device's step
                    time when host_frac is small
    checkpoint_s    seconds the loop blocked on saves in the interval (not in step_time_s)

Device memory (`memory_in_use_bytes`, `memory_peak_bytes`, `memory_limit_bytes`) comes from
the first local device's memory_stats(), which GPUs have and the CPU backend does not (null).
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import numpy as np

from paisoar_jax import output
from paisoar_jax.config import PrecisionConfig
from paisoar_jax.errors import DivergenceError
from paisoar_jax.observe.metrics import mfu

FALLING_SCALE_LOGS = 3  # warn when the loss scale fell at this many log steps in a row
SKIPPED_IN_A_ROW = 20  # a static scale: stop after this many skipped steps in a row


class IntervalTimer:
    """Wall time, input wait and throughput between two log steps.

    Throughput is counted in the task's unit: tokens for language models, examples (images)
    for classifiers; `flops_per_unit` turns it into MFU.
    """

    def __init__(
        self,
        units_per_step: int,
        flops_per_unit: float,
        peak_tflops: float | None,
        unit: str = "tokens",
    ):
        self.units_per_step = units_per_step
        self.flops_per_unit = flops_per_unit
        self.peak_tflops = peak_tflops
        self.throughput_key = f"{unit}_per_s"
        self.restart(step=0)

    def restart(self, step: int) -> None:
        """Starts a new interval after `step` (also after eval, whose time is not step time)."""
        self.start_time, self.start_step = time.perf_counter(), step
        self.wait_s = self.save_s = self.dispatch_s = 0.0

    def timings(self, step: int) -> dict[str, Any]:
        """The step-time breakdown of the interval ending at `step` (see the module docstring)."""
        elapsed = time.perf_counter() - self.start_time
        steps = step - self.start_step
        step_time_s = elapsed / steps
        per_s = self.units_per_step / step_time_s
        return {
            "step_time_s": step_time_s,
            self.throughput_key: per_s,
            "mfu": mfu(per_s, self.flops_per_unit, self.peak_tflops),
            "data_wait_frac": self.wait_s / elapsed,
            "host_frac": self.dispatch_s / elapsed,
            "device_step_s": max(elapsed - self.wait_s, 0.0) / steps,
        }


def check_health(
    record: dict[str, Any], precision: PrecisionConfig, history: list, lower_lr: str
) -> None:
    """Stops on a non-finite loss (unscaled runs) or on steps the loss scale cannot rescue.

    With a loss scaler an occasional overflow only halves the scale (a warning when it keeps
    falling: `scale_keeps_falling`). The run stops when the scale is at its floor and steps
    still overflow (skipped since a log step that found it there), or when a static scale
    skipped SKIPPED_IN_A_ROW steps in a row: nothing trains then.
    `history`: (step, scale, skipped steps) of the earlier log steps, with a scaler first
    those the run started from (`run_records.start_history`); `lower_lr`: how this run's
    learning rate is lowered (optim.lr, or the user's own optimizer).
    """
    step, loss = record["step"], record["loss"]
    scale, skipped = record["loss_scale"], record["skipped_steps"]
    mode = precision.loss_scale_mode()[0]
    if mode == "none":  # history: the log steps with a finite loss
        if not np.isfinite(loss):
            last = f" (last finite at step {history[-1][0]})" if history else ""
            raise DivergenceError(f"the loss is {loss} at step {step}{last}: training diverged")
        history.append((step, scale, skipped))
        return
    # With a scaler, history: every log step (a skipped step has a nan loss).
    previous = history[-1] if history else None
    history.append((step, scale, skipped))
    if previous is not None and skipped > previous[2]:
        if mode == "dynamic" and max(scale, previous[1]) <= precision.min_scale:
            raise DivergenceError(
                f"steps overflow with the loss scale at its floor ({scale:g}, "
                f"precision.min_scale): the gradients are not finite at any scale; "
                f"{lower_lr}, or use precision.policy=bf16"
            )
        # A dynamic scale halves at each overflow, so its floor above ends it; a static one
        # would skip every step for ever.
        in_a_row = _skipped_in_a_row(history) if mode == "static" else 0
        if in_a_row >= SKIPPED_IN_A_ROW:
            raise DivergenceError(
                f"the last {in_a_row} steps (to step {step}) were all skipped: their gradients "
                f"overflow at loss scale {scale:g}; {lower_lr}, or use precision.policy=bf16"
            )
    if scale_keeps_falling(history) and jax.process_index() == 0:  # every process sees it
        first = history[-(FALLING_SCALE_LOGS + 1)]
        output.warning(
            f"the loss scale fell at each of the last {FALLING_SCALE_LOGS} log steps "
            f"({first[1]:g} at step {first[0]} -> {scale:g} at step "
            f"{step}): the gradients are diverging, not just overflowing; {lower_lr}"
        )


def scale_keeps_falling(points: list[tuple[int, float, int]]) -> bool:
    """Whether the loss scale fell at each of the last FALLING_SCALE_LOGS log steps, settled.

    `points`: (step, scale, skipped steps so far) of the log steps, the run's start first.
    A fresh run's scale comes down from precision.initial_scale, skipping a step in each
    interval, until it finds its level: those falls are no trend. It has settled once an
    interval passes with no step skipped, or when the run resumed (its start past step 0).
    The loop warns on it; the doctor reports it (tools/doctor/findings.py).
    """
    recent = points[-(FALLING_SCALE_LOGS + 1) :]
    falling = len(recent) == FALLING_SCALE_LOGS + 1 and all(
        later[1] < earlier[1] for earlier, later in zip(recent, recent[1:], strict=False)
    )
    settled = points[0][0] > 0 or any(
        later[2] == earlier[2] for earlier, later in zip(points, points[1:], strict=False)
    )
    return falling and settled


def _skipped_in_a_row(history: list) -> int:
    """Steps skipped in a row up to the last log step: the log intervals skipped whole."""
    in_a_row = 0
    for (earlier_step, _, earlier), (step, _, skipped) in zip(
        reversed(history[:-1]), reversed(history[1:]), strict=True
    ):
        if skipped - earlier != step - earlier_step:
            break
        in_a_row += step - earlier_step
    return in_a_row


def device_memory() -> dict[str, int | None]:
    """Bytes in use, peak and limit on the first local device (None where not reported)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "memory_in_use_bytes": stats.get("bytes_in_use"),
        "memory_peak_bytes": stats.get("peak_bytes_in_use"),
        "memory_limit_bytes": stats.get("bytes_limit"),
    }


class StepProfiler:
    """A jax.profiler trace of steps [start, end] into `directory` (process 0 only).

    `before(step)` starts the trace before the first step of the range this run reaches (a
    resumed run may start inside it); `after(step, outputs)` waits for step `end` to finish
    on the device, then stops it, so the trace holds whole steps.
    """

    def __init__(self, steps: tuple[int, ...], directory: pathlib.Path):
        self.start, self.end = steps if steps else (0, -1)
        self.directory = directory
        self.active = self.done = False
        self.first = self.start

    def before(self, step: int) -> None:
        """Starts tracing when `step` is the first step of the range this run runs."""
        in_range = self.start <= step <= self.end
        if in_range and not (self.active or self.done) and jax.process_index() == 0:
            jax.profiler.start_trace(str(self.directory))
            self.active, self.first = True, step

    def after(self, step: int, outputs: Any) -> None:
        """Stops tracing once `step`, the last profiled step, has run on the device."""
        if self.active and step >= self.end:
            jax.block_until_ready(outputs)
            self._stop(step)

    def close(self, step: int) -> None:
        """Stops a trace still running (a run stopped by a signal inside the range)."""
        if self.active:
            self._stop(step)

    def _stop(self, step: int) -> None:
        """Stops the trace and says where it went."""
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        output.note(
            f"profiled steps {self.first}-{step} into {self.directory} "
            f"(tensorboard --logdir {self.directory}, or the .trace.json.gz in Perfetto)",
            stderr=True,
        )
