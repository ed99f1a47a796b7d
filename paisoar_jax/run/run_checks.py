"""What a loop of one's own hands `Prepared` back, checked: a state and a batch of this run.

jit would take a state of another run (another model, mesh or optimizer) or a batch of
another shape and either compile a new program in silence or fail deep in XLA with a
traceback. `check_state` and `check_batch` compare them with the run's own layout and batch
shape first and name the first difference in one line (a UserError).
"""

from __future__ import annotations

from typing import Any

import jax

from paisoar_jax.engine.state import StateLayout
from paisoar_jax.errors import UserError

PARTS = ("params", "opt_state", "model_state")  # the parts of a state, named in the line


def check_state(state: Any, layout: StateLayout) -> None:
    """Refuses a state whose tree, shapes, dtypes or shardings are not this run's."""
    expected = layout.abstract_state
    if type(state) is not type(expected):
        raise UserError(
            f"the state is a {type(state).__name__}, not this run's train state: pass "
            f"prepared.state or what train_step returned"
        )
    for part in PARTS:
        given_leaves, given_tree = jax.tree.flatten_with_path(getattr(state, part))
        expected_leaves, expected_tree = jax.tree.flatten_with_path(getattr(expected, part))
        if given_tree != expected_tree:
            raise UserError(
                f"the state's {part} are not this run's ({len(given_leaves)} arrays where the "
                f"run has {len(expected_leaves)}): a state of another model, optimizer or "
                f"LoRA setting; pass prepared.state or what train_step returned"
            )
        for (path, given), (_, wanted) in zip(given_leaves, expected_leaves, strict=True):
            difference = _difference(given, wanted)
            if difference:
                raise UserError(
                    f"the state's {part}{jax.tree_util.keystr(path)} {difference}: a state "
                    f"of another run; pass prepared.state or what train_step returned"
                )


def _difference(given: Any, wanted: Any) -> str | None:
    """How array `given` differs from the run's `wanted` (shape, dtype, sharding), or None."""
    shape, dtype = getattr(given, "shape", None), getattr(given, "dtype", None)
    if shape != wanted.shape:
        return f"has shape {shape}, where this run's has {wanted.shape}"
    if dtype != wanted.dtype:
        return f"is {dtype}, where this run's is {wanted.dtype}"
    sharding, wanted_sharding = getattr(given, "sharding", None), wanted.sharding
    if sharding is not None and not sharding.is_equivalent_to(wanted_sharding, len(shape)):
        return (
            f"is sharded as {_spec(sharding)} over mesh {_mesh(sharding)}, where this run "
            f"shards it as {_spec(wanted_sharding)} over mesh {_mesh(wanted_sharding)}"
        )
    return None


def _spec(sharding: Any) -> str:
    return str(getattr(sharding, "spec", sharding))


def _mesh(sharding: Any) -> str:
    mesh = getattr(sharding, "mesh", None)
    return str(dict(mesh.shape)) if mesh is not None else "?"


def check_batch(batch: Any, expected: Any) -> None:
    """Refuses a batch whose structure, shapes or dtypes are not this run's global batch."""
    given_leaves, given_tree = jax.tree.flatten_with_path(batch)
    wanted_leaves, wanted_tree = jax.tree.flatten_with_path(expected)
    if given_tree != wanted_tree:
        raise UserError(
            f"the batch is not shaped as this run's ({jax.tree.structure(batch)}, where the "
            f"run's batches are {wanted_tree}): pass the batches of prepared.batches()"
        )
    for (path, given), (_, wanted) in zip(given_leaves, wanted_leaves, strict=True):
        shape, dtype = getattr(given, "shape", None), getattr(given, "dtype", None)
        if shape != wanted.shape or dtype != wanted.dtype:
            where = f"batch{jax.tree_util.keystr(path)}"
            raise UserError(
                f"{where} is {dtype}{list(shape) if shape is not None else ''}, where this "
                f"run's global batch holds {wanted.dtype}{list(wanted.shape)} "
                f"(train.global_batch rows): pass the batches of prepared.batches()"
            )
