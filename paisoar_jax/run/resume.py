"""Where a run starts and what a save keeps: the loop's side of checkpoints.

`starting_point` gives the state a run starts from: the newest (or a named) checkpoint,
exported params to fine-tune (`checkpoint.init_from`), or a fresh init. `open_input` opens
the input on the devices, moved (`resume_input`) to where the checkpoint left it. `save`
stores the state with that position and what it belongs to (`input_signature`), so a resume
on another topology continues the same order. Orbax itself is driven by checkpoint.py.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
from flax import traverse_util

from paisoar_jax import __version__, output
from paisoar_jax.checkpointing.checkpoint import (
    Checkpointer,
    Restored,
    checkpoint_directory,
)
from paisoar_jax.checkpointing.orbax_errors import describe_damage
from paisoar_jax.checkpointing.weights import abstract_weights, load_weights
from paisoar_jax.config import CheckpointConfig, DataConfig, MeshConfig, OptimConfig, TrainConfig
from paisoar_jax.data.mixture import MixtureBatches
from paisoar_jax.data.pipeline import GlobalBatches, resume_position
from paisoar_jax.data.prefetch import DevicePrefetcher
from paisoar_jax.engine import lora
from paisoar_jax.engine.state import StateLayout, init_state
from paisoar_jax.errors import DivergenceError, UserError
from paisoar_jax.numerics.loss_scale import all_finite
from paisoar_jax.parallel import sharding
from paisoar_jax.run.setup import Setup
from paisoar_jax.tasks.policy import PolicyOptimisation
from paisoar_jax.tasks.workload import Task


def make_checkpointer(settings: CheckpointConfig, run_dir: pathlib.Path) -> Checkpointer | None:
    """The run's checkpointer (the checkpoint section's), or None when checkpointing is off."""
    if not settings.enabled:
        return None
    directory = checkpoint_directory(settings, run_dir)
    return Checkpointer(directory, settings.keep, settings.keep_period, settings.async_save)


def starting_point(
    run: Setup, checkpointer: Checkpointer | None
) -> tuple[Any, int, Restored | None]:
    """(state, step, what was restored or None): resumed, fine-tuned from params, or fresh."""
    layout, settings = run.layout, run.checkpoint
    resume, signature = settings.resume, input_signature(run.data, run.train, run.task)
    if checkpointer is not None and resume != "never" and checkpointer.steps():
        step = checkpointer.steps()[-1] if resume == "auto" else int(resume)
        # before any step is moved aside
        refuse_batch_change(checkpointer, step, run.train, run.data, run.mesh_settings)
    if checkpointer is not None and resume != "never":
        if resume == "auto":
            restored = checkpointer.restore_latest(layout.abstract_state, signature)
        elif int(resume) not in checkpointer.steps():
            raise UserError(
                f"checkpoint.resume={resume}: no such step in {checkpointer.directory} "
                f"(steps: {checkpointer.steps() or 'none'})"
            )
        else:
            try:
                restored = checkpointer.restore(int(resume), layout.abstract_state, signature)
            except UserError:
                raise
            except Exception as error:  # asked for by name: no silent fallback to another
                raise UserError(
                    f"checkpoint.resume={resume}: step {resume} in {checkpointer.directory} is "
                    f"unreadable ({describe_damage(error)})"
                ) from None
            checkpointer.set_aside_after(int(resume))  # only once the older step restored
        if restored is not None:
            return restored.state, restored.step, restored
    elif checkpointer is not None and checkpointer.steps():
        raise UserError(
            f"checkpoint.resume=never but {checkpointer.directory} already holds steps "
            f"{checkpointer.steps()}: use another run.dir or checkpoint.dir"
        )
    state = init_state(run.train.seed, layout)
    if settings.init_from:
        path = pathlib.Path(settings.init_from)
        params, model_state = _initial_weights(path, layout, state.params)
        state = state.replace(params=params, model_state=model_state or state.model_state)
        if jax.process_index() == 0:
            output.note(
                f"starting from the weights of {settings.init_from} "
                f"(checkpoint.init_from), with a fresh optimizer"
            )
    return state, 0, None


def _initial_weights(path: pathlib.Path, layout: StateLayout, fresh: dict):
    """(params, model state) of `checkpoint.init_from`; `fresh`: the initialised params.

    A LoRA run starting from a model without adapters (an import, a full fine-tune's
    export) loads the frozen params and keeps its fresh adapters; from a LoRA run's
    weights, it loads the adapters too.
    """
    abstract = layout.abstract_state
    if layout.trainable is not None:
        saved = traverse_util.flatten_dict(abstract_weights(path, None).params)
        if not any(trainable in saved for trainable in layout.trainable):
            frozen = lora.split(abstract.params, layout.trainable)[1]
            params, model_state = load_weights(path, abstract.replace(params=frozen))
            return lora.join(lora.split(fresh, layout.trainable)[0], params), model_state
    return load_weights(path, abstract)


def input_signature(data: DataConfig, train: TrainConfig, task: Task) -> dict[str, Any]:
    """What a saved input position belongs to; a resume that changes it starts afresh."""
    return {
        "source": data.source,
        "workers": data.workers,  # grain's state differs with and without workers
        "global_batch": train.global_batch,
        **task.signature(),  # seq_len, image size and channels, or a user's data
        "seed": train.seed,
    }


def saved_batch(restored: Restored) -> int | None:
    """The global batch the checkpoint's run trained with (None: not recorded)."""
    return restored.meta.get("config", {}).get("train", {}).get("global_batch")


