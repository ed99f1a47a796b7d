"""The model zoo's registry: model.name -> its config section, model class and task.

Each zoo model is trained through the same seam as a user's own (workload.py): a factory
`rngs -> nnx.Module` and a Task. Its class is built as `cls(model_config, policy,
remat_policy, rngs)` and annotates every parameter with logical axis names; language models
have a static `flops_per_token(model_config, param_count)`, image classifiers a static
`flops_per_example(model_config, param_count)`. A model of one's own has the name `custom`
and is given to `paisoar_jax.fit(model=...)`, not named here.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from paisoar_jax.config import (
    MODEL_CONFIGS,
    Config,
    CustomModelConfig,
    LanguageModelConfig,
    MeshConfig,
    TrainConfig,
    VisionConfig,
    check_stage_groups,
)
from paisoar_jax.errors import UserError
from paisoar_jax.models import resolve_model_config
from paisoar_jax.models.gpt import GPT
from paisoar_jax.models.llama import Llama
from paisoar_jax.models.resnet import ResNet
from paisoar_jax.models.vgg import VGG
from paisoar_jax.models.vit import ViT
from paisoar_jax.numerics.precision import Policy, policy_of
from paisoar_jax.tasks.builtin import ImageClassification, LanguageModelling, TaskSections
from paisoar_jax.tasks.policy import PolicyOptimisation
from paisoar_jax.tasks.preference import PreferenceOptimisation
from paisoar_jax.tasks.workload import Workload

# The `model` section: a zoo model's settings, or model.name=custom's (fit's own model).
ModelSection = LanguageModelConfig | VisionConfig | CustomModelConfig


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One registered model: its config section's dataclass, its class and its task."""

    config_type: type
    model_class: type[nnx.Module]
    task_class: type
    fp8: bool  # its blocks' matmuls run in fp8 under precision.policy=fp8
    stack: bool  # its blocks are one stacked, scanned stack: mesh.stage can pipeline it


ZOO: dict[str, ZooEntry] = {
    "gpt": ZooEntry(MODEL_CONFIGS["gpt"], GPT, LanguageModelling, fp8=True, stack=True),
    "llama": ZooEntry(MODEL_CONFIGS["llama"], Llama, LanguageModelling, fp8=True, stack=True),
    "resnet": ZooEntry(
        MODEL_CONFIGS["resnet"], ResNet, ImageClassification, fp8=False, stack=False
    ),
    "vgg": ZooEntry(MODEL_CONFIGS["vgg"], VGG, ImageClassification, fp8=False, stack=False),
    "vit": ZooEntry(MODEL_CONFIGS["vit"], ViT, ImageClassification, fp8=True, stack=True),
}


def entry(name: str) -> ZooEntry:
    """The registered model called `name`."""
    if name == "custom":
        raise UserError(
            "model.name=custom is a model of your own: train it through "
            "paisoar_jax.fit(config, model=..., loss=...), not by name"
        )
    if name not in ZOO:
        raise UserError(f"model.name={name!r} is not one of {', '.join(sorted(ZOO))}")
    return ZOO[name]


def model_class(name: str) -> type[nnx.Module]:
    """The registered model class called `name`."""
    return entry(name).model_class


def build_model(
    model_config: LanguageModelConfig | VisionConfig,
    policy: Policy,
    remat_policy: str,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Builds the registered model named by `model_config.name`."""
    resolved = resolve_model_config(model_config)
    return model_class(resolved.name)(resolved, policy, remat_policy, rngs)


def check_model(
    model: ModelSection, mesh: MeshConfig, train: TrainConfig, precision_policy: str
) -> None:
    """Refuses a zoo model (the `model` section) the config cannot build, before any device.

    The config checked itself as it was built; here come the checks that need the model's
    own tables: an image variant's shape, and whether its blocks have fp8 matmuls
    (precision.policy), whether they stack for the `mesh` section's pipeline (with the
    `train` section's repeats). The command line and `fit` call it right after loading the
    config; `zoo_workload` again.
    """
    if isinstance(model, CustomModelConfig):
        return
    resolved = resolve_model_config(model)
    if precision_policy == "fp8" and not entry(resolved.name).fp8:
        fp8_names = " or ".join(name for name, known in ZOO.items() if known.fp8)
        raise UserError(
            f"precision.policy=fp8 runs transformer blocks' matmuls in fp8 (model.name "
            f"{fp8_names}); {resolved.name} is convolutional: use bf16"
        )
    if isinstance(resolved, VisionConfig):
        _check_vision_stack(resolved, mesh, train)
    if mesh.stages > 1 and not entry(resolved.name).stack:
        stacked = ", ".join(name for name, known in ZOO.items() if known.stack)
        raise UserError(
            f"{mesh.describe_stages()} pipelines a stack of identical blocks "
            f"({stacked}); model.name={resolved.name} has none: set mesh.stage=1 and "
            f"mesh.dcn_stage=1"
        )


def _check_vision_stack(resolved: VisionConfig, mesh: MeshConfig, train: TrainConfig) -> None:
    """ViT stacks its blocks with model.scan_layers; a pipeline needs that and even groups."""
    if resolved.scan_layers and resolved.name != "vit":
        raise UserError(f"model.scan_layers is for vit; {resolved.name} has no stack of blocks")
    if resolved.name != "vit" or mesh.stages == 1:
        return
    if not resolved.scan_layers:
        raise UserError("mesh.stage > 1 pipelines the stacked blocks: set model.scan_layers=true")
    stages, repeats = mesh.stages, train.pipeline_repeats
    check_stage_groups(f"model.depth ({resolved.variant})", resolved.depth, stages, repeats)


def zoo_workload(config: Config) -> Workload:
    """The configured zoo model as a workload: its factory and its task (checked first)."""
    model, precision_policy = config.model, config.precision.policy
    check_model(model, config.mesh, config.train, precision_policy)
    policy, remat_policy = policy_of(config.precision), config.remat.policy

    def create(rngs: nnx.Rngs) -> nnx.Module:
        return build_model(model, policy, remat_policy, rngs)

    zoo_entry = entry(resolve_model_config(model).name)
    sections = TaskSections(model, config.data, config.train, precision_policy)
    if config.train.objective == "dpo":  # (Config checked the model is a decoder)
        task = PreferenceOptimisation(sections, zoo_entry.model_class, config.dpo)
    elif config.train.objective == "grpo":
        init_from = config.checkpoint.init_from
        task = PolicyOptimisation(sections, zoo_entry.model_class, config.grpo, init_from)
    else:
        task = zoo_entry.task_class(sections, zoo_entry.model_class)
    return Workload(model=create, task=task, follows_policy=True)
