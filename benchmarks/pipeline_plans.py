"""Plan's projections for pipeline stages against data parallelism and FSDP, on CPU.

    XLA_FLAGS=--xla_force_host_platform_device_count=16 python benchmarks/pipeline_plans.py

For gpt_1b and llama3_8b, compiles one train step per mesh on simulated devices
(`paisoar_jax.tools.plan.plan`, nothing is run) and prints one JSON line per mesh: per-device
memory, the bubble, the stage-to-stage bytes, and the projected step time. 8 devices: one
host, every collective over NVLink. 16 devices: two hosts of 8; the collectives over the
axis that spans the hosts (the 16-wide data or fsdp axis, or the stage axis of a
2-stage mesh: its collective-permutes and its 2-device all-reduces) run over InfiniBand,
the rest over NVLink. Compute is the model's FLOPs at 50% of 989 TFLOP/s, stretched by the
bubble; no overlap of communication with compute is assumed.
"""

import json
import sys

import jax

from paisoar_jax.config import load_config
from paisoar_jax.tools.plan import LINKS, hlo, plan

CIRCULAR = "train.pipeline_repeats=2"
BATCHES = {"gpt_1b": ["train.global_batch=64"], "llama3_8b": ["train.global_batch=32"]}
MESHES = {
    "gpt_1b": [
        (8, ["mesh.data=8", "mesh.zero=1"]),
        (8, ["mesh.data=1", "mesh.fsdp=8"]),
        (8, ["mesh.data=4", "mesh.stage=2", "train.pipeline_microbatches=8"]),
        (8, ["mesh.data=2", "mesh.stage=4", "train.pipeline_microbatches=16"]),
        (8, ["mesh.data=2", "mesh.stage=4", "train.pipeline_microbatches=16", CIRCULAR]),
        (16, ["mesh.data=16", "mesh.zero=1"]),
        (16, ["mesh.data=1", "mesh.fsdp=16"]),
        (16, ["mesh.data=8", "mesh.stage=2", "train.pipeline_microbatches=8"]),
    ],
    "llama3_8b": [
        (8, ["mesh.data=1", "mesh.fsdp=8"]),
        (8, ["mesh.data=1", "mesh.fsdp=4", "mesh.stage=2", "train.pipeline_microbatches=8"]),
        (8, ["mesh.data=1", "mesh.fsdp=2", "mesh.stage=4", "train.pipeline_microbatches=16"]),
        (16, ["mesh.data=1", "mesh.fsdp=16"]),
        (16, ["mesh.data=1", "mesh.fsdp=8", "mesh.stage=2", "train.pipeline_microbatches=4"]),
    ],
}


def crosses_hosts(op: dict, devices: int, pipelined: bool) -> bool:
    """Whether a collective runs over the axis that spans the two hosts."""
    if devices == 8:
        return False
    if pipelined:
        return op["kind"] == "collective-permute" or op["group_size"] == 2
    return op["group_size"] == devices


def seconds(op: dict, gb_per_s: float) -> float:
    """The op's time per step on a link, by NCCL's ring costs (plan's model)."""
    ring = hlo.ring_factor(op["kind"], op["group_size"])
    return op["bytes"] * op["count"] * ring / (gb_per_s * 1e9)


def projection(name: str, devices: int, mesh: list[str]) -> dict:
    """One mesh's plan, reduced to the figures of the table in RESULTS.md."""
    config = load_config(name, [*BATCHES[name], *mesh])
    result = plan(config, jax.devices()[:devices], simulated=True)
    pipeline = result["pipeline"] or {}
    communication = sum(
        seconds(
            op,
            LINKS["infiniband"] if crosses_hosts(op, devices, bool(pipeline)) else LINKS["nvlink"],
        )
        for op in result["collective_ops"]
    )
    busy = result["flops_per_device"] / (result["peak_tflops"] * 1e12 * result["efficiency"])
    compute = result["time_s"]["compute"]  # busy / (1 - bubble)
    memory = result["memory_bytes"]
    return {
        "model": name,
        "devices": devices,
        "mesh": " ".join(setting.split(".", 1)[1] for setting in mesh),
        "global_batch": config.train.global_batch,
        "params_gib": round(memory["params"] / 2**30, 2),
        "optimizer_gib": round(memory["optimizer_state"] / 2**30, 2),
        "total_gib": round(memory["total"] / 2**30, 2),
        "bubble": round(pipeline.get("bubble", 0.0), 3),
        "p2p_mib": round(pipeline.get("p2p_bytes", 0) / 2**20, 1),
        "collective_mib": {
            kind: round(totals["bytes"] / 2**20, 1)
            for kind, totals in result["collectives"].items()
        },
        "compute_ms": round(compute * 1e3, 2),
        "communication_ms": round(communication * 1e3, 2),
        "step_ms": round((compute + communication) * 1e3, 2),
        "scaling_efficiency": round(busy / (compute + communication), 3),
    }


def main() -> None:
    """One JSON line per mesh of the models named on the command line (default: both)."""
    names = sys.argv[1:] or list(MESHES)
    for name in names:
        for devices, mesh in MESHES[name]:
            print(json.dumps(projection(name, devices, mesh)), flush=True)


if __name__ == "__main__":
    main()
