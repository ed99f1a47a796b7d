"""The one setup every run starts from: a config and a workload made into a `Setup`.

`setup` turns them into what the loop, `prepare`, plan, bench, export and generation start
from: the mesh, the optimizer chain and the state layout (every sharding, from abstract
shapes only; nothing is built yet), with the config's sections the run reads. It is the one
place below the doors that takes the whole Config apart.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from paisoar_jax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoraConfig,
    MeshConfig,
    OptimConfig,
    PrecisionConfig,
    RematConfig,
    RunConfig,
    TrainConfig,
    dump_yaml,
    to_dict,
)
from paisoar_jax.engine import lora
from paisoar_jax.engine.memory import MemorySettings
from paisoar_jax.engine.optim import (
    build_lr_schedule,
    build_optimizer,
    describe_given,
    wrap_optimizer,
)
from paisoar_jax.engine.state import LayoutSettings, StateLayout, state_layout
from paisoar_jax.engine.step import jit_eval_step, jit_train_step
from paisoar_jax.errors import UserError
from paisoar_jax.numerics import precision, remat
from paisoar_jax.parallel import pipeline, sharding
from paisoar_jax.runtime import gpu_flags
from paisoar_jax.tasks.workload import Optimizer, Task, Workload


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run is built on, resolved once from its config by `setup`.

    The built pieces (mesh, state layout, learning-rate schedule, task, compiler options)
    and the config's sections the loop, resume and save read; below `setup` nothing takes
    the whole Config.
    """

    mesh: Mesh
    layout: StateLayout
    lr_schedule: optax.Schedule | None  # None: a user's optimizer with no schedule we know
    task: Task
    train: TrainConfig  # steps, batch, cadences, seed, limits
    optim: OptimConfig  # the schedule a resume with other train.steps changes
    mesh_settings: MeshConfig  # the `mesh` section: a pipeline's stages
    checkpoint: CheckpointConfig  # where and when to save, what to resume
    data: DataConfig  # the input's workers, prefetch and resume policy
    precision: PrecisionConfig  # the loss scale's settings, for the health checks
    lora: LoraConfig  # a trained module's adapters (Prepared.model)
    reporting: RunConfig  # the `run` section: progress bar, trackers
    memory: MemorySettings  # what the out-of-memory fixes read
    run_dir: pathlib.Path
    compiler_options: dict[str, Any]  # XLA options for the step (runtime/gpu_flags.py)
    record: dict[str, Any]  # the resolved config as sections: a checkpoint's and trackers' copy
    config_yaml: str  # the resolved config as the run writes it to config.yaml
    given_optimizer: dict[str, Any] | None = None  # fit's optimizer as trackers record it

    def jit_train_step(self) -> jax.stages.Wrapped:
        """The run's train step, jitted: its shardings, schedule, accumulation and options."""
        return jit_train_step(
            self.layout,
            self.task,
            self.lr_schedule,
            self.train.grad_accum,
            self.mesh,
            self.compiler_options,
        )

    def jit_eval_step(self) -> Any:
        """The run's eval step, jitted (engine/evaluation.py reads its per-row sums)."""
        return jit_eval_step(self.layout, self.task, self.mesh, self.compiler_options)


def model_builder(
    workload: Workload,
    seed: int,
    remat_settings: RematConfig,
    precision_policy: str,
    lora_settings: LoraConfig,
) -> Callable[[], nnx.Module]:
    """A zero-argument function that builds the model from the run's seed and remat settings."""
    policy_name = remat_settings.policy
    if workload.follows_policy and remat_settings.blocks:
        raise UserError(
            "remat.blocks is for a model of your own: the model zoo's blocks are "
            "checkpointed by remat.policy alone"
        )

    def create() -> nnx.Module:
        # Eager sharding off: shardings are given to jit, not attached at creation.
        with nnx.use_eager_sharding(False), remat.building(policy_name) as built:
            if workload.follows_policy:  # the zoo draws its init from a `params` stream
                model = workload.model(nnx.Rngs(params=seed))
            else:
                model = workload.model(nnx.Rngs(seed))
                if not isinstance(model, nnx.Module):
                    name = getattr(workload.model, "__name__", "the factory")
                    raise UserError(
                        f"model={name} returned {_kind_of(model)}, not an nnx.Module: the "
                        f"factory must build the module (model=lambda rngs: MyModel(..., "
                        f"rngs=rngs))"
                    )
                remat.remat_blocks(model, remat_settings.blocks, policy_name)
                # flax's layers compute in their dtype: the policy's, not the weights' (fp32).
                precision.follow_policy(model, precision.get_policy(precision_policy))
            if lora_settings.enabled:
                lora.add_adapters(model, lora_settings, seed)
            if workload.follows_policy:
                return model
        if policy_name != "none" and not (built.wrapped or remat_settings.blocks):
            raise UserError(
                f"remat.policy={policy_name} applies to no block of this model: name them with "
                f"remat.blocks=[<module path regex>] or wrap them with "
                f"paisoar_jax.remat_block(block)"
            )
        return model

    return create


