"""Where each parameter lives on the mesh: a config rule, its logical axis names, or the default.

The zoo annotates every parameter with logical axis names and the table in sharding.py maps
them to mesh axes. A model of one's own may have no annotations at all, so each parameter
takes, in this order (ShardingConfig says the same in the config):

1. the first `sharding.rules` entry whose regex is found in its dotted path
   (`blocks.0.mlp.kernel`): one axis entry per dimension, each a mesh axis (data, stage,
   fsdp, expert, context, tensor), a logical name of the table (embed, mlp, heads, vocab,
   ...), a list of mesh axes, or null (whole);
2. its own logical axis names (flax `nnx.with_partitioning`), through the table;
3. the default: whole on every device, except that under FSDP or ZeRO-3 a parameter of at
   least `sharding.min_split_size` elements is split on its largest dimension that the
   shard count divides (what FSDP and DeepSpeed do with small parameters: keep them whole).

ZeRO widens `fsdp` the way it widens `embed`: over (data, fsdp) for params under ZeRO-3 and
for optimizer state under ZeRO >= 1. A rule that matches no parameter, names an unknown axis
or splits a dimension unevenly is refused before any work: a silent fall-back to replication
is how a large model runs out of memory.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paisoar_jax import output
from paisoar_jax.config import ShardingConfig
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding


def dotted_path(path) -> str:
    """A pytree path as the dotted name rules match against: `blocks.0.mlp.kernel`."""
    return ".".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def parameter_shardings(
    abstract_params: Any,
    logical_specs: Any,
    mesh: Mesh,
    settings: ShardingConfig,
    zero: int,
) -> tuple[Any, Any]:
    """(param shardings, optimizer-state shardings), each a tree like `abstract_params`."""
    patterns = [re.compile(pattern) for pattern, _ in settings.rules]
    used = [False] * len(patterns)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    specs = jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    tables = [_with_mesh_axes(sharding.parameter_rules(zero, state)) for state in (False, True)]
    # The default splits params and optimizer state on the same dimension (no reshard
    # between them): the one the larger shard count, the optimizer state's, divides.
    param_fsdp, state_fsdp = (table["fsdp"] for table in tables)
    shards = max(_split(param_fsdp, mesh)[1], _split(state_fsdp, mesh)[1])
    for_params, for_state, whole = [], [], []
    for (path, value), logical in zip(leaves, specs, strict=True):
        name = dotted_path(path)
        index = next((i for i, pattern in enumerate(patterns) if pattern.search(name)), None)
        defaulted = index is None and not any(axis is not None for axis in logical)
        dim = _default_dim(value.shape, mesh, (state_fsdp, param_fsdp)) if defaulted else None
        if defaulted and dim is None and math.prod(value.shape) >= settings.min_split_size:
            whole.append((name, value))
        pair = []
        for table in tables:
            if index is not None:
                pattern, entries = settings.rules[index]
                spec = _rule_spec(entries, table, value.shape, mesh, name, pattern)
            elif any(axis is not None for axis in logical):
                unknown = [axis for axis in logical if axis is not None and axis not in table]
                if unknown:
                    raise UserError(
                        f"parameter {name}: logical axis {unknown[0]!r} has no sharding rule "
                        f"(known: {', '.join(sorted(table))})"
                    )
                pair.append(sharding.logical_to_sharding(logical, value.shape, mesh, table, name))
                continue
            else:
                axes = (table["fsdp"], param_fsdp)  # the state falls back to the params' split
                spec = _default_spec(value.shape, mesh, axes, settings.min_split_size, dim)
            pair.append(NamedSharding(mesh, spec))
        if index is not None:
            used[index] = True
        for_params.append(pair[0])
        for_state.append(pair[1])
    if whole and shards > 1:
        _warn_left_whole(whole, shards, abstract_params)
    for (pattern, _), was_used in zip(settings.rules, used, strict=True):
        if not was_used:
            names = ", ".join(dotted_path(path) for path, _ in leaves[:6])
            raise UserError(
                f"sharding.rules: {pattern!r} matches no parameter (they are named like "
                f"{names}{', ...' if len(leaves) > 6 else ''})"
            )
    return treedef.unflatten(for_params), treedef.unflatten(for_state)


def _warn_left_whole(whole: list, shards: int, abstract_params: Any) -> None:
    """One warning naming the parameters FSDP/ZeRO leaves whole (no dimension divides)."""
    if jax.process_index() != 0:
        return
    size = lambda value: math.prod(value.shape) * value.dtype.itemsize
    total = sum(size(value) for value in jax.tree.leaves(abstract_params))
    whole = sorted(whole, key=lambda item: -size(item[1]))
    named = ", ".join(f"{name} {tuple(value.shape)}" for name, value in whole[:4])
    output.warning(
        f"FSDP/ZeRO over {shards} devices leaves {len(whole)} parameter(s) whole, as no "
        f"dimension divides by {shards}: {named}{', ...' if len(whole) > 4 else ''} "
        f"({sum(size(value) for _, value in whole) / total:.0%} of the parameter bytes); "
        f"give them a sharding.rules entry, or sizes {shards} divides"
    )


def _with_mesh_axes(table: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The logical table, plus the mesh axes by their own names (`fsdp` widened as `embed`)."""
    return {**table, **{axis: (axis,) for axis in sharding.MESH_AXES}, "fsdp": table["embed"]}


