"""Orbax checkpoints: async and atomic saves, exact resume, restore onto any mesh.

Each checkpoint is one step directory under `checkpoint.dir` with three items:

    state/   the TrainState (step, params, optimizer state with its counts and the
             loss-scale state), written by every process for its own shards
    data/    the input iterator's position, one JSON file per process (grain's handler)
    meta/    step, mesh, process count, library version, the resolved config and the
             global sampler's position (`data_position`: the same for every process, so
             it restores on any process count)

Orbax writes a step into a temporary directory and renames it only once every item is
committed, so a save killed half-way leaves no step that `all_steps()` lists; the next
manager removes the leftover. Restoring takes an abstract target whose leaves carry the
*current* shardings: each process reads just its shards, whatever mesh wrote them.
"""

from __future__ import annotations

import json
import logging
import pathlib
import uuid
from dataclasses import dataclass, fields
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from paisoar_jax import output
from paisoar_jax.checkpointing.orbax_errors import (
    SAVE_THREAD_ERRORS,
    describe_damage,
    describe_failure,
    quiet_orbax_leftovers,
)
from paisoar_jax.checkpointing.saved_trees import _leaf_names, _saved_tree, check_compatible
from paisoar_jax.config import CheckpointConfig
from paisoar_jax.errors import UserError


class IteratorState:
    """The input iterator's position as JSON bytes, in the form grain's handler saves.

    grain's Orbax handler calls `get_state()` on save and `set_state()` then
    `start_prefetch()` on restore; this holder carries the state of the last batch the
    step consumed (the prefetcher's own iterator is already a few batches ahead).
    """

    def __init__(self, state: bytes | None = None):
        self.state = state

    def get_state(self) -> bytes:
        """The saved position (grain calls this on save)."""
        return self.state

    def set_state(self, state: bytes) -> None:
        """Takes the restored position (grain calls this on restore)."""
        self.state = state

    def start_prefetch(self) -> None:
        """Nothing to start: the pipeline is built after the restore."""


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back: the state, the data position (or None) and the meta."""

    step: int
    state: Any
    data_state: dict | None  # None: no position saved, or a per-process one that changed
    meta: dict[str, Any]
    input_changes: str = ""  # what changed of a per-process position's signature


def checkpoint_directory(settings: CheckpointConfig, run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's checkpoints live: `checkpoint.dir`, else <run dir>/checkpoints."""
    return pathlib.Path(settings.dir) if settings.dir else run_dir / "checkpoints"


def check_writable(directory: pathlib.Path) -> None:
    """Fails before training when `directory` cannot hold checkpoints (not after an hour)."""
    probe = directory / f".write-probe-{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as error:
        raise UserError(
            f"checkpoint directory {directory} is not writable ({error.strerror or error})"
        ) from None


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key array (an nnx.Rngs stream kept in a model, e.g. by nnx.Dropout)."""
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def storable(tree: Any) -> Any:
    """`tree` with typed PRNG keys as their raw uint32 data, which Orbax and checksums take."""
    return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if _is_key(leaf) else leaf, tree)


def storable_target(target: Any) -> Any:
    """The abstract `target` of a restore as it is stored: keys as uint32, same shardings."""

    def one(leaf):
        if not _is_key(leaf):
            return leaf
        raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return jax.ShapeDtypeStruct(raw.shape, raw.dtype, sharding=leaf.sharding)

    return jax.tree.map(one, target)


def live(restored: Any, target: Any) -> Any:
    """Restored raw key data wrapped back into the typed keys `target` asks for."""

    def one(value, leaf):
        if not _is_key(leaf):
            return value
        return jax.random.wrap_key_data(value, impl=getattr(leaf.dtype, "_impl", None))

    return jax.tree.map(one, restored, target)


@jax.jit
def _checksums(tree: Any) -> jax.Array:
    """A uint32 wrap-around sum of each array's bits: exact whatever the sharding."""

    def checksum(leaf: jax.Array) -> jax.Array:
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(leaf, bits)  # 8-byte types: 2 words per value
        return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)

    leaves = jax.tree.leaves(tree)
    return jnp.stack([checksum(leaf) for leaf in leaves]) if leaves else jnp.zeros(0, jnp.uint32)