def optimizer_for(
    given: Optimizer | None, optim: OptimConfig, train: TrainConfig, precision_settings
):
    """(optimizer chain, learning-rate schedule, description): the config's chain, or the user's.

    A user's runs as given: clipped only when optim.clip_norm is set (and loss-scaled under
    fp16, `precision_settings`: the precision section). Its description is what the
    trackers record of it (optim.describe_given); None for the config's.
    """
    if given is None:
        chain, lr_schedule = build_optimizer(
            optim, train.steps, train.global_batch, precision_settings, train.skip_spikes
        )
        return chain, lr_schedule, None
    lr_schedule = build_lr_schedule(optim, train.steps, train.global_batch)
    if isinstance(given, optax.GradientTransformation):
        inner, lr_schedule, factory = given, None, None  # its own learning rate: read if injected
    elif callable(given):
        inner, factory = given(lr_schedule), given
        if not isinstance(inner, optax.GradientTransformation):
            raise UserError(f"optimizer factory returned {type(inner).__name__}, not an optax one")
    else:
        raise UserError(
            f"optimizer must be an optax GradientTransformation or a function of the schedule, "
            f"got {type(given).__name__}"
        )
    clip_norm = optim.clipping(own_optimizer=True)
    chain = wrap_optimizer(inner, clip_norm, precision_settings, train.skip_spikes)
    return chain, lr_schedule, describe_given(inner, factory, clip_norm)


def setup(config: Config, workload: Workload, devices: Sequence[jax.Device] | None = None) -> Setup:
    """The run's Setup for `config` and `workload`: mesh, optimizer, state layout; no arrays.

    The one place the whole Config is taken apart (with the doors that load it): what
    runs below gets a section or a built object.
    """
    train = config.train
    mesh = sharding.build_mesh(config.mesh, devices)
    pipeline_schedule = pipeline.schedule(config.mesh, train)
    pipelined = pipeline_schedule.microbatches if pipeline_schedule else 1
    sharding.check_batch(train.global_batch, train.grad_accum, mesh, pipelined)
    optimizer, lr_schedule, given = optimizer_for(
        workload.optimizer, config.optim, train, config.precision
    )
    create_model = model_builder(
        workload, train.seed, config.remat, config.precision.policy, config.lora
    )
    settings = LayoutSettings(
        config.mesh, config.sharding, train, config.precision.policy, config.lora.enabled
    )
    with jax.set_mesh(mesh):
        layout = state_layout(
            mesh, optimizer, create_model, workload.follows_policy, settings=settings
        )
        workload.task.prepare(layout, train.global_batch)
    memory = MemorySettings(
        config.mesh, train, config.precision, config.remat, config.model.name == "custom"
    )
    return Setup(
        mesh=mesh,
        layout=layout,
        lr_schedule=lr_schedule,
        task=workload.task,
        train=train,
        optim=config.optim,
        mesh_settings=config.mesh,
        checkpoint=config.checkpoint,
        data=config.data,
        precision=config.precision,
        lora=config.lora,
        reporting=config.run,
        memory=memory,
        run_dir=config.run_dir,
        compiler_options=gpu_flags.compiler_options(config.mesh.bucket_mb, mesh.devices),
        record=to_dict(config),
        config_yaml=dump_yaml(config),
        given_optimizer=given,
    )


def _kind_of(value: Any) -> str:
    """`None`, `the class Linear` or `a function`: what a factory returned, in words."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance of it)"
    return f"a {type(value).__name__}"
