"""The slow tier beside tests/checkpointing/test_checkpoint.py: longer runs, more settings.

Checkpoints with real Orbax files: reshard on restore, bad checkpoints, export, fine-tune.
"""

import json

import jax
import numpy as np
import pytest
from conftest import losses, train
from test_checkpoint import assert_states_equal, flip_bytes, layout_on, run_config

from paisoar_jax.checkpointing.checkpoint import Checkpointer
from paisoar_jax.checkpointing.weights import load_weights
from paisoar_jax.errors import UserError
from paisoar_jax.tools.export import export


def test_flipped_bytes_are_caught_and_the_run_goes_on_past_them(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))  # checkpoints 2 and 4
    flip_bytes(run_dir / "checkpoints" / "4")
    with pytest.raises(UserError, match="checkpoint.resume=4: step 4 in .* is unreadable"):
        train(run_config(run_dir, "train.steps=6", "checkpoint.resume=4"))
    resumed = train(run_config(run_dir, "train.steps=6"))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 6
    assert "checkpoint step 4" in capsys.readouterr().err
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4, 6]
    assert [p.name for p in (run_dir / "checkpoints-broken").iterdir()] == ["4"]  # kept


def test_resume_settings(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_config(run_dir))
    assert first["resumed_from"] == 0 and sorted(
        int(p.name) for p in (run_dir / "checkpoints").iterdir()
    ) == [2, 4]
    done = train(run_config(run_dir))  # resume=auto: nothing left to do
    assert done["resumed_from"] == 4 and done["final_loss"] is None  # no step was taken
    with pytest.raises(UserError, match="resume=never but"):
        train(run_config(run_dir, "checkpoint.resume=never"))
    with pytest.raises(UserError, match=r"no such step .*steps: \[2, 4\]"):
        train(run_config(run_dir, "checkpoint.resume=3", "train.steps=6"))
    with pytest.raises(UserError, match="does not fit this model"):
        train(run_config(run_dir, "checkpoint.resume=2", "model.width=32"))
    assert not (run_dir / "checkpoints-superseded").exists()  # refused: nothing moved
    again = train(run_config(run_dir, "checkpoint.resume=2", "train.steps=6"))
    assert again["resumed_from"] == 2 and again["steps"] == 6
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # steps 3, 4 logged once


def test_divergence_keeps_the_last_good_checkpoint(tmp_path):
    from paisoar_jax.errors import DivergenceError

    run_dir = tmp_path / "run"
    train(run_config(run_dir, "checkpoint.every=1"))
    diverging = run_config(
        run_dir,
        "checkpoint.every=1",
        "train.steps=8",
        "optim.lr=1e39",  # inf in float32: the first update makes the params non-finite
    )
    with pytest.raises(DivergenceError, match="after step 5"):
        train(diverging)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=3)
    assert checkpointer.steps() == [2, 3, 4]
    layout, mesh = layout_on(["mesh.data=8"], jax.devices())
    with jax.set_mesh(mesh):
        kept = checkpointer.restore_latest(layout.abstract_state)
    checkpointer.close()
    assert kept.step == 4
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(kept.state))


def test_export_params_and_fine_tune_from_them(tmp_path, devices):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))
    export(run_dir, tmp_path / "export")
    assert (tmp_path / "export" / "params").is_dir()
    assert (tmp_path / "export" / "config.yaml").is_file()
    layout, mesh = layout_on(["mesh.fsdp=4", "mesh.tensor=2"], devices)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=3)
    with jax.set_mesh(mesh):
        exported, model_state = load_weights(tmp_path / "export", layout.abstract_state)
        final = checkpointer.restore(4, layout.abstract_state).state.params
    checkpointer.close()
    assert_states_equal(exported, final)
    assert model_state is None  # the GPT has no BatchNorm statistics
    assert jax.tree.leaves(exported)[0].sharding == jax.tree.leaves(layout.shardings.params)[0]
    tuned = train(run_config(tmp_path / "tuned", f"checkpoint.init_from={tmp_path / 'export'}"))
    fresh = train(run_config(tmp_path / "fresh"))
    assert tuned["first_loss"] < fresh["first_loss"]  # starts where the export left off
    with pytest.raises(UserError, match="does not fit this model"):
        train(
            run_config(
                tmp_path / "other", f"checkpoint.init_from={tmp_path / 'export'}", "model.layers=3"
            )
        )
    with pytest.raises(UserError, match="not a params export"):
        train(run_config(tmp_path / "other2", f"checkpoint.init_from={tmp_path}"))


def test_another_worker_count_continues_the_input_exactly(tmp_path, capsys):
    constant = "optim.schedule=constant"  # a run of 4 steps follows the schedule of one of 6
    train(run_config(tmp_path / "uninterrupted", "train.steps=6", constant))
    run_dir = tmp_path / "run"
    train(run_config(run_dir, constant))
    resumed = train(
        run_config(run_dir, "train.steps=6", constant, "data.workers=1", "data.prefetch=4")
    )
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 6
    assert losses(run_dir) == losses(tmp_path / "uninterrupted")
    assert "input" not in capsys.readouterr().out


def test_a_flipped_byte_in_an_export_stops_init_from_and_generation_in_one_line(tmp_path):
    from paisoar_jax.inference.generator import Generator

    run_dir, exported = tmp_path / "run", tmp_path / "export"
    train(run_config(run_dir))
    export(run_dir, exported)
    flip_bytes(exported, item="params")
    damaged = rf"{exported} is damaged: params\.\S+ does not match the checksum written with it"
    with pytest.raises(UserError, match=damaged):
        Generator(exported)
    with pytest.raises(UserError, match=damaged):
        train(run_config(tmp_path / "tune", f"checkpoint.init_from={exported}"))
