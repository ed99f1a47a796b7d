"""Our step beside the hand-written plain-JAX GPT step, both compiled for a GPU, without one.

    python benchmarks/peer_side_by_side.py [--target h200] [--rows gpt2_124m,gpt_1b,...]

The peer is ../shared/peers/gpt_jax.py (--peer): a GPT in plain JAX, whose GPT-2 step ran at
34.95 ms on a real H200, where this roofline says 38.80 (ours: 34.22 and 35.98 ms;
benchmarks/RESULTS.md, 2026-12-04): the ratios compare two estimates made alike. The peer
runs its training loop when imported, so its source is run only up to its first line of
work (`p = init(`): that gives its model, optimizer and jitted step, which are then lowered
for the target's devices. Each row builds the peer at our config's shape (L, D, H, V, T, and
the batch one device holds) and prints, for both: the compiled temporaries, the device memory
in all, the bytes the non-gemm kernels move and the predicted step (gpu_target's roofline,
as `plan --target` gives it), per token, and ours over the peer's.

Temporaries are compared like for like: the peer is compiled a second time with its params and
optimizer state donated, as ours are. As written, its step cannot write its new state over
the old, so it holds that state twice, and XLA puts activations in the second copy's space
until the update writes it: its temporaries then look smaller than they are (gpt_1b: 26.5
GiB as written, 37.2 donated). The device memory in all (arguments, outputs not donated,
temporaries, code; memory.step_total) is what a run needs, the peer's donated too;
the last line of a row gives the peer's two figures as written.

Needs the CUDA plugin (the gpu-aot extra, or pip install "jax[cuda12]"); it sets
JAX_PLATFORMS=cpu itself, as a target compile must.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from paisoar_jax.config import load_config  # noqa: E402
from paisoar_jax.engine.memory import step_total  # noqa: E402
from paisoar_jax.tools.plan import (  # noqa: E402
    DEFAULT_EFFICIENCY,
    gpu_target,  # noqa: E402
    plan,
)

PEER = Path(__file__).resolve().parents[2] / "shared" / "peers" / "gpt_jax.py"
ROWS = {  # name: (config, devices, overrides)
    "gpt2_124m": ("gpt2_124m", 1, []),
    "gpt_1b": ("gpt_1b", 1, []),
    "llama3_1b": ("llama3_1b", 1, []),
    "llama3_8b": ("llama3_8b", 8, ["mesh.data=1", "mesh.fsdp=8"]),
}


FIGURES = (  # (key, label) of each figure a row compares
    ("temporaries_bytes", "temporaries"),
    ("total_bytes", "memory in all"),
    ("non_gemm_bytes", "non-gemm bytes"),
    ("step_s", "predicted step"),
)


def peer_step(source: Path, shape: dict[str, int]):
    """(jitted step, its abstract arguments, parameter count) of the peer at `shape`.

    The step is the peer's own jit; `jax.jit(step.__wrapped__, ...)` rebuilds it with other
    options (peer_figures donates params and optimizer state so).
    """
    text = source.read_text()
    definitions = text[: text.index("\np = init(")]  # everything before its training loop
    saved = {key: os.environ.get(key) for key in shape}
    os.environ.update({key: str(value) for key, value in shape.items()})
    saved_argv, sys.argv = sys.argv, [str(source), "cudnn"]  # its attention: cuDNN's
    try:
        namespace: dict = {"__name__": "peer"}
        exec(compile(definitions, str(source), "exec"), namespace)  # noqa: S102
    finally:
        sys.argv = saved_argv
        for key, value in saved.items():  # the environment as it was
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    params = jax.eval_shape(namespace["init"], jax.random.PRNGKey(0))
    opt_state = jax.eval_shape(namespace["opt"].init, params)
    tokens = jax.ShapeDtypeStruct((shape["B"], shape["T"]), jnp.int32)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    return namespace["step"], (params, opt_state, tokens, tokens), count


def peer_figures(source: Path, shape: dict[str, int], target: str) -> dict[str, float]:
    """The peer's step compiled for one `target` GPU: temporaries, non-gemm bytes, estimate.

    "temporaries_bytes" and "total_bytes" are those of the step with params and optimizer
    state donated (the module's docstring says why); "written_temporaries_bytes" and
    "written_total_bytes" those of the step as written, whose kernels the estimate prices.
    """
    step, arguments, count = peer_step(source, shape)
    device = gpu_target.target_devices(target, 1, 1)[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    arguments = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed), arguments
    )
    compiled = step.lower(*arguments).compile()
    donated = jax.jit(step.__wrapped__, donate_argnums=(0, 1)).lower(*arguments).compile()
    L, D, T, B = (shape[key] for key in "LDTB")
    tokens = B * T
    flops = (6 * count + 12 * L * D * T) * tokens
    estimate = gpu_target.estimate(
        compiled, target, flops, 12 * L * D * T * tokens, 0.0, DEFAULT_EFFICIENCY
    )
    return {
        "temporaries_bytes": donated.memory_analysis().temp_size_in_bytes,
        "total_bytes": step_total(donated.memory_analysis()),
        "written_temporaries_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "written_total_bytes": step_total(compiled.memory_analysis()),
        "non_gemm_bytes": estimate["memory_bound_s"] * gpu_target.DEVICES[target].memory_bandwidth,
        "step_s": estimate["step_s"],
        "tokens": tokens,
    }


def our_figures(
    config_name: str, devices: int, overrides: list[str], target: str
) -> tuple[dict, Any]:
    """(our config's step compiled for `devices` `target` GPUs, per device; the config)."""
    config = load_config(config_name, overrides)
    found = plan(config, gpu_target.target_devices(target, 1, devices), target=target)
    estimate = found["target"]["estimate"]
    return {
        "temporaries_bytes": found["memory_bytes"]["temporaries"],
        "total_bytes": found["memory_bytes"]["total"],
        "non_gemm_bytes": estimate["memory_bound_s"] * gpu_target.DEVICES[target].memory_bandwidth,
        "step_s": estimate["step_s"],
        "tokens": config.train.global_batch * config.model.seq_len // devices,
    }, config


def row(name: str, target: str, source: Path) -> dict:
    """One row: ours and the peer's figures per token, and ours over the peer's."""
    config_name, devices, overrides = ROWS[name]
    ours, config = our_figures(config_name, devices, overrides, target)
    model = config.model
    shape = {
        "L": model.layers,
        "D": model.width,
        "H": model.heads,
        "V": model.vocab_size,
        "T": model.seq_len,
        "B": ours["tokens"] // model.seq_len,  # the rows one device holds
    }
    peer = peer_figures(source, shape, target)
    result = {"row": name, "target": target, "devices": devices, "peer_shape": shape}
    for key, _ in FIGURES:
        mine, theirs = ours[key] / ours["tokens"], peer[key] / peer["tokens"]
        result[key] = {"ours_per_token": mine, "peer_per_token": theirs, "ratio": mine / theirs}
    result["ours"] = ours
    result["peer"] = peer
    return result


def main() -> None:
    """Print each row (a JSON line, then the ratios and the peer's memory as written)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h200", choices=sorted(gpu_target.DEVICES))
    rows = ", ".join(ROWS)
    parser.add_argument("--rows", default="gpt2_124m,gpt_1b,llama3_1b", help=f"of {rows}")
    parser.add_argument("--peer", type=Path, default=PEER)
    arguments = parser.parse_args()
    for name in arguments.rows.split(","):
        found = row(name, arguments.target, arguments.peer)
        print(json.dumps(found))
        for key, label in FIGURES:
            figures = found[key]
            print(
                f"  {name:10s} {label:15s} ours {figures['ours_per_token']:.4g}/token  "
                f"peer {figures['peer_per_token']:.4g}/token  ratio {figures['ratio']:.3f}"
            )
        peer = found["peer"]
        temporaries, total = peer["written_temporaries_bytes"], peer["written_total_bytes"]
        print(
            f"  {name:10s} (the peer as written, not donated: temporaries "
            f"{temporaries / 2**30:.2f} GiB, memory in all {total / 2**30:.2f} GiB)"
        )


if __name__ == "__main__":
    main()
