"""The model zoo's modules: gpt and llama, and the image classifiers resnet, vgg and vit.

paisoar_jax/tasks/zoo.py registers them by name (`model.name`); this package holds the modules
and the resolution of an image model's variant into its shape.
"""

from __future__ import annotations

from collections.abc import Callable

from paisoar_jax.config import LanguageModelConfig, VisionConfig
from paisoar_jax.models.resnet import resolve_resnet_config
from paisoar_jax.models.vgg import resolve_vgg_config
from paisoar_jax.models.vit import resolve_vit_config

# Image families: the function that fills a config's shape from its variant and checks it.
VISION_RESOLVERS: dict[str, Callable[[VisionConfig], VisionConfig]] = {
    "resnet": resolve_resnet_config,
    "vgg": resolve_vgg_config,
    "vit": resolve_vit_config,
}


def is_image_model(model_config: LanguageModelConfig | VisionConfig) -> bool:
    """Whether the configured model classifies images (else it models tokens)."""
    return isinstance(model_config, VisionConfig)


def resolve_model_config(
    model_config: LanguageModelConfig | VisionConfig,
) -> LanguageModelConfig | VisionConfig:
    """An image model's config with its variant's shape filled in (UserError if it can't be)."""
    if not is_image_model(model_config):
        return model_config
    return VISION_RESOLVERS[model_config.name or "resnet"](model_config)