def leaf_checksums(tree: Any) -> dict[str, int]:
    """{dotted leaf name: its checksum} of a tree of arrays (keys as Orbax stores them)."""
    tree = storable(tree)
    values = [int(value) for value in jax.device_get(_checksums(tree))]
    return dict(zip(_leaf_names(tree), values, strict=True))


def _verify(state: Any, saved: list[int] | None, step_dir: pathlib.Path) -> None:
    """Raises (as an unreadable checkpoint) when restored arrays differ from what was saved."""
    if saved is None:  # written before checksums existed
        return
    names = list(_leaf_names(state))
    restored = [int(value) for value in jax.device_get(_checksums(state))]
    for name, want, got in zip(names, saved, restored, strict=True):
        if want != got:
            raise ValueError(f"{step_dir}: {name} does not match its checksum (corrupted data)")


def _comm_target(saved_tree: Any, target: Any) -> Any:
    """What to restore TrainState.comm onto: the target's, or None where it starts afresh.

    The error-feedback residual (grad_comm.py) is one row per device of the mesh it was
    written on; on another mesh, or where one run has it and the other not, it cannot be
    carried over and the new run starts from a zero residual.
    """
    saved = saved_tree.get("comm", {}) if isinstance(saved_tree, dict) else {}
    shapes = {name: shape for name, shape in _leaf_names(saved).items() if shape is not None}
    if shapes == _leaf_names(target.comm):
        return target.comm
    return None


def _restorable_as_saved(saved_comm: Any, target: Any) -> Any:
    """Abstract arrays of the saved comm state as written (replicated), to be dropped."""
    everywhere = jax.sharding.NamedSharding(target.step.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=everywhere),
        saved_comm,
        is_leaf=lambda leaf: hasattr(leaf, "shape"),
    )


def _zeros(abstract: Any) -> Any:
    """Zero arrays of `abstract`'s shapes, dtypes and shardings."""
    return jax.tree.map(
        lambda leaf: jax.jit(
            lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.sharding
        )(),
        abstract,
    )