def _rule_spec(entries, table, shape, mesh: Mesh, name: str, pattern: str) -> PartitionSpec:
    """The PartitionSpec a rule gives one parameter, checked against its shape and the mesh."""
    where = f"sharding.rules: {pattern!r} on {name} (shape {tuple(shape)})"
    if len(entries) > len(shape):
        raise UserError(f"{where}: {len(entries)} axis entries for {len(shape)} dimensions")
    spec, seen = [], set()
    for dim, entry in enumerate(entries):
        axes = tuple(axis for axis in _mesh_axes(entry, table, where) if mesh.shape[axis] > 1)
        if seen & set(axes):
            raise UserError(f"{where}: mesh axis {sorted(seen & set(axes))[0]} is used twice")
        seen |= set(axes)
        ways = math.prod(mesh.shape[axis] for axis in axes)
        if shape[dim] % ways:
            split = " x ".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
            raise UserError(
                f"{where}: dimension {dim} (size {shape[dim]}) is not divisible by mesh {split}"
            )
        spec.append(axes or None)
    return PartitionSpec(*spec)


def _mesh_axes(entry, table: dict[str, tuple[str, ...]], where: str) -> tuple[str, ...]:
    """The mesh axes of one rule entry: `fsdp` and logical names go through the table."""
    if entry is None:
        return ()
    if isinstance(entry, str) and entry in table:  # fsdp takes data too where ZeRO splits
        return table[entry]
    if isinstance(entry, tuple) and all(axis in sharding.MESH_AXES for axis in entry):
        expanded = [mesh_axis for axis in entry for mesh_axis in table[axis]]
        return tuple(dict.fromkeys(expanded))  # in order, each once
    known = ", ".join(sorted(table))
    raise UserError(f"{where}: unknown axis {entry!r} (known: {known}, null)")


def _split(axes, mesh: Mesh) -> tuple[tuple[str, ...], int]:
    """The axes that split anything (size > 1) and how many ways they split."""
    axes = tuple(axis for axis in axes if mesh.shape[axis] > 1)
    return axes, math.prod(mesh.shape[axis] for axis in axes)


def _default_dim(shape, mesh: Mesh, candidates) -> int | None:
    """The largest dimension the first of the candidate axis sets that can divides."""
    by_size = sorted(range(len(shape)), key=lambda dim: -shape[dim])
    for axes in candidates:
        ways = _split(axes, mesh)[1]
        dim = next((dim for dim in by_size if ways > 1 and shape[dim] % ways == 0), None)
        if dim is not None:
            return dim
    return None


def _default_spec(shape, mesh: Mesh, candidates, min_split_size: int, dim) -> PartitionSpec:
    """Whole, or split on `dim` over the first candidate axis set that divides it."""
    if dim is None or math.prod(shape) < min_split_size:
        return PartitionSpec()
    for axes in candidates:
        axes, ways = _split(axes, mesh)
        if ways > 1 and shape[dim] % ways == 0:
            return PartitionSpec(*(axes if index == dim else None for index in range(len(shape))))
    return PartitionSpec()


def describe(abstract_params: Any, shardings: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(path, shape, mesh axes per dimension) of every parameter, for plan's table."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = []
    for (path, value), where in zip(leaves, placed, strict=True):
        spec = tuple(where.spec) + (None,) * (len(value.shape) - len(where.spec))
        text = ", ".join(
            "+".join(axes) if isinstance(axes, tuple) else axes or "-" for axes in spec
        )
        rows.append((dotted_path(path), tuple(value.shape), f"[{text}]"))
    return rows
