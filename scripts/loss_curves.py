"""The checked-in loss curves: four shipped runs, 50 steps each, on 8 simulated CPU devices.

    python scripts/loss_curves.py            # writes tests/assets/losses/<name>.json
    python scripts/loss_curves.py --check    # compares instead (what tests/end_to_end does)

A change that moves every configuration's losses together (a schedule off by one step, a
loss averaged over the wrong axis, an init drawn from another stream) passes every test that
compares a run with itself on another mesh; these curves catch it, as torchtitan's
tests/assets/losses do. Each curve is the default run, a decoder, a mixture of experts and a
CNN at their shipped settings, shrunk (fewer layers, shorter sequences, small batches) to
train in seconds, in fp32 with data and FSDP sharding over the 8 devices, a record each step.
A change that moves them on purpose regenerates them, and its commit shows the new curve.

`--spread` runs each twice and prints the largest relative difference between the runs:
the run-to-run spread the tolerance (TOLERANCE) is set from.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "assets" / "losses"
STEPS = 50
# Each step's loss within this relative difference of the recorded one. The spread between
# two runs on one machine is 0 (XLA's CPU programs are deterministic); the margin covers
# another CPU's vector units (other fused reductions) over 50 steps, and stays far below
# what a real change moves (a learning rate 10% off moves step 50 by more than 1e-2).
TOLERANCE = 2e-3
SHARED = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.sample_bytes=0",
    "precision.policy=fp32",
    "mesh.data=4",
    "mesh.fsdp=2",
    "checkpoint.enabled=false",
    "run.progress=false",
    "run.trackers=[]",
]
CURVES = {
    # the embedded default: a small GPT on the standard library's source, byte-level
    "default": (None, ["model.layers=1", "model.seq_len=64", "train.global_batch=16"]),
    "llama_tiny": ("llama_tiny", ["model.layers=1", "model.seq_len=32", "train.global_batch=16"]),
    "moe_tiny": ("moe_tiny", ["model.layers=1", "model.seq_len=32", "train.global_batch=16"]),
    "resnet_tiny": ("resnet_tiny", ["model.image_size=16", "train.global_batch=16"]),
}


def run_curve(name: str) -> dict:
    """The losses of curve `name` (a fresh run in a temporary run directory)."""
    import paisoar_jax

    config, overrides = CURVES[name]
    with tempfile.TemporaryDirectory() as run_dir:
        settings = [*SHARED, *overrides, f"run.dir={run_dir}"]
        paisoar_jax.fit(config, settings)
        records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    losses = [record["loss"] for record in records if "loss" in record]
    return {"config": config or "default", "overrides": [*SHARED, *overrides], "losses": losses}


def differences(recorded: list[float], measured: list[float]) -> list[tuple[int, float]]:
    """(step, relative difference) of each step whose loss left TOLERANCE."""
    return [
        (step, abs(new - old) / abs(old))
        for step, (old, new) in enumerate(zip(recorded, measured, strict=True), start=1)
        if abs(new - old) > TOLERANCE * abs(old)
    ]


def main() -> int:
    """Writes, checks or measures the spread of the curves named (default: all)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the recorded curves")
    parser.add_argument("--spread", action="store_true", help="run each twice, print the spread")
    parser.add_argument("names", nargs="*", default=list(CURVES))
    args = parser.parse_args()
    failed = False
    for name in args.names:
        curve = run_curve(name)
        path = ASSETS / f"{name}.json"
        if args.spread:
            again = run_curve(name)["losses"]
            spread = max(abs(a - b) / abs(a) for a, b in zip(curve["losses"], again, strict=True))
            print(f"{name}: largest relative difference between two runs {spread:.2e}")
        elif args.check:
            moved = differences(json.loads(path.read_text())["losses"], curve["losses"])
            failed |= bool(moved)
            print(f"{name}: {'moved at ' + str(moved[:3]) if moved else 'as recorded'}")
        else:
            ASSETS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(curve, indent=1) + "\n")
            first, last = curve["losses"][0], curve["losses"][-1]
            print(f"{name}: {len(curve['losses'])} steps, loss {first:.4f} -> {last:.4f}")
    return 1 if failed else 0


if __name__ == "__main__":  # (a test imports this file: the process is the test's then)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("PAISOAR_OUTPUT", "quiet")
    sys.path.insert(0, str(REPO))
    sys.exit(main())
