"""The model zoo: model classes registered by name (`model.name` in the config).

A registered class is a Flax NNX module built as `cls(model_config, policy, remat_policy,
rngs)`, annotates every parameter with logical axis names and has a static
`flops_per_token(model_config, param_count)` for MFU.
"""

from __future__ import annotations

from flax import nnx

from paisoar_jax.config import ModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.gpt import GPT
from paisoar_jax.precision import Policy

MODELS: dict[str, type[nnx.Module]] = {"gpt": GPT}


def model_class(name: str) -> type[nnx.Module]:
    """The registered model class called `name`."""
    if name not in MODELS:
        raise UserError(f"model.name={name!r} is not one of {', '.join(sorted(MODELS))}")
    return MODELS[name]


def build_model(
    model_config: ModelConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
) -> nnx.Module:
    """Builds the registered model named by `model_config.name`."""
    return model_class(model_config.name)(model_config, policy, remat_policy, rngs)
