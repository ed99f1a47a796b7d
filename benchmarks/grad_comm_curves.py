"""Eval-loss curves of the default model with each mesh.grad_comm setting (grad_comm.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/grad_comm_curves.py \
        [--steps 200] [--every 25] [--run-root runs/grad_comm_curves] [extra overrides ...]

Trains the embedded default (a 0.8M-param GPT, byte-level) on a data=8 mesh four times,
fp32, bf16, int8 with error feedback and int8 without, from the same seed on the same
batches, and prints a markdown table of the eval loss every `--every` steps and each
setting's final eval loss against fp32's.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from paisoar_jax.config import load_config
from paisoar_jax.run.loop import run

# The table's column -> (run directory name, overrides)
SETTINGS = {
    "fp32": ("fp32", []),
    "bf16": ("bf16", ["mesh.grad_comm=bf16"]),
    "int8 + error feedback": (
        "int8_error_feedback",
        ["mesh.grad_comm=int8", "mesh.grad_comm_error_feedback=true"],
    ),
    "int8, no error feedback": ("int8", ["mesh.grad_comm=int8"]),
}


def eval_curve(run_dir: pathlib.Path) -> dict[int, float]:
    """{step: eval loss} from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["eval_loss"] for record in records if "eval_loss" in record}


def main() -> None:
    """Trains each setting and prints the curves."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument(
        "--run-root", type=pathlib.Path, default=pathlib.Path("runs/grad_comm_curves")
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    curves = {}
    for name, (directory, settings) in SETTINGS.items():
        run_dir = args.run_root / directory
        overrides = ["mesh.data=8", f"train.steps={args.steps}", f"train.eval_every={args.every}"]
        overrides += ["train.sample_bytes=0", "run.progress=false", "run.tensorboard=false"]
        overrides += ["checkpoint.every=0", f"run.dir={run_dir}", *settings, *args.overrides]
        run(load_config(None, overrides))
        curves[name] = eval_curve(run_dir)
    steps = sorted(curves["fp32"])
    print("| step | " + " | ".join(curves) + " |")
    print("|---" * (len(curves) + 1) + "|")
    for step in steps:
        print(f"| {step} | " + " | ".join(f"{curve[step]:.4f}" for curve in curves.values()) + " |")
    final = curves["fp32"][steps[-1]]
    print(
        "| vs fp32 at the end | "
        + " | ".join(f"{(curve[steps[-1]] / final - 1):+.2%}" for curve in curves.values())
        + " |"
    )


if __name__ == "__main__":
    main()
