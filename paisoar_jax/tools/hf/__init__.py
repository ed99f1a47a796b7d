"""Hugging Face checkpoints and adapters in and out (`python -m paisoar_jax.convert`).

Modules: checkpoints.py imports and exports whole models (`hf_import`, `hf_export`: the
library side, re-exported here) with each family's tensor table and config.json mapping
(paisoar_jax/models/families/, a module per family), peft.py reads and writes LoRA adapters
in PEFT's format. Hugging Face `datasets` are data's
(data/hf_datasets.py, data/hf_sources.py).
"""

from paisoar_jax.tools.hf.checkpoints import (
    EOS_NAMES,
    SOURCE_FILE,
    TOKEN_IDS_FILE,
    abstract_params,
    hf_export,
    hf_import,
    imported_config,
    kept_file,
    model_config_from_hf,
    placed_params,
)

__all__ = [
    "EOS_NAMES",
    "SOURCE_FILE",
    "TOKEN_IDS_FILE",
    "abstract_params",
    "hf_export",
    "hf_import",
    "imported_config",
    "kept_file",
    "model_config_from_hf",
    "placed_params",
]
