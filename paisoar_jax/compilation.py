"""The train step compiled ahead of time, once per input signature, with recompiles reported.

`jax.jit` silently compiles again whenever an argument's shape or dtype changes: a batch
that comes out shorter, a label array that turns int64. Each costs a full compile (minutes
for a big model) and on a GPU usually a stall the metrics only show as a slow step. Here the
step is lowered and compiled explicitly (`jit(...).lower(...).compile()`) for the first
batch's signature; a batch with another signature is compiled for too, but with a warning
that names the input that changed and how, and the count goes into metrics.jsonl
(`recompiles`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax

from paisoar_jax import output


def signature(tree: Any) -> dict[str, tuple]:
    """{path: (shape, dtype)} of every array in `tree` (a batch: an array or a dict)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path) or "batch": (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in leaves
    }


def describe_change(before: dict[str, tuple], after: dict[str, tuple]) -> str:
    """What differs between two signatures, as `batch['image'] shape (16, 8) -> (8, 8)`."""
    changes = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            changes.append(f"{name} is gone")
        elif name not in before:
            changes.append(f"{name} is new {after[name][0]} {after[name][1]}")
        else:
            (old_shape, old_dtype), (new_shape, new_dtype) = before[name], after[name]
            if old_shape != new_shape:
                changes.append(f"{name} shape {old_shape} -> {new_shape}")
            if old_dtype != new_dtype:
                changes.append(f"{name} dtype {old_dtype} -> {new_dtype}")
    return "; ".join(changes)


def one_step_at_a_time(layout: Any, mesh: Any) -> bool:
    """Whether the train step must finish before the next is dispatched (CompiledStep)."""
    return layout.exchange is not None and mesh.devices.flat[0].platform == "cpu"


class CompiledStep:
    """Calls a jitted `step(state, batch)` through executables compiled per batch signature.

    `one_at_a_time`: each call waits for its step to finish before returning. XLA CPU (the
    simulated devices of tests and CPU runs) can deadlock when one device starts the next
    step's all-to-all while another is still finishing the current step: each device's
    collective holds a thread of one shared pool until every device joins it. The loop
    asks for it where the compressed gradient exchange (grad_comm.py) runs on CPU.

    `untimed()`: the context a later compile (a new batch signature) runs in; the loop
    gives the hang watchdog's pause, so a compile is never taken for a hang.
    """

    def __init__(
        self,
        jitted: Any,
        state: Any,
        batch: Any,
        one_at_a_time: bool = False,
        untimed: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ):
        self._jitted = jitted
        self._untimed = untimed  # where a later compile runs: the hang watchdog's pause
        self._one_at_a_time = one_at_a_time
        self._first = signature(batch)
        self._compiled: dict[tuple, Any] = {}
        start = time.perf_counter()
        self._current = self._compile(state, batch)
        self.compile_s = time.perf_counter() - start
        self._current_key = _key(self._first)
        self.recompiles = 0

    def _compile(self, state: Any, batch: Any) -> Any:
        compiled = self._jitted.lower(state, batch).compile()
        self._compiled[_key(signature(batch))] = compiled
        return compiled

    @property
    def compiled(self) -> Any:
        """The executable of the first batch's signature (its memory analysis, its HLO)."""
        return self._compiled[_key(self._first)]

    def __call__(self, state: Any, batch: Any) -> Any:
        """The step on `batch`, compiled for its signature if that is new (with a warning)."""
        batch_signature = signature(batch)
        key = _key(batch_signature)
        if key != self._current_key:
            if key not in self._compiled:
                self.recompiles += 1
                if jax.process_index() == 0:
                    output.warning(
                        f"the train step is compiling again because the batch changed: "
                        f"{describe_change(self._first, batch_signature)}; "
                        f"every new shape costs a compile (keep batch shapes fixed)"
                    )
                with self._untimed():
                    self._compile(state, batch)
            self._current, self._current_key = self._compiled[key], key
        result = self._current(state, batch)
        return jax.block_until_ready(result) if self._one_at_a_time else result


def _key(batch_signature: dict[str, tuple]) -> tuple:
    """A signature as a hashable, order-independent key."""
    return tuple(sorted(batch_signature.items()))
