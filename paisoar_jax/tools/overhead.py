"""`python -m paisoar_jax.bench --overhead [overrides]`: what the loop costs beside a bare one.

The configured model at a negligible size (OVERHEAD_OVERRIDES: 1 layer, width 32, 2 heads,
seq_len 16, vocab 64, global batch 8, fp32, synthetic input, 600 steps, a log every 200)
runs twice in one process: through the library's loop (`loop.run`), and as a bare loop
of the same jitted step that puts a fresh host batch on the devices every step, as a
hand-written JAX loop does. Both are timed after their first interval (the library's
first log interval, the bare loop's first step), so compilation is out of both.

Where the library's extra time goes, in ms per step:
- `input_wait`, `dispatch`: measured inside the library's run (metrics.jsonl:
  data_wait_frac and host_frac of the step time);
- `input_produce`: one host batch through the configured input pipeline and onto the
  devices (grain read, shuffle, batch, the global array, the iterator state), timed on
  the pipeline alone; it runs on the prefetch thread, so it costs the loop only when it
  takes longer than a step or holds the interpreter lock the loop needs;
- `prefetch_handoff`, `batch_check`, `progress_bar`, `signal_check`, `metrics`: each
  piece of the loop's per-step Python timed alone over many calls (metrics: one record's
  device_get, assembly and write, divided by train.log_every).
"""

from __future__ import annotations

import queue
import time
from typing import Any

import jax
import numpy as np

from paisoar_jax.config import Config

OVERHEAD_OVERRIDES = [
    "model.layers=1",
    "model.width=32",
    "model.heads=2",
    "model.seq_len=16",
    "model.vocab_size=64",
    "train.global_batch=8",
    "precision.policy=fp32",
    "data.source=synthetic",
    "train.steps=600",
    "train.log_every=200",
]
CALLS = 2000  # calls per timed piece


def _per_call_ms(function, calls: int = CALLS) -> float:
    """Mean wall time of one call of `function`, in ms."""
    function()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e3


def bare_loop_ms(config: Config) -> float:
    """Milliseconds per step of the same jitted step fed a fresh host batch each step."""
    from paisoar_jax.engine.compilation import one_step_at_a_time
    from paisoar_jax.engine.state import init_state
    from paisoar_jax.parallel import sharding
    from paisoar_jax.run.setup import setup
    from paisoar_jax.tasks.zoo import zoo_workload

    run = setup(config, zoo_workload(config))
    shape = run.task.batch_shape(config.train.global_batch)
    where = sharding.batch_sharding(run.mesh)
    rng = np.random.default_rng(0)
    vocab = config.model.vocab_size
    with jax.set_mesh(run.mesh):
        state = init_state(config.train.seed, run.layout)
        step = run.jit_train_step()
        batch = lambda: jax.device_put(rng.integers(0, vocab, shape.shape, np.int32), where)
        state, metrics = step(state, batch())  # compiles
        jax.block_until_ready(metrics)
        one_at_a_time = one_step_at_a_time(run.layout, run.mesh)  # as the loop runs it
        start = time.perf_counter()
        for _ in range(config.train.steps):
            state, metrics = step(state, batch())
            if one_at_a_time:
                jax.block_until_ready(metrics)
        jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / config.train.steps * 1e3


def pieces_ms(config: Config) -> dict[str, float]:
    """Each per-step piece of the library's loop, timed alone (see the module docstring)."""
    from tqdm import tqdm

    from paisoar_jax.data.prefetch import global_batch
    from paisoar_jax.engine.compilation import signature
    from paisoar_jax.observe.metrics import MetricsWriter
    from paisoar_jax.parallel import sharding
    from paisoar_jax.run.loop import stop_agreed
    from paisoar_jax.runtime.preemption import StopRequest
    from paisoar_jax.tasks.zoo import zoo_workload

    task = zoo_workload(config).task
    source, _ = task.open_sources()
    host = iter(
        task.host_batches(
            source,
            global_batch=config.train.global_batch,
            seed=0,
            train=True,
            workers=config.data.workers,
        )
    )
    where = sharding.batch_sharding(sharding.build_mesh(config.mesh))

    def produce():
        batch = global_batch(where, next(host))
        host.get_state()
        return batch

    handoff: queue.Queue = queue.Queue(maxsize=2)
    batch = produce()
    bar = tqdm(total=10**9, disable=not config.run.progress, mininterval=1.0)
    stop = StopRequest()
    values = {"loss": np.float32(1.0), "grad_norm": np.float32(1.0), "lr": np.float32(1.0)}
    writer = MetricsWriter(config.run_dir / "overhead", tensorboard=config.run.tensorboard)

    def record():
        fetched = jax.device_get(values)
        writer.write({"step": 1, **{name: float(value) for name, value in fetched.items()}})

    try:
        return {
            "input_produce": _per_call_ms(produce, 200),
            "prefetch_handoff": _per_call_ms(lambda: (handoff.put(batch), handoff.get())),
            "batch_check": _per_call_ms(lambda: signature(batch)),
            "progress_bar": _per_call_ms(lambda: bar.update(1)),
            "signal_check": _per_call_ms(lambda: stop_agreed(stop, 7, False)),
            "metrics": _per_call_ms(record, 200) / config.train.log_every,
        }
    finally:
        bar.close()
        writer.close()
        getattr(host, "close", lambda: None)()


def overhead(config: Config, library: dict[str, Any]) -> dict[str, Any]:
    """The library's ms/step beside the bare loop's, their ratio and the pieces.

    `library`: bench_train's result for `config` (the CLI measures it first).
    """
    bare_ms = bare_loop_ms(config)
    step_ms = library["step_ms"]
    return {
        "mode": "overhead",
        "model": config.model.name,
        "steps": config.train.steps,
        "global_batch": config.train.global_batch,
        "devices": jax.device_count(),
        "library_ms": step_ms,
        "bare_ms": bare_ms,
        "ratio": step_ms / bare_ms,
        "input_wait_ms": library["data_wait_frac"] * step_ms,
        "dispatch_ms": library["host_frac"] * step_ms,
        **{f"{name}_ms": value for name, value in pieces_ms(config).items()},
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
    }
