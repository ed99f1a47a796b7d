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
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import jax
from flax import nnx

from paisoar_jax import output
from paisoar_jax.errors import UserError

# jax's words for a dot algorithm a platform's lowering refuses (jax/_src/lax/lax.py).
UNSUPPORTED_PRECISION = re.compile(r"precision '(\S+)' is not supported by dot_general on (\w+)")
LIBRARIES = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/paisoar_jax/")


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
        with readable_step_errors():
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
        with readable_step_errors():
            result = self._current(state, batch)
            return jax.block_until_ready(result) if self._one_at_a_time else result


def readable_errors_of(step: Callable) -> Callable:
    """`step` (a jitted function: the eval step) with `readable_step_errors` around each call."""

    def call(*args, **kwargs):
        with readable_step_errors():
            return step(*args, **kwargs)

    return call


@contextlib.contextmanager
def readable_step_errors() -> Iterator[None]:
    """An error out of a compiled step (its compile or a call), without jax's jaxpr.

    A dot precision the platform lacks is a UserError: one line naming the flax layer and
    the line of the user's code that called it, and what to set instead. Any other error
    is raised as it was, its traceback whole, less the implicit contexts jax attaches (its
    lowering cache's KeyError, whose text is the step's jaxpr: hundreds of lines).
    """
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        _drop_jaxpr_contexts(error)
        gap = UNSUPPORTED_PRECISION.search(str(error))
        if gap is None:
            raise
        precision, platform = gap.groups()
        raise UserError(
            f"{_traced_at(error)} asks dot_general for precision {precision}, which XLA on "
            f"{platform} lacks: set precision.policy=bf16 or fp32, or keep that layer in fp32 "
            f"(paisoar_jax.force_policy(layer, 'fp32') in the model factory)"
        ) from error


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _drop_jaxpr_contexts(error: BaseException) -> None:
    """Hides each 'During handling of the above exception' whose exception holds a jaxpr."""
    for link in _chain(error):
        if link.__context__ is not None and "{ lambda " in str(link.__context__):
            link.__suppress_context__ = True


def _traced_at(error: BaseException) -> str:
    """`MultiHeadAttention called at vit.py:19`: the layer and the user's line that traced it.

    From the traceback jax keeps of where the failing op was traced (the cause it chains,
    JaxStackTraceBeforeTransformation): the innermost frame outside the libraries, and the
    flax layer it called.
    """
    traced = next((e for e in _chain(error) if type(e).__name__.startswith("JaxStackTrace")), None)
    frames = list(_walk(traced.__traceback__)) if traced is not None else []
    ours = [i for i, (code, _) in enumerate(frames) if not _in_library(code.co_filename)]
    if not ours:
        return "a layer of the model"
    code, line = frames[ours[-1]]
    place = f"{code.co_filename.rsplit('/', 1)[-1]}:{line}"
    layer = _flax_layer(*frames[ours[-1] + 1]) if ours[-1] + 1 < len(frames) else None
    return f"{layer} called at {place}" if layer else f"the code at {place}"


def _in_library(filename: str) -> bool:
    return any(part in filename for part in LIBRARIES)


def _walk(tb) -> Iterator[tuple[Any, int]]:
    while tb is not None:
        yield tb.tb_frame.f_code, tb.tb_lineno
        tb = tb.tb_next


def _flax_layer(code, line: int) -> str | None:
    """The nnx layer whose __call__ holds `line` of `code`'s file (flax.nnx's own), if any."""
    for name in dir(nnx):
        layer = getattr(nnx, name)
        call_code = getattr(getattr(layer, "__call__", None), "__code__", None)  # noqa: B004
        if call_code is None or call_code.co_filename != code.co_filename:
            continue
        lines = [number for *_, number in call_code.co_lines() if number is not None]
        if lines and min(lines) <= line <= max(lines):
            return f"nnx.{name}"
    return None


def _key(batch_signature: dict[str, tuple]) -> tuple:
    """A signature as a hashable, order-independent key."""
    return tuple(sorted(batch_signature.items()))
