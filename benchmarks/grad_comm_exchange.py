"""The gradient exchange alone, fp32 vs bf16 vs int8, on real processes (grad_comm.py).

    python -m paisoar_jax.launch --nproc 2 --devices-per-proc 1 -- \
        python benchmarks/grad_comm_exchange.py [--values 100000000] [--repeats 5]

Each process holds one data shard's gradient of `--values` fp32 values (ZeRO-0: every
process ends with the mean). fp32 is XLA's own all-reduce of the shards (what a step runs
with mesh.grad_comm=fp32); bf16 and int8 are grad_comm.exchange_gradients. Process 0 prints
one row per setting: the median wall time, the bytes each device sends per exchange (ring
costs, from the compiled HLO), the error against the fp32 mean, and plan's projection of
the same bytes on 10 GbE and InfiniBand (tools/plan/core.py LINKS).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import paisoar_jax
from paisoar_jax.config import load_config
from paisoar_jax.parallel import grad_comm, sharding
from paisoar_jax.tools.plan import LINKS, hlo


def exchange_function(setting: str, values: int):
    """(mesh, jitted exchange of a [processes, values] per-shard gradient)."""
    processes = jax.process_count()
    config = load_config(None, [f"mesh.grad_comm={setting}", f"mesh.dcn_data={processes}"])
    mesh = sharding.build_mesh(config.mesh)
    whole = NamedSharding(mesh, PartitionSpec())
    params = {"w": jax.ShapeDtypeStruct((values,), jnp.float32)}
    exchange = grad_comm.plan(config.mesh, mesh, params, {"w": whole}, {"w": whole})
    if exchange is None:  # fp32: the all-reduce XLA emits for a data-parallel gradient

        def mean(shards):
            return jnp.mean(shards, axis=0)
    else:

        def mean(shards):
            stats = jnp.zeros((shards.shape[0], 1), jnp.float32)  # no loss to carry here
            return grad_comm.exchange_gradients({"w": shards}, stats, {}, 1.0, exchange, mesh)[0][
                "w"
            ]

    return mesh, jax.jit(mean, out_shardings=whole)


def main() -> None:
    """Times each setting's exchange; process 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    paisoar_jax.initialize()
    rng = np.random.default_rng(jax.process_index())
    local = (rng.standard_normal((1, args.values)) * 1e-3).astype(np.float32)
    rows, reference = [], None
    for setting in ("fp32", "bf16", "int8"):
        mesh, mean = exchange_function(setting, args.values)
        shards = jax.make_array_from_process_local_data(
            NamedSharding(mesh, PartitionSpec("data")), local
        )
        compiled = mean.lower(shards).compile()
        found = hlo.collectives(compiled.as_text(), mesh.size)
        wire = sum(op.count * op.bytes * hlo.ring_factor(op.kind, op.group_size) for op in found)
        result = compiled(shards).block_until_ready()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled(shards).block_until_ready()
            times.append(time.perf_counter() - start)
        got = np.asarray(result.addressable_data(0))
        reference = got if reference is None else reference
        error = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
        dtypes = ",".join(sorted({f"{op.kind} {op.dtype}" for op in found}))
        rows.append((setting, statistics.median(times), wire, error, dtypes))
    if jax.process_index() == 0:
        print(
            f"{args.values:,} values, {jax.process_count()} processes, {jax.devices()[0].platform}"
        )
        print(
            "| grad_comm | wall, loopback | bytes sent per device | relative error "
            "| 10 GbE (plan) | InfiniBand (plan) | collectives |"
        )
        print("|---|---|---|---|---|---|---|")
        for setting, seconds, wire, error, dtypes in rows:
            ten, infiniband = (wire / (LINKS[name] * 1e9) for name in ("10gbe", "infiniband"))
            print(
                f"| {setting} | {seconds * 1e3:.0f} ms | {wire / 1e6:.1f} MB | {error:.1e} "
                f"| {ten * 1e3:.0f} ms | {infiniband * 1e3:.1f} ms | {dtypes} |"
            )


if __name__ == "__main__":
    main()