def refuse_batch_change(
    checkpointer: Checkpointer, step: int, train: TrainConfig, data: DataConfig, mesh: MeshConfig
) -> None:
    """Refuses a resume with another global batch where it cannot go on exactly.

    The examples are one global order (data/pipeline.py), so another batch size goes on
    from the first example not yet trained. Not so where batches are counted by step: a
    mixture's stages begin at step numbers, and a pipeline's schedule splits the batch.
    """
    try:
        saved = checkpointer.meta(step).get("config", {}).get("train", {}).get("global_batch")
    except Exception:  # an unreadable step: the restore says so (and falls back)
        return
    new = train.global_batch
    if saved is None or saved == new or step not in checkpointer.steps():
        return
    why = (
        "data.mixture_stages begin at step numbers, which would then mean other examples"
        if data.mixture_stages
        else f"a pipeline ({mesh.describe_stages()}) cannot change its batch mid-run"
        if mesh.stages > 1
        else None
    )
    if why:
        raise UserError(
            f"train.global_batch changed since checkpoint step {step} in "
            f"{checkpointer.directory} ({saved} -> {new}) and {why}: resume with "
            f"train.global_batch={saved}, or start a new run.dir"
        )


def batch_change_note(restored: Restored, train: TrainConfig) -> str | None:
    """The line for a resume with another global batch (which goes on exactly)."""
    saved, new = saved_batch(restored), train.global_batch
    if saved is None or saved == new:
        return None
    step, steps = restored.step, train.steps
    done = _examples_done(restored.data_state, step, saved)
    return (
        f"train.global_batch changed since checkpoint step {step} ({saved} -> {new}): the "
        f"input goes on from example {done}, the first not yet trained; from step {step + 1} "
        f"each step takes {new} examples, and the learning-rate schedule stays counted in "
        f"steps (train.steps={steps}: {done + max(steps - step, 0) * new} examples in all, "
        f"not {steps * saved})"
    )


def _examples_done(data_state: dict | None, step: int, saved: int) -> int:
    """How many examples of the global order a checkpoint had trained on."""
    state = data_state or {}
    if state.get("sampler") == "global":
        return int(state["examples"])
    if state.get("sampler") == "mixture":
        return sum(int(position) for position in state.get("positions", {}).values())
    return step * saved


