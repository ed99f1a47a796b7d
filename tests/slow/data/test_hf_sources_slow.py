"""The slow tier beside tests/data/test_hf_sources.py: longer runs, more settings.

`data.source=hf:PATH` (paisoar_jax/data/hf_sources.py): a `datasets` directory is
tokenized once on first use, then trains and resumes as a converted dataset does.
"""

import shutil

import datasets
import pytest
from conftest import resumable_run
from test_hf_sources import (
    ROWS,
    saved,  # noqa: F401 (fixtures)
    settings,
)

from paisoar_jax.config import load_config
from paisoar_jax.data import hf_sources
from paisoar_jax.data.sources import hf_cache_directory
from paisoar_jax.errors import UserError


def test_changed_data_is_tokenized_again_and_refused_on_resume(saved, tmp_path, capsys):
    changed = tmp_path / "functions"
    shutil.copytree(saved, changed)
    first = load_config(None, settings(changed, tmp_path / "cache"))
    hf_sources.prepare(first.data)
    before = hf_cache_directory(first.data, str(changed))
    resumable_run(tmp_path / "run", settings(changed, tmp_path / "cache"), 3)
    shutil.rmtree(changed)
    datasets.Dataset.from_list(ROWS[:200]).save_to_disk(str(changed))
    again = load_config(None, settings(changed, tmp_path / "cache"))
    assert hf_cache_directory(again.data, str(changed)) != before
    hf_sources.prepare(again.data)
    with pytest.raises(UserError, match="the data now has .* data.on_change=restart"):
        resumable_run(tmp_path / "run", settings(changed, tmp_path / "cache"), 6)
