"""Draws a run's loss curve and step-time breakdown from its metrics.jsonl, as a PNG.

    python docs/plot_run.py RUN_DIR OUTPUT.png

The first-run tutorial's picture is this script's drawing of a real run of `python -m
paisoar_jax.train` (docs/images/first-run.png). The breakdown splits each log interval's
step time into the input wait (data_wait_frac), the host's dispatch (host_frac) and the
rest, the devices' step; eval losses are marked where they were measured.
"""

from __future__ import annotations

import json
import pathlib
import sys


def plot(run_dir: pathlib.Path, output: pathlib.Path) -> None:
    """Writes the two panels of `run_dir`'s metrics.jsonl to `output`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
    figure, (loss_axes, time_axes) = pyplot.subplots(1, 2, figsize=(10, 3.6))
    loss_axes.plot(steps, [record["loss"] for record in records], label="train loss")
    evals = [(record["step"], record["eval_loss"]) for record in records if "eval_loss" in record]
    if evals:
        loss_axes.plot(*zip(*evals, strict=True), "o", label="eval loss")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("loss")
    loss_axes.legend()
    timed = records[1:] or records  # the first interval holds the warm-up
    step_ms = [record["step_time_s"] * 1e3 for record in timed]
    wait = [ms * record["data_wait_frac"] for ms, record in zip(step_ms, timed, strict=True)]
    host = [ms * record["host_frac"] for ms, record in zip(step_ms, timed, strict=True)]
    device = [max(ms - a - b, 0.0) for ms, a, b in zip(step_ms, wait, host, strict=True)]
    x = [record["step"] for record in timed]
    time_axes.stackplot(x, device, host, wait, labels=["devices", "host dispatch", "input wait"])
    time_axes.set_xlabel("step")
    time_axes.set_ylabel("ms per step")
    time_axes.legend(loc="upper right", fontsize="small")
    figure.suptitle(f"{run_dir.name}: {records[-1]['step']} steps")
    figure.tight_layout()
    figure.savefig(output, dpi=90)
    pyplot.close(figure)


if __name__ == "__main__":
    plot(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