def schedule_change(restored: Restored, train: TrainConfig, optim: OptimConfig) -> str | None:
    """A line when train.steps changed since the checkpoint and the config's lr follows it.

    The warmup (min(optim.warmup_steps, train.steps)) and the decay span train.steps: a run
    resumed with more steps goes on with the learning rate of the longer schedule.
    """
    saved = restored.meta.get("config", {}).get("train", {}).get("steps")
    steps = train.steps
    if saved is None or saved == steps:
        return None
    if optim.schedule == "constant" and optim.warmup_steps <= min(saved, steps):
        return None
    return (
        f"train.steps changed since checkpoint step {restored.step} ({saved} -> {steps}): the "
        f"learning-rate schedule (optim.schedule={optim.schedule}, optim.warmup_steps="
        f"{optim.warmup_steps}) now spans {steps} steps, so the learning rate from step "
        f"{restored.step + 1} on is not the one the run had before"
    )


def open_input(run: Setup, train_source: Any, restored: Restored | None) -> DevicePrefetcher:
    """The batches this process trains on, moved to the checkpoint's position, on the devices."""
    train, data = run.train, run.data
    host_iterator = iter(
        run.task.host_batches(
            train_source,
            global_batch=train.global_batch,
            seed=train.seed,
            train=True,
            workers=data.workers,
        )
    )
    if restored is not None:
        note = resume_input(host_iterator, restored, data, train)
        if note and jax.process_index() == 0:
            output.note(note)
    return DevicePrefetcher(
        host_iterator, sharding.batch_sharding(run.mesh), data.prefetch, data.check_finite
    )


def resume_input(
    host_iterator, restored: Restored, data: DataConfig, train: TrainConfig
) -> str | None:
    """Moves the input to where the checkpoint left it; a line to print when it cannot."""
    step = restored.step
    if isinstance(host_iterator, MixtureBatches):
        return host_iterator.continue_from(restored.data_state, step, data.on_change)
    if isinstance(host_iterator, GlobalBatches):
        saved_batch = restored.meta.get("config", {}).get("train", {}).get("global_batch")
        examples, note = resume_position(
            restored.data_state,
            host_iterator,
            step,
            saved_batch or train.global_batch,
            data.on_change,
        )
        host_iterator.set_state({"examples": examples})
        return note
    if not hasattr(host_iterator, "set_state"):
        return (
            f"resumed at step {step}, but the input has no position to save (a plain "
            f"iterable): it restarts from its first batch"
        )
    if (restored.data_state or {}).get("sampler") == "global":
        return (
            f"checkpoint step {step} holds a position of examples in the global order, but "
            f"the input is now ready batches: they restart from their first batch"
        )
    if restored.data_state is None:
        why = f" (the input changed since: {restored.input_changes})"
        return (
            f"checkpoint step {step} holds no input position this run can continue"
            f"{why if restored.input_changes else ''}: the input restarts from its first batch"
        )
    host_iterator.set_state(restored.data_state)
    return None


_params_finite = jax.jit(all_finite)


def params_finite(params: Any) -> bool:
    """Whether every parameter is finite (one reduction over them, and a host sync)."""
    return bool(_params_finite(params))


def save(checkpointer: Checkpointer, step: int, state: Any, batches: Any, run: Setup) -> None:
    """Starts an async save of `step`; params that are no longer finite are never saved.

    With the step go the input's position (`batches`), what it belongs to, and the run's
    resolved config (`run.record`), which a resume with other settings compares.
    """
    if not params_finite(state.params):
        raise DivergenceError(
            f"the params are not finite after step {step}: training diverged; the "
            f"checkpoints before it are kept in {checkpointer.directory}"
        )
    meta = {
        "step": step,
        "mesh": dict(run.mesh.shape),
        "version": __version__,
        "config": run.record,
    }
    if isinstance(run.task, PolicyOptimisation):  # grpo.iterations > 1: the rows held
        meta["held_rows"] = run.task.held_record(step)
    signature = input_signature(run.data, run.train, run.task)
    checkpointer.save(step, state, batches.consumed_state(), meta, signature)
