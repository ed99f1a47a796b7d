"""What a saved item holds, read from its metadata: its tree of arrays, and whether it fits.

A checkpoint step's `state` and an export's `params` are Orbax items; their metadata gives
every array's name and shape without reading the arrays, so a resume or a load onto another
model is refused in one line naming the first parameter that differs.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from paisoar_jax.checkpointing.orbax_errors import describe_damage, quiet_orbax_leftovers
from paisoar_jax.errors import UserError


def _leaf_names(tree: Any) -> dict[str, tuple[int, ...]]:
    """Dotted leaf names (as Orbax names them, `opt_state.0.mu.w`) -> shapes."""
    names = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for key in path:
            part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
            parts.append(str(part))
        names[".".join(parts)] = tuple(leaf.shape)
    return names


def tree_metadata(item: pathlib.Path) -> Any:
    """The tree of array metadata of a saved item (a step's state, an export's params).

    Read by the handler: a Checkpointer would also look for step metadata, which a step's
    item directory does not hold, and log a warning a user cannot act on.
    """
    quiet_orbax_leftovers()
    try:
        return _saved_tree(ocp.PyTreeCheckpointHandler().metadata(item))
    except Exception as error:
        raise UserError(
            f"{item} cannot be read ({describe_damage(error)}): its metadata is damaged "
            f"(truncated, empty or not an Orbax checkpoint)"
        ) from None


def _saved_tree(metadata: Any) -> Any:
    """The tree of array metadata inside whatever wrapper this Orbax version returns."""
    metadata = getattr(metadata, "item_metadata", metadata)
    return getattr(metadata, "tree", metadata)


def check_compatible(saved_tree: Any, target: Any, directory: pathlib.Path) -> None:
    """One line naming the first parameter whose saved shape differs from the model's."""
    saved = {
        name: shape
        for name, shape in _leaf_names(saved_tree).items()
        if shape is not None  # empty optimizer states are stored as None
        # per-device exchange state (see _comm_target); the weights' average, kept or not
        and not name.startswith(("comm.", "ema."))
    }
    wanted = {
        name: shape
        for name, shape in _leaf_names(target).items()
        if not name.startswith(("comm.", "ema."))
    }
    for name, shape in wanted.items():
        if name not in saved:
            raise UserError(
                f"checkpoint {directory} does not fit this model: it has no {name} "
                f"(shape {shape}); was it written by another model or optimizer?"
            )
        if saved[name] != shape:
            raise UserError(
                f"checkpoint {directory} does not fit this model: {name} has shape "
                f"{saved[name]} there and {shape} here"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise UserError(
            f"checkpoint {directory} does not fit this model: it has {extra[0]} "
            f"(shape {saved[extra[0]]}) that this model lacks"
        )
