"""Checks of a whole config that no single field can make.

Shapes that must divide, ranges, keys that only some models use. Mesh-size checks need the
devices and live in sharding.py; an image model's shape is checked by its family (models/).
"""

from __future__ import annotations

import math

from paisoar_jax.config import Config, CustomModelConfig, DataConfig, ModelConfig, VisionConfig
from paisoar_jax.errors import UserError


def validate(config: Config) -> None:
    """Checks what one section cannot check alone; mesh-size checks live in sharding.py."""
    train, optim, mesh = config.train, config.optim, config.mesh
    if isinstance(config.model, VisionConfig):
        _validate_vision(config)
    elif isinstance(config.model, CustomModelConfig):
        _validate_custom(config)
    else:
        _validate_language_model(config.model)
        _refuse_image_data_keys(config.data)
    positive = {
        "train.steps": train.steps,
        "train.global_batch": train.global_batch,
        "train.grad_accum": train.grad_accum,
        "train.log_every": train.log_every,
        "data.prefetch": config.data.prefetch,
    }
    _check_positive(positive)
    if train.global_batch % train.grad_accum:
        raise UserError(
            f"train.global_batch={train.global_batch} is not divisible by "
            f"train.grad_accum={train.grad_accum}"
        )
    if mesh.zero not in (0, 1, 2, 3):
        raise UserError(f"mesh.zero must be 0, 1, 2 or 3, got {mesh.zero}")
    for key in ("data", "fsdp", "tensor", "dcn_data", "dcn_fsdp"):
        size = getattr(mesh, key)
        if size == 0 or size < -1:
            raise UserError(f"mesh.{key} must be a positive size or -1, got {size}")
    from paisoar_jax.loss_scale import parse_mode  # late: keeps `--help` free of jax

    parse_mode(config.precision.loss_scale, config.precision.policy)
    if optim.lr_scaling != "none" and optim.base_batch < 1:
        raise UserError(f"optim.lr_scaling={optim.lr_scaling} needs optim.base_batch >= 1")
    if not optim.lr > 0:
        raise UserError(f"optim.lr must be > 0, got {optim.lr}")
    if not 0 <= config.data.eval_fraction < 1:
        raise UserError(f"data.eval_fraction must be in [0, 1), got {config.data.eval_fraction}")
    if train.profile_steps and train.profile_steps[-1] > train.steps:
        raise UserError(
            f"train.profile_steps={list(train.profile_steps)} ends after the last step "
            f"(train.steps={train.steps})"
        )
    if config.data.eval_fraction == 0 and train.eval_every > 0:
        raise UserError("data.eval_fraction=0 leaves no eval data: set train.eval_every=0 too")
    _validate_ranges(config)


def _check_positive(values: dict[str, int]) -> None:
    """Each named count must be at least 1."""
    for key, value in values.items():
        if value < 1:
            raise UserError(f"{key} must be >= 1, got {value}")


def _validate_language_model(model: ModelConfig) -> None:
    """The GPT shape: positive sizes, heads that divide the width."""
    _check_positive(
        {
            "model.vocab_size": model.vocab_size,
            "model.seq_len": model.seq_len,
            "model.layers": model.layers,
            "model.width": model.width,
            "model.heads": model.heads,
        }
    )
    if model.mlp_width < 0:
        raise UserError(f"model.mlp_width must be >= 0 (0 means 4 * width), got {model.mlp_width}")
    if model.width % model.heads:
        raise UserError(f"model.width={model.width} is not divisible by model.heads={model.heads}")
    if model.position == "rotary" and (model.width // model.heads) % 2:
        raise UserError("model.position=rotary needs an even head width (width / heads)")


def _validate_custom(config: Config) -> None:
    """A model of one's own: the zoo-only settings would silently do nothing."""
    _refuse_image_data_keys(config.data)
    if config.precision.policy == "fp8":
        raise UserError(
            "precision.policy=fp8 runs the zoo's transformer blocks (gpt, vit) in fp8; a model "
            "of your own trains in bf16 (its matmuls are not fp8 ops)"
        )


def _refuse_image_data_keys(data: DataConfig) -> None:
    """Image augmentation keys set on a language model: they would silently do nothing."""
    defaults = DataConfig()
    for key in ("min_crop_scale", "mixup_alpha"):
        if getattr(data, key) != getattr(defaults, key):
            raise UserError(f"data.{key} is for image models (model.name=resnet|vgg|vit)")


def _validate_vision(config: Config) -> None:
    """The image model's shape (checked by its family) and the augmentation ranges."""
    from paisoar_jax.models import resolve_model_config  # late: keeps `--help` free of jax

    model = resolve_model_config(config.model)
    if config.precision.policy == "fp8" and model.name != "vit":
        raise UserError(
            f"precision.policy=fp8 runs transformer blocks' matmuls in fp8 (model.name gpt or "
            f"vit); {model.name} is convolutional: use bf16"
        )
    if config.model.num_classes < 2:
        raise UserError(f"model.num_classes must be >= 2, got {config.model.num_classes}")
    if not 0 <= config.model.label_smoothing < 1:
        raise UserError(
            f"model.label_smoothing must be in [0, 1), got {config.model.label_smoothing}"
        )
    if not 0 < config.data.min_crop_scale <= 1:
        raise UserError(f"data.min_crop_scale must be in (0, 1], got {config.data.min_crop_scale}")
    if not (math.isfinite(config.data.mixup_alpha) and config.data.mixup_alpha >= 0):
        raise UserError(
            f"data.mixup_alpha must be a finite number >= 0, got {config.data.mixup_alpha}"
        )


def _validate_ranges(config: Config) -> None:
    """Non-negative counts, finite rates and the checkpoint.resume choices."""
    train, optim, checkpoint = config.train, config.optim, config.checkpoint
    at_least = {
        "train.eval_every": (train.eval_every, 0),
        "train.eval_batches": (train.eval_batches, 1),
        "train.sample_bytes": (train.sample_bytes, 0),
        "optim.warmup_steps": (optim.warmup_steps, 0),
        "data.workers": (config.data.workers, 0),
        "checkpoint.every": (checkpoint.every, 0),
        "checkpoint.keep": (checkpoint.keep, 1),
        "checkpoint.keep_period": (checkpoint.keep_period, 0),
    }
    for key, (value, minimum) in at_least.items():
        if value < minimum:
            raise UserError(f"{key} must be >= {minimum}, got {value}")
    non_negative = {
        "train.memory_limit_gb": train.memory_limit_gb,
        "optim.clip_norm": optim.clip_norm,
        "optim.weight_decay": optim.weight_decay,
        "optim.final_lr_fraction": optim.final_lr_fraction,
        "train.peak_tflops": train.peak_tflops,
    }
    for key, value in {**non_negative, "optim.lr": optim.lr}.items():
        if not math.isfinite(value) or value < 0:
            raise UserError(f"{key} must be a finite number >= 0, got {value}")
    profile = train.profile_steps
    if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
        raise UserError(
            f"train.profile_steps must be [start, end] with 1 <= start <= end, got {list(profile)}"
        )
    if checkpoint.resume not in ("auto", "never") and not checkpoint.resume.isdigit():
        raise UserError(
            f"checkpoint.resume must be auto, never or a step number, got {checkpoint.resume!r}"
        )
