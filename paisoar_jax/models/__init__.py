"""The model zoo: model classes registered by name (`model.name` in the config).

A registered class is a Flax NNX module built as `cls(model_config, policy, remat_policy,
rngs)` that annotates every parameter with logical axis names. Language models (gpt) take
int32 tokens and have a static `flops_per_token(model_config, param_count)`; image
classifiers (resnet, vgg, vit) take NHWC images, return class logits and have a static
`flops_per_example(model_config, param_count)`. `config.MODEL_CONFIGS` names the config
dataclass of each.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from paisoar_jax.config import ModelConfig, VisionConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.gpt import GPT
from paisoar_jax.models.resnet import ResNet, resolve_resnet_config
from paisoar_jax.models.vgg import VGG, resolve_vgg_config
from paisoar_jax.models.vit import ViT, resolve_vit_config
from paisoar_jax.precision import Policy

MODELS: dict[str, type[nnx.Module]] = {"gpt": GPT, "resnet": ResNet, "vgg": VGG, "vit": ViT}

# Image families: the function that fills a config's shape from its variant and checks it.
VISION_RESOLVERS: dict[str, Callable[[VisionConfig], VisionConfig]] = {
    "resnet": resolve_resnet_config,
    "vgg": resolve_vgg_config,
    "vit": resolve_vit_config,
}


def model_class(name: str) -> type[nnx.Module]:
    """The registered model class called `name`."""
    if name not in MODELS:
        raise UserError(f"model.name={name!r} is not one of {', '.join(sorted(MODELS))}")
    return MODELS[name]


def is_image_model(model_config: ModelConfig | VisionConfig) -> bool:
    """Whether the configured model classifies images (else it models tokens)."""
    return isinstance(model_config, VisionConfig)


def resolve_model_config(
    model_config: ModelConfig | VisionConfig,
) -> ModelConfig | VisionConfig:
    """An image model's config with its variant's shape filled in (UserError if it can't be)."""
    if not is_image_model(model_config):
        return model_config
    return VISION_RESOLVERS[model_config.name or "resnet"](model_config)


def build_model(
    model_config: ModelConfig | VisionConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
) -> nnx.Module:
    """Builds the registered model named by `model_config.name`."""
    return model_class(model_config.name)(model_config, policy, remat_policy, rngs)
