"""Every shipped config compiled for 8 x H200 and 8 x H100 without a GPU: one JSON line each.

    python benchmarks/gpu_target_plans.py [h200 h100] [CONFIG ...]   # the gpu-aot extra

Each config as it ships (its own mesh, batch and precision), compiled by XLA's GPU
compiler for the target (`plan --target`, tools/plan/gpu_target.py). Per config: memory per
device and whether it fits, the estimated step time and MFU (a roofline of the compiled
kernels: compiled, not run), the compile time and the kernels (attention, gemm operand
types, fp32 gemms, async collectives overlapped).
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin loads without a driver so

from paisoar_jax.config import load_config  # noqa: E402
from paisoar_jax.tools import plan
from paisoar_jax.tools.plan import gpu_target  # noqa: E402

CONFIGS = sorted(pathlib.Path(__file__).parents[1].joinpath("configs").glob("*.yaml"))

if __name__ == "__main__":
    targets = [name for name in sys.argv[1:] if name in gpu_target.DEVICES] or ["h200", "h100"]
    only = [name for name in sys.argv[1:] if name not in gpu_target.DEVICES]
    for target in targets:
        devices = gpu_target.target_devices(target, 1, 8)
        for path in CONFIGS:
            if only and path.stem not in only:
                continue
            result = plan.plan(load_config(path, []), devices, target=target)
            found, estimate = result["target"], result["target"]["estimate"]
            collectives = found["collectives"]
            print(
                json.dumps(
                    {
                        "target": target,
                        "config": path.stem,
                        "mesh": result["mesh"],
                        "precision": result["precision"],
                        "global_batch": result["global_batch"],
                        "memory_gib": round(result["memory_bytes"]["total"] / 2**30, 2),
                        "fits": found["fits"],
                        "estimated_step_ms": round(estimate["step_s"] * 1e3, 3),
                        "estimated_mfu": estimate["mfu"] and round(estimate["mfu"], 3),
                        "compile_s": result["compile_s"],
                        "attention": found["attention"],
                        "gemms": {
                            f"{row['backend']} {row['operands']}": row["count"]
                            for row in found["matmuls"]
                        },
                        "fp32_gemms": len(found["fp32_matmuls"]),
                        "async_collectives": len(collectives),
                        "overlapped": sum(row["overlapped"] for row in collectives),
                    }
                ),
                flush=True,
            )
