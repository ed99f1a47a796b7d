"""Plan's projection of each mesh.grad_comm setting on each link, on simulated CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=16 python benchmarks/grad_comm_plans.py \
        --config gpt_1b train.global_batch=64 mesh.data=16 [mesh.zero=1]

Compiles the train step with mesh.grad_comm fp32, bf16 and int8 (tools/plan/core.py
compare_grad_comm: nothing runs) and prints a markdown table: per link of plan.LINKS the
projected step time without overlap and the scaling efficiency, every collective timed on
that one link (a ring over hosts runs at its slowest link), compute at 50% of 989 TFLOP/s.
"""

from __future__ import annotations

import argparse

import jax

from paisoar_jax.config import load_config
from paisoar_jax.engine.memory import format_bytes
from paisoar_jax.tools.plan import DEFAULT_EFFICIENCY, LINKS
from paisoar_jax.tools.plan.variants import compare_grad_comm


def main() -> None:
    """Prints the table for the config and overrides given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    comparison = compare_grad_comm(config, jax.devices(), DEFAULT_EFFICIENCY, simulated=True)
    settings = list(comparison)
    print(f"{args.config} {' '.join(args.overrides)} on {len(jax.devices())} devices")
    print("| link | " + " | ".join(settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for link in LINKS:
        cells = []
        for setting in settings:
            times = comparison[setting]["links"][link]
            step = times["time_s"]["step_no_overlap"]
            cells.append(f"{step * 1e3:.4g} ms ({times['scaling_efficiency']['no_overlap']:.0%})")
        print(f"| {link} | " + " | ".join(cells) + " |")
    wire = [format_bytes(comparison[setting]["wire_bytes"]) for setting in settings]
    print("| bytes sent per device | " + " | ".join(wire) + " |")


if __name__ == "__main__":
    main()