def warn(message: str) -> None:
    """A warning line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        output.warning(message)


class Checkpointer:
    """Saves and restores train state, data position and metadata with one CheckpointManager."""

    def __init__(
        self,
        directory: pathlib.Path,
        keep: int,
        keep_period: int = 0,
        async_save: bool = True,
    ):
        self.directory = directory.absolute()
        check_writable(self.directory)
        logging.getLogger("absl").addFilter(SAVE_THREAD_ERRORS)  # (once: a filter is a set)
        quiet_orbax_leftovers()  # a damaged step is skipped in one line (restore_latest)
        self.options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_period or None,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # what a killed save left behind
        )
        self.manager = self._open_manager()

    def _open_manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=self.options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def reopen(self) -> None:
        """A new manager over the directory, made anew after it vanished or a save failed.

        The old manager's save in flight is dropped (the caller saves the step reached).
        """
        try:
            self.manager.close()
        except Exception:  # that save's failure is why we are here
            pass
        check_writable(self.directory)
        self.manager = self._open_manager()

    def steps(self) -> list[int]:
        """The complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        data_state: dict | None,
        meta: dict[str, Any],
        input_signature: dict[str, Any] | None = None,
    ) -> None:
        """Starts an async save of `step` (a save already in flight is waited for first).

        `input_signature` (process count, workers, batch...) says what a per-process data
        position belongs to: a resume whose signature differs cannot continue it. The global
        sampler's position (`"sampler": "global"` or a mixture's) goes into the meta and needs no
        signature.
        """
        state = storable(state)
        data_bytes = json.dumps(data_state).encode()
        if isinstance(data_state, dict) and data_state.get("sampler") in ("global", "mixture"):
            meta = {**meta, "data_position": data_state}
        signature = {"process_count": jax.process_count(), **(input_signature or {})}
        # One checksum per array, computed where the shards live: restore recomputes them,
        # so a flipped byte on disk is caught instead of training on garbage.
        checksums = [int(value) for value in jax.device_get(_checksums(state))]
        # Named too: a reader of the weights alone (load, generate, export) checks its part.
        names = list(_leaf_names(state))
        meta = {**meta, "input_signature": signature, "checksums": checksums}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(IteratorState(data_bytes)),
                meta=ocp.args.JsonSave({**meta, "checksum_names": names}),
            ),
            force=True,
        )

    def meta(self, step: int) -> dict[str, Any]:
        """What `step` was saved with (its config, mesh, version), without its arrays."""
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def restore(
        self, step: int, target: Any, input_signature: dict[str, Any] | None = None
    ) -> Restored:
        """Restores `step` onto `target`'s shapes and shardings (abstract arrays).

        The global sampler's position always comes back (the caller checks the dataset);
        a per-process one only when `input_signature` (and the process count) match the
        saved one; otherwise the input starts afresh, with a warning.
        """
        step_dir = self.directory / str(step)
        typed_target, target = target, storable_target(target)
        meta = self.meta(step)
        saved_tree = _saved_tree(self.manager.item_metadata(step)["state"])
        if not saved_tree:  # its metadata file is gone: unreadable, not another model's
            raise FileNotFoundError(f"{step_dir}/state has no array metadata (_METADATA)")
        try:
            check_compatible(saved_tree, target, step_dir)
        except UserError as error:  # most often: another model's run in the same directory
            raise UserError(
                f"{error}. If that is another run's, give this one its own directory "
                f"(run.name=... or run.dir=...); checkpoint.resume=never refuses a directory "
                f"that holds checkpoints instead of resuming from them"
            ) from None
        # Written before the state had model_state (0.1 checkpoints of models without
        # BatchNorm) or comm (before grad_comm): restore the fields it has, the missing ones
        # are empty here anyway.
        comm_target = _comm_target(saved_tree, target)
        # ema: a run that turned train.ema_decay on starts the average from these weights.
        missing = [
            name
            for name in ("model_state", "comm", "ema")
            if isinstance(saved_tree, dict)
            and name not in saved_tree
            and (name != "model_state" or not jax.tree.leaves(target.model_state))
        ]
        older = bool(missing)
        if comm_target is None and "comm" not in missing:  # restored as written, then dropped
            target = target.replace(comm=_restorable_as_saved(saved_tree["comm"], target))
        wants_ema = bool(target.ema)
        has_ema = isinstance(saved_tree, dict) and bool(jax.tree.leaves(saved_tree.get("ema", {})))
        if has_ema and not wants_ema:  # an average this run does not keep: restored, dropped
            target = target.replace(ema={"params": target.params})
        elif wants_ema and not has_ema:  # none saved: restored as the empty one written
            target = target.replace(ema={})
        names = [field.name for field in fields(target) if field.name not in missing]
        state_target = {name: getattr(target, name) for name in names} if older else target
        items = {"state": ocp.args.StandardRestore(state_target)}
        holder = IteratorState()
        changed = _input_changes(meta, input_signature)
        if "data_position" not in meta and not changed:
            items["data"] = grain.checkpoint.CheckpointRestore(holder)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        state = restored["state"]
        if older:
            # (a missing comm is empty as saved; a residual this run needs comes below)
            empty = {
                name: {} if name in ("comm", "ema") else getattr(target, name) for name in missing
            }
            state = target.replace(**state, **empty)
        _verify(state, meta.get("checksums"), step_dir)
        state = _with_ema(state, wants_ema, has_ema)
        if comm_target is None:
            warn(
                "the gradient exchange's error-feedback residual of the checkpoint does not fit "
                "this mesh and mesh.grad_comm settings: it starts from zero"
            )
            state = state.replace(comm=_zeros(typed_target.comm))
        data_state = json.loads(holder.state) if holder.state is not None else None
        data_state = meta.get("data_position", data_state)
        input_changes = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items())
        return Restored(step, live(state, typed_target), data_state, meta, input_changes)

    def restore_latest(
        self, target: Any, input_signature: dict[str, Any] | None = None
    ) -> Restored | None:
        """The newest checkpoint that restores; a broken one is skipped with a warning.

        Broken steps newer than the one restored are moved to <dir>-broken/ (kept for a
        look, out of the way of the steps this run will write again).
        """
        steps, broken = self.steps(), []
        for position, step in enumerate(reversed(steps)):
            try:
                restored = self.restore(step, target, input_signature)
            except UserError:
                raise
            except Exception as error:  # any read failure means this step is unusable
                older = steps[-position - 2] if position + 1 < len(steps) else None
                fallback = f"falling back to step {older}" if older else "no older one left"
                warn(
                    f"checkpoint step {step} in {self.directory} is unreadable "
                    f"({describe_damage(error)}); {fallback}"
                )
                broken.append(step)
                continue
            self._move_aside(broken, "broken")
            return restored
        if steps:
            raise UserError(f"no readable checkpoint in {self.directory} (steps {steps})")
        return None

    def set_aside_after(self, step: int) -> None:
        """Moves the steps after `step` to <dir>-superseded/ (resuming from an older step).

        The run will write those step numbers again; the old ones are kept, not deleted.
        """
        newer = [later for later in self.steps() if later > step]
        aside = self._move_aside(newer, "superseded")
        if newer:
            warn(f"resuming from step {step}: moved the newer steps {newer} to {aside}")

    def _move_aside(self, steps: list[int], kind: str) -> pathlib.Path:
        """Moves step directories to <dir>-<kind>/ (never deletes them)."""
        aside = self.directory.parent / f"{self.directory.name}-{kind}"
        if not steps:
            return aside
        if jax.process_index() == 0:
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / str(step)
                suffix = 1
                while target.exists():
                    target, suffix = aside / f"{step}.{suffix}", suffix + 1
                (self.directory / str(step)).rename(target)
        multihost_utils.sync_global_devices(f"paisoar_jax.move_aside.{kind}")
        self.manager.reload()
        return aside

    def wait(self) -> None:
        """Blocks until the save in flight is committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases the manager.

        Called on every way out of a run: a save that failed there was already reported
        (the loop waits for its last save and handles a failure), so it is not raised again
        over the error that is ending the run.
        """
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        except Exception as error:
            warn(f"the checkpoint save in flight did not complete ({describe_failure(error)})")


def _input_changes(meta: dict, input_signature: dict[str, Any] | None) -> dict[str, tuple]:
    """{key: (saved, now)} of what a per-process input's position depends on, changed since.

    Empty when the meta holds the global sampler's position: the per-process item is then
    not read.
    """
    if "data_position" in meta:
        return {}
    signature = {"process_count": jax.process_count(), **(input_signature or {})}
    saved = meta.get("input_signature", {})
    return {
        key: (saved.get(key), value) for key, value in signature.items() if saved.get(key) != value
    }


def _with_ema(state, wants_ema: bool, has_ema: bool):
    """The restored state with the moving average this run keeps.

    The saved one; one that starts from the weights when none was saved; or none.
    """
    if wants_ema and not has_ema:
        warn(
            "the checkpoint holds no moving average of the weights (it was written with "
            "train.ema_decay=0): the average starts from its weights"
        )
        return state.replace(ema={"params": jax.tree.map(jnp.copy, state.params)})
    return state if wants_ema else state.replace(ema={})
