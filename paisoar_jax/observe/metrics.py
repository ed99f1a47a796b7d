"""Run metrics: metrics.jsonl, the trackers beside it and the MFU arithmetic.

Only process 0 writes; trackers/ holds TensorBoard, Weights & Biases and MLflow. Each
metrics.jsonl line is one JSON object with at least step, loss, lr, grad_norm, loss_scale,
skipped_steps, step_time_s, tokens_per_s, mfu (null where the device's peak is unknown) and
data_wait_frac.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax

from paisoar_jax import output
from paisoar_jax.config import RunConfig
from paisoar_jax.observe import trackers

# Dense bf16 peak TFLOP/s per device, by jax device_kind prefix (datasheet figures).
PEAK_TFLOPS = {
    "NVIDIA H200": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA A100": 312.0,
    "NVIDIA L4": 121.0,
}


# Every field a metrics.jsonl record may hold, with its meaning: the reference the docs
# site prints (docs/hooks.py), checked against real runs' records
# (tests/observe/test_metrics.py). <name> stands for a part of the field's name.
RECORD_FIELDS = {
    "step": "the step this record is of (log steps, eval steps and the last step)",
    "loss": "the step's mean training loss (fp32)",
    "<metric>": "each metric the task's loss returns beside it (accuracy, ...)",
    "lr": "the learning rate of the step (null when a user's optimizer hides it)",
    "grad_norm": "the global norm of the gradients, unscaled",
    "loss_scale": "the dynamic loss scale (1 without loss scaling)",
    "skipped_steps": "steps skipped for non-finite gradients so far (cumulative)",
    "skipped_spikes": "train.skip_spikes: steps skipped for a loss spike so far (cumulative)",
    "step_time_s": "mean seconds per step since the last record",
    "tokens_per_s": "tokens trained per second (language models)",
    "examples_per_s": "examples (images) trained per second (other tasks)",
    "mfu": "model FLOPs utilisation (null when the FLOPs or the device's peak are unknown)",
    "data_wait_frac": "the share of the step time spent waiting for input",
    "host_frac": "the share the host spent dispatching steps",
    "device_step_s": "the step time with the input waits taken out",
    "checkpoint_s": "seconds the loop blocked on saves since the last record",
    "memory_in_use_bytes": "device memory in use now (null on CPU)",
    "memory_peak_bytes": "the peak device memory so far (null on CPU)",
    "memory_limit_bytes": "the device memory the allocator may use (null on CPU)",
    "recompiles": "how many times the train step compiled again after the first",
    "compile_s": "first record: seconds the train step took to compile",
    "param_count": "first record: the model's parameters",
    "platform": "first record: cpu or gpu",
    "first_step_loss": "first record: the loss of the first step, before any update",
    "process_count": "first record: the processes of the run",
    "device_count": "first record: the devices of the run",
    "host_cores": "first record: the cores this process could use",
    "global_batch": "first record: examples per optimizer step",
    "global_batch_changed": "first record of a resume with another batch: [saved, now]",
    "lr_source": "first record: config (optim.*) or optimizer (fit's own)",
    "before_update": "true on the record of a loss not finite at the first step",
    "bad_batch": "true on the record of a loss a batch made non-finite from sane weights",
    "examples": "on a bad_batch record: the indices in the data of that batch's examples",
    "eval_loss": "the default eval set's mean loss over its rows",
    "eval_<metric>": "each of its metrics (eval_perplexity for a language model)",
    "eval_<name>_<metric>": "the named eval set <name>'s loss and metrics",
    "<metric>/<source>": "an eval of a data mixture: each source's metrics",
    "examples/<source>": "a data mixture: examples read from each source so far",
    "moe_<statistic>": "a mixture of experts: router statistics (load, drops, losses)",
    "moe_layer_<statistic>/<layer>": "a mixture of experts: one layer's router statistics",
}


def device_peak_tflops(configured: float = 0.0) -> float | None:
    """The per-device peak for MFU: the configured value, else the table's, else None."""
    if configured > 0:
        return configured
    kind = jax.devices()[0].device_kind
    return next((peak for prefix, peak in PEAK_TFLOPS.items() if kind.startswith(prefix)), None)


def mfu(
    tokens_per_s: float, flops_per_token: float | None, peak_tflops: float | None
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    if not peak_tflops or flops_per_token is None:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * jax.device_count())


class MetricsWriter:
    """Appends metric records to run_dir/metrics.jsonl and the trackers (process 0 only).

    `reporting`: the run's `run` section, whose run.trackers receive every record, with
    `record` (the resolved config as sections) as the config they keep; without it,
    TensorBoard alone when `tensorboard`. `optimizer`: an optimizer given to fit, as the
    trackers record it (optim.describe_given).
    """

    def __init__(
        self,
        run_dir: pathlib.Path,
        tensorboard: bool = True,
        resume_step: int = 0,
        reporting: RunConfig | None = None,
        record: dict[str, Any] | None = None,
        optimizer: dict[str, Any] | None = None,
    ):
        self.enabled = jax.process_index() == 0
        self._file = None
        self._trackers = []
        self._logged_through = 0  # the trackers already hold the steps up to this one
        self.run_dir = run_dir
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        # A resumed run continues the file as if uninterrupted: records past the restored
        # step (logged after the last checkpoint) are dropped, earlier ones kept.
        if resume_step and path.exists():
            lines = [
                line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")
            ]
            steps = [json.loads(line)["step"] for line in lines]
            kept = [line for line, step in zip(lines, steps, strict=True) if step <= resume_step]
            self._logged_through = max(steps, default=0)
            # Replaced in one rename: a kill right now leaves the old file or the new one.
            temporary = path.with_suffix(".jsonl.tmp")
            temporary.write_text("".join(kept))
            os.replace(temporary, path)
        elif path.exists():
            path.unlink()  # a fresh run (no checkpoint to continue) starts a fresh file
        if reporting is not None:
            self._trackers = trackers.open_trackers(
                reporting, record or {}, run_dir, resume_step, optimizer
            )
        elif tensorboard:
            self._trackers = [trackers.TensorBoard(None, run_dir)]
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        """Writes one record (it must hold `step`); its numeric fields go to the trackers."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in list(self._trackers):
            if record["step"] <= self._logged_through and not tracker.replays:
                continue  # logged by the interrupted run, to the same values
            try:
                tracker.log(record)
            except Exception as error:  # a tracker's server gone mid-run: training goes on
                output.warning(
                    f"{type(tracker).__name__} stopped taking metrics at step "
                    f"{record['step']} ({type(error).__name__}: {str(error)[:200]}); "
                    f"metrics.jsonl keeps them all"
                )
                self._trackers.remove(tracker)

    def reopen(self) -> None:
        """Opens metrics.jsonl and TensorBoard's events again: their directory was made anew.

        (The files open before belong to the deleted directory: writes there are lost.)
        """
        if not self.enabled:
            return
        from paisoar_jax.observe.trackers.tensorboard import TensorBoard

        self._file.close()
        self._file = (self.run_dir / "metrics.jsonl").open("a")
        for index, tracker in enumerate(self._trackers):
            if isinstance(tracker, TensorBoard):
                tracker.close()
                self._trackers[index] = TensorBoard(None, self.run_dir)

    def close(self) -> None:
        """Flushes and closes the file and the trackers."""
        if self._file is not None:
            self._file.close()
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as error:  # as in write: the run's own files are what count
                output.warning(f"{type(tracker).__name__} did not close: {str(error)[:200]}")
