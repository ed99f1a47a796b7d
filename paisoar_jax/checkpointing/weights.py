"""A run's weights without its optimizer: where they are, reading them, writing an export.

A source of weights is a run directory (its newest complete checkpoint), a checkpoint step
directory (`runs/x/checkpoints/400`) or a params export (`python -m paisoar_jax.export`).
`weights_source` finds which; `read_params` / `load_weights` read the params and model
state onto one device or the current shardings, their shapes taken from the checkpoint's
own metadata (no model is rebuilt); `export_weights` writes an export. `load`, generate,
export and hf-export all find their weights here.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
from typing import Any

import jax
import orbax.checkpoint as ocp
import yaml

from paisoar_jax.checkpointing.checkpoint import (
    checkpoint_directory,
    leaf_checksums,
    live,
    storable,
    storable_target,
    warn,
)
from paisoar_jax.checkpointing.orbax_errors import describe_damage, quiet_orbax_leftovers
from paisoar_jax.checkpointing.saved_trees import _leaf_names, check_compatible, tree_metadata
from paisoar_jax.config import Config, load_config
from paisoar_jax.errors import UserError
from paisoar_jax.runtime.user_files import read_text

# The special token ids of an imported model's config.json, kept beside its weights.
TOKEN_IDS_FILE = "hf_token_ids.json"
# An export's checksum of each array it holds, checked by every reader (as a step's meta is).
CHECKSUMS_FILE = "checksums.json"


def kept_file(name: str, init_from: str, *directories: pathlib.Path) -> pathlib.Path | None:
    """A file an import keeps beside the weights (tokenizer.json, ...), or None.

    Looked for in `directories`, then beside the import the run was fine-tuned from (its
    checkpoint.init_from, `init_from`; empty: none).
    """
    places = list(directories)
    if init_from:
        places.append(pathlib.Path(init_from))
    return next((place / name for place in places if (place / name).is_file()), None)


def run_config(path: pathlib.Path) -> Config:
    """The config.yaml a run or an export wrote, checked whole (every section is written).

    A file cut at a line boundary still parses: its missing sections would read as the
    defaults, another model, so a file without all of them is refused as truncated.
    """
    try:
        raw = yaml.safe_load(read_text(path, "a YAML config")) if path.is_file() else None
    except yaml.YAMLError:
        return load_config(str(path))  # which names the line and the problem
    sections = [field.name for field in dataclasses.fields(Config)]
    missing = [name for name in sections if not isinstance(raw, dict) or name not in raw]
    if missing and isinstance(raw, dict) and raw:
        raise UserError(
            f"{path} lacks the section(s) {', '.join(missing)} that a run writes: the file is "
            f"truncated or was edited; write them back (python -m paisoar_jax.train --help "
            f"lists the keys)"
        )
    return load_config(str(path))


def checkpoint_step(run_dir: pathlib.Path, step: int | None = None):
    """(the run's config, the directory of `step` or the newest complete step, the step)."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    config = run_config(config_path)
    checkpoints = checkpoint_directory(config.checkpoint, run_dir)
    # Complete steps only: a save killed half-way leaves `<step>.orbax-checkpoint-tmp-*`.
    steps = sorted(int(path.name) for path in checkpoints.glob("[0-9]*") if path.name.isdigit())
    if not steps or (step is not None and step not in steps):
        wanted = f"step {step}" if step is not None else "a checkpoint"
        raise UserError(f"{checkpoints} has no {wanted} (steps: {steps or 'none'})")
    step = steps[-1] if step is None else step
    return config, checkpoints / str(step), step


def weights_source(source: pathlib.Path):
    """(config, the directory of the weights, what it is) for `source`.

    `source` is a params export, a checkpoint step directory (`runs/x/checkpoints/400`) or
    a run directory (its newest step).
    """
    config_path = source.parent.parent / "config.yaml"
    if (source / "state").is_dir() and config_path.is_file():
        return run_config(config_path), source, f"checkpoint {source}"
    if (source / "params").is_dir() and (source / "config.yaml").is_file():
        return run_config(source / "config.yaml"), source, f"export {source}"
    if not source.is_dir():
        raise UserError(f"{source}: no such run, checkpoint step or export directory")
    config, path, step = checkpoint_step(source)
    return config, path, f"step {step} of {source}"


def read_weights(source: pathlib.Path):
    """(config, params, model state or None, what was read) of an export, a step or a run."""
    config, path, where = weights_source(source)
    return config, *read_params(path), where


def read_params(path: pathlib.Path, ema: bool = False):
    """(params, model state) of an export or checkpoint step, on one device.

    `ema`: the params are the step's moving average of the weights.
    """
    # The weights' shapes come from the checkpoint itself, so no model is rebuilt (a model
    # of one's own cannot be: only its factory knows it); one device holds them.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return load_weights(path, abstract_weights(path, device), ema)


def _params_item(path: pathlib.Path) -> pathlib.Path:
    """The Orbax item that holds params: an export's `params/` or a checkpoint's `state/`."""
    for name in ("params", "state"):
        if (path / name / "_METADATA").is_file() or (path / name).is_dir():
            return path / name
    raise UserError(
        f"checkpoint.init_from={path}: not a params export or a checkpoint step directory "
        f"(expected {path}/params or {path}/state)"
    )


def abstract_weights(path: pathlib.Path, sharding: jax.sharding.Sharding) -> Any:
    """The params and model state an export or step holds, as shapes placed on `sharding`.

    Read from the checkpoint's metadata: a target for `load_weights` with no model built.
    """
    item = _params_item(path.absolute())
    saved = tree_metadata(item)
    place = lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return types.SimpleNamespace(
        params=jax.tree.map(place, saved["params"]),
        model_state=jax.tree.map(place, saved.get("model_state") or {}),
    )


def load_weights(
    path: pathlib.Path, abstract_state: Any, ema: bool = False
) -> tuple[dict, dict | None]:
    """(params, model state) from an export or any checkpoint step, in the current shardings.

    The model state (BatchNorm's running statistics, fp8 scales) is None when the model has
    none, or when the export or step was written without it (with a warning: it then starts
    afresh). `ema`: the params are the step's moving average of the weights (train.ema_decay).
    """
    item = _params_item(path.absolute())
    checkpointer = ocp.PyTreeCheckpointer()
    saved_tree = tree_metadata(item)
    target = {"params": abstract_state.params}
    if ema:
        if not jax.tree.leaves(saved_tree.get("ema", {})):
            raise UserError(
                f"{path} holds no moving average of the weights: its run had train.ema_decay=0"
            )
        saved_average = {"params": saved_tree["ema"]["params"]}
        check_compatible(saved_average, storable_target({"params": abstract_state.params}), item)
        target = {"ema": {"params": abstract_state.params}}
    if jax.tree.leaves(abstract_state.model_state):
        # A step of a model with no model state (a bf16 GPT for an fp8 run) holds it empty.
        if jax.tree.leaves(saved_tree.get("model_state", {})):
            target["model_state"] = abstract_state.model_state
        else:
            warn(f"{item} has no model state (BatchNorm statistics, fp8 scales): they start afresh")
    typed_target, target = target, storable_target(target)  # keys as stored: raw uint32
    check_compatible({name: saved_tree[name] for name in target}, target, item)
    quiet_orbax_leftovers()
    try:
        restored = checkpointer.restore(
            item,
            args=ocp.args.PyTreeRestore(
                target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    except Exception as error:  # a file of it truncated, emptied or overwritten
        raise UserError(
            f"{item} cannot be read ({describe_damage(error)}): the export or checkpoint is "
            f"damaged (a file truncated, empty or overwritten); export it again from its run"
        ) from None
    verify_weights(path, {name: restored[name] for name in target}, saved_tree)
    restored = live({name: restored[name] for name in target}, typed_target)
    params = restored["ema"]["params"] if ema else restored["params"]
    return params, restored.get("model_state")


def saved_checksums(path: pathlib.Path) -> dict[str, int] | None:
    """{leaf name: checksum} written with an export or a checkpoint step; None: none written.

    (Exports and steps written before named checksums have none to check.)
    """
    try:
        if (path / CHECKSUMS_FILE).is_file():
            return json.loads((path / CHECKSUMS_FILE).read_text())
        meta_file = path / "meta" / "metadata"
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            names, values = meta.get("checksum_names"), meta.get("checksums")
            return dict(zip(names, values, strict=True)) if names and values else None
    except (OSError, ValueError, TypeError) as error:
        raise UserError(
            f"{path}: its checksums cannot be read ({error}): the export or checkpoint is "
            f"damaged; export it again from its run"
        ) from None
    return None


def verify_weights(path: pathlib.Path, restored: dict, saved_tree: Any = None) -> None:
    """Refuses weights whose arrays differ from what was written, in one line.

    A flipped byte or a file overwritten: the first array that differs is named. An array
    read into another dtype than it was saved in (a model of another param_dtype) is not
    compared: its bits are the cast's. `saved_tree`: the saved arrays' metadata.
    """
    expected = saved_checksums(path)
    if expected is None:
        return
    saved_dtypes = {}
    if saved_tree is not None:
        names = _leaf_names(saved_tree)
        leaves = jax.tree.leaves(saved_tree)
        saved_dtypes = {name: leaf.dtype for name, leaf in zip(names, leaves, strict=True)}
    dtypes = {
        name: leaf.dtype
        for name, leaf in zip(_leaf_names(restored), jax.tree.leaves(restored), strict=True)
    }
    for name, checksum in leaf_checksums(restored).items():
        if name in saved_dtypes and saved_dtypes[name] != dtypes[name]:
            continue
        if name in expected and expected[name] != checksum:
            raise UserError(
                f"{path} is damaged: {name} does not match the checksum written with it (a "
                f"flipped byte or a file overwritten); export it again from its run"
            )


def export_weights(params: dict, model_state: dict, output: pathlib.Path) -> None:
    """Writes params and model state (`output/params`): the input of inference, `init_from`.

    With the checksum of each array (checksums.json), which every reader checks.
    """
    weights = {"params": params}
    if jax.tree.leaves(model_state):
        weights["model_state"] = storable(model_state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(output.absolute() / "params", weights)
    checkpointer.wait_until_finished()
    checksums = json.dumps(leaf_checksums(weights), indent=0)  # every process: sharded arrays
    if jax.process_index() == 0:
        (output / CHECKSUMS_FILE).write_text(checksums + "\n")
