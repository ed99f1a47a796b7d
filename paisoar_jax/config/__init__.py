"""Run configuration: one frozen dataclass per concern, loaded from YAML plus dotted overrides.

sections.py holds the dataclasses and their checks (models.py those of the `model` section,
mesh.py the mesh axes' table and the `mesh` section, checks.py the checks they share);
loading.py reads YAML files and `section.key=value` overrides into them and writes the
resolved config back. Everything a caller needs is
importable from here (`from paisoar_jax.config import Config, load_config`).
The package imports nothing of paisoar_jax but `errors`, so every other module may use it.
"""

from paisoar_jax.config.loading import (
    CONFIG_DIR,
    FIT_CONFIG_MARK,
    FIT_CONFIG_NOTE,
    config_from_dict,
    dump_yaml,
    load_config,
    resolve_config_path,
    to_dict,
)
from paisoar_jax.config.models import (
    MODEL_CONFIGS,
    CustomModelConfig,
    LanguageModelConfig,
    VisionConfig,
)
from paisoar_jax.config.sections import (
    AxisEntry,
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    DpoConfig,
    GrpoConfig,
    LoraConfig,
    MeshConfig,
    OptimConfig,
    PrecisionConfig,
    RematConfig,
    RunConfig,
    ShardingConfig,
    TrainConfig,
    check_stage_groups,
)

__all__ = [
    "CONFIG_DIR",
    "FIT_CONFIG_MARK",
    "FIT_CONFIG_NOTE",
    "MODEL_CONFIGS",
    "AxisEntry",
    "CheckpointConfig",
    "Config",
    "CustomModelConfig",
    "DataConfig",
    "DistributedConfig",
    "DpoConfig",
    "GrpoConfig",
    "MeshConfig",
    "LanguageModelConfig",
    "LoraConfig",
    "OptimConfig",
    "PrecisionConfig",
    "RematConfig",
    "RunConfig",
    "ShardingConfig",
    "TrainConfig",
    "VisionConfig",
    "check_stage_groups",
    "config_from_dict",
    "dump_yaml",
    "load_config",
    "resolve_config_path",
    "to_dict",
]
