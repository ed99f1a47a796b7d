"""Checkpoints with real Orbax files: reshard on restore, bad checkpoints, export, fine-tune."""

import json
import pathlib

import jax
import numpy as np
import pytest
from conftest import TINY, build_run, plan_run, token_batches, train
from flax import struct

from paisoar_jax.checkpointing.checkpoint import Checkpointer, check_writable
from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding
from paisoar_jax.tools.export import export

DATA_STATE = {"position": 7}


def trained_state(devices, mesh_overrides=(), steps=2):
    """A TINY state after `steps` real steps, and its layout and mesh."""
    config, mesh, layout, state, train_step = build_run(mesh_overrides, devices)
    with jax.set_mesh(mesh):
        for tokens in token_batches(steps):
            batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
            state, _ = train_step(state, batch)
    return state, layout, mesh


def layout_on(overrides, devices):
    """The layout (with its abstract restore target) of TINY + overrides on `devices`."""
    _, mesh, layout, _ = plan_run(overrides, devices)
    return layout, mesh


def assert_states_equal(left, right):
    for a, b in zip(jax.tree.leaves(left), jax.tree.leaves(right), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def saved(devices, tmp_path_factory):
    """Steps 1 and 2 of a data=8 run, saved synchronously."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    state, layout, mesh = trained_state(devices, ["mesh.data=8"])
    checkpointer = Checkpointer(directory, keep=3)
    for step in (1, 2):
        checkpointer.save(step, state, DATA_STATE, {"step": step})
    checkpointer.close()
    return directory, state


@pytest.mark.parametrize(
    "overrides, device_count",
    [(["mesh.data=8"], 8), (["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], 8), ([], 4)],
)
def test_restore_reshards_onto_another_mesh(saved, devices, overrides, device_count):
    directory, state = saved
    layout, mesh = layout_on(overrides, devices[:device_count])
    checkpointer = Checkpointer(directory, keep=3)
    with jax.set_mesh(mesh):
        restored = checkpointer.restore(2, layout.abstract_state)
    checkpointer.close()
    assert restored.step == 2 and restored.data_state == DATA_STATE
    assert restored.meta["step"] == 2 and restored.meta["input_signature"] == {"process_count": 1}
    assert_states_equal(restored.state, state)
    for array, wanted in zip(
        jax.tree.leaves(restored.state), jax.tree.leaves(layout.shardings), strict=True
    ):
        assert array.sharding == wanted  # read straight into the new layout, shard by shard
    qkv = restored.state.params["blocks"]["qkv_kernel"]
    if "mesh.tensor=2" in overrides:
        assert qkv.addressable_shards[0].data.shape != qkv.shape


def test_wrong_model_shape_names_the_first_parameter(saved, devices):
    directory, _ = saved
    layout, mesh = layout_on(["model.width=32"], devices)
    checkpointer = Checkpointer(directory, keep=3)
    with jax.set_mesh(mesh), pytest.raises(UserError) as error:
        checkpointer.restore_latest(layout.abstract_state)
    checkpointer.close()
    message = str(error.value)
    assert "does not fit this model" in message and "\n" not in message
    assert "(2, 64)" in message and "(2, 32)" in message, message


def corrupt(step_dir: pathlib.Path):
    """Overwrites every array data file of the state item with garbage of the same size."""
    data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "d" in p.parts]
    assert data_files
    for path in data_files:
        path.write_bytes(b"\xff" * path.stat().st_size)


def test_corrupted_checkpoint_falls_back_to_the_previous_one(saved, devices, tmp_path, capsys):
    directory, state = saved
    copy = tmp_path / "checkpoints"
    import shutil

    shutil.copytree(directory, copy)
    corrupt(copy / "2")
    layout, mesh = layout_on(["mesh.data=8"], devices)
    checkpointer = Checkpointer(copy, keep=3)
    with jax.set_mesh(mesh):
        restored = checkpointer.restore_latest(layout.abstract_state)
    assert restored.step == 1
    assert_states_equal(restored.state.params, state.params)
    assert "checkpoint step 2" in capsys.readouterr().err
    corrupt(copy / "1")
    with jax.set_mesh(mesh), pytest.raises(UserError, match="no readable checkpoint"):
        checkpointer.restore_latest(layout.abstract_state)
    checkpointer.close()


def flip_bytes(step_dir: pathlib.Path, item: str = "state"):
    """Flips 64 bytes in the middle of the largest array data file: a silent disk error.

    `item`: a step's `state`, or an export's `params`.
    """
    files = [p for p in (step_dir / item).rglob("*") if p.is_file()]
    # Array data lives in ocdbt.process_*/d/ (tensorstore may also inline small arrays into
    # the manifest): the largest file holds the most of it.
    assert files, f"{step_dir} holds no files"
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    largest.write_bytes(bytes(data))


def test_a_checksum_mismatch_names_the_array(saved):
    from paisoar_jax.checkpointing.checkpoint import _checksums, _verify
    from paisoar_jax.checkpointing.saved_trees import _leaf_names

    directory, state = saved
    checksums = [int(value) for value in jax.device_get(_checksums(state))]
    _verify(state, checksums, directory)  # intact
    position = list(_leaf_names(state)).index("params.final_norm.bias")
    checksums[position] ^= 1  # one bit of one array
    with pytest.raises(ValueError, match=r"params\.final_norm\.bias does not match"):
        _verify(state, checksums, directory)


def test_unwritable_checkpoint_directory_is_refused_up_front(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="not writable"):
        check_writable(blocker / "checkpoints")
    config = load_config(
        None, TINY + [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={blocker}/c"]
    )
    with pytest.raises(UserError, match="not writable"):
        train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


def run_config(run_dir, *overrides):
    return load_config(
        None,
        TINY
        + [
            f"run.dir={run_dir}",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=0",
            "checkpoint.every=2",
            "optim.warmup_steps=1",
            *overrides,
        ],
    )


def test_a_per_process_position_of_another_process_count_is_not_continued(saved, devices, tmp_path):
    """Per-process positions (a user's own grain IterDataset) belong to one process count."""
    import shutil

    directory, state = saved
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy)
    # What two processes leave: a data file per process and process_count 2 in the meta.
    data_dir, meta_file = copy / "2" / "data", copy / "2" / "meta" / "metadata"
    for process in range(2):
        (data_dir / f"process_{process}-of-2.json").write_text(json.dumps(DATA_STATE))
    (data_dir / "process_0-of-1.json").unlink()
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "input_signature": {"process_count": 2}}))
    layout, mesh = layout_on(["mesh.data=8"], devices)
    checkpointer = Checkpointer(copy, keep=3)
    with jax.set_mesh(mesh):
        restored = checkpointer.restore(2, layout.abstract_state)
    checkpointer.close()
    assert_states_equal(restored.state, state)
    assert restored.data_state is None and restored.input_changes == "process_count 2 -> 1"


def test_keeps_the_newest_and_every_kth_forever(saved, tmp_path):
    _, state = saved
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=2, keep_period=3)
    for step in range(1, 9):
        checkpointer.save(step, state, DATA_STATE, {"step": step})  # async, one at a time
    checkpointer.close()
    reopened = Checkpointer(tmp_path / "checkpoints", keep=2)
    assert reopened.steps() == [3, 6, 7, 8]
    reopened.close()


def test_a_resume_onto_other_data_is_refused_or_restarted_when_asked(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))
    other_data = ("data.source=synthetic", "train.steps=6")
    with pytest.raises(UserError) as refused:
        train(run_config(run_dir, *other_data))
    message = str(refused.value)
    assert message.startswith("checkpoint step 4 was trained on data of ") and "\n" not in message
    assert "set data.on_change=restart" in message
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4]  # untouched
    resumed = train(run_config(run_dir, *other_data, "data.on_change=restart"))
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 6
    assert (
        "data.on_change=restart, so the new data starts from its start" in capsys.readouterr().out
    )


def test_a_checkpoint_from_before_the_global_sampler_goes_on_in_the_global_order(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))
    meta_file = run_dir / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["data_position"]  # as older versions wrote it: a per-process grain state only
    meta_file.write_text(json.dumps(meta))
    grain_state = {"next_index": 4, "parent": {}}  # the form of grain's own iterator state
    (run_dir / "checkpoints" / "4" / "data" / "process_0-of-1.json").write_text(
        json.dumps(grain_state)
    )
    resumed = train(run_config(run_dir, "train.steps=6"))
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 6
    out = capsys.readouterr().out
    assert "checkpoint step 4 holds a per-process input position" in out
    assert "goes on from example 64 of the global order" in out


def test_export_skips_a_half_written_step_and_refuses_a_file_as_output(tmp_path):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))
    (run_dir / "checkpoints" / "6.orbax-checkpoint-tmp-123").mkdir()  # a save killed mid-way
    assert export(run_dir, tmp_path / "export") == 4
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="is not an empty directory"):
        export(run_dir, blocker)


def test_a_checkpoint_written_before_the_state_had_model_state_still_resumes(
    saved, devices, tmp_path
):
    """0.1 checkpoints hold step, params, opt_state and rng only; a model without BatchNorm
    restores them exactly (checked by hand against a run of commit 0684fb8 too)."""
    _, state = saved
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=3)

    @struct.dataclass
    class OlderTrainState:  # TrainState as 0.1 had it
        step: jax.Array
        params: dict
        opt_state: object
        rng: jax.Array

    older = OlderTrainState(state.step, state.params, state.opt_state, state.rng)
    checkpointer.save(2, older, DATA_STATE, {"step": 2})
    checkpointer.wait()
    layout, mesh = layout_on(["mesh.data=8"], devices)
    with jax.set_mesh(mesh):
        restored = checkpointer.restore(2, layout.abstract_state).state
    checkpointer.close()
    assert restored.model_state == {}
    assert_states_equal(restored, state)


def test_a_resume_with_another_global_batch_says_so_and_goes_on_from_the_next_example(
    tmp_path, capsys
):
    run_dir = tmp_path / "run"
    train(run_config(run_dir))  # 4 steps of 16
    capsys.readouterr()
    resumed = train(run_config(run_dir, "train.steps=6", "train.global_batch=32"))
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 6
    said = [line for line in capsys.readouterr().out.splitlines() if "global_batch" in line]
    assert said == [
        "paisoar_jax: train.global_batch changed since checkpoint step 4 (16 -> 32): the input "
        "goes on from example 64, the first not yet trained; from step 5 each step takes 32 "
        "examples, and the learning-rate schedule stays counted in steps (train.steps=6: 128 "
        "examples in all, not 96)"
    ]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[0]["global_batch"] == 16 and "global_batch_changed" not in records[0]
    assert records[4]["global_batch"] == 32 and records[4]["global_batch_changed"] == [16, 32]
    position = json.loads((run_dir / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert position["data_position"]["examples"] == 4 * 16 + 2 * 32


def test_a_global_batch_change_that_cannot_go_on_exactly_is_refused_untouched(tmp_path):
    run_dir = tmp_path / "run"
    staged = ("data.mixture=[[embedded,1]]", "data.mixture_stages=[[3,1]]")
    train(run_config(run_dir, *staged))
    with pytest.raises(UserError) as refused:
        train(run_config(run_dir, *staged, "train.steps=6", "train.global_batch=32"))
    assert str(refused.value) == (
        f"train.global_batch changed since checkpoint step 4 in {run_dir / 'checkpoints'} "
        "(16 -> 32) and data.mixture_stages begin at step numbers, which would then mean other "
        "examples: resume with train.global_batch=16, or start a new run.dir"
    )
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4]


def test_a_step_whose_array_metadata_is_gone_is_skipped_for_the_one_before(tmp_path, capsys):
    """Before: a deleted state/_METADATA read as another model's checkpoint (exit 2)."""
    run_dir = tmp_path / "run"
    train(run_config(run_dir))  # saves steps 2 and 4
    (run_dir / "checkpoints" / "4" / "state" / "_METADATA").unlink()
    resumed = train(run_config(run_dir, "train.steps=6"))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 6
    assert "checkpoint step 4" in capsys.readouterr().err


def test_a_flipped_byte_in_an_export_is_named_by_every_reader_of_weights(tmp_path):
    """load, export and hf-export's reader check what they read against the checksums
    written with it: one line naming the damaged array (init_from and Generator too:
    tests/slow/checkpointing/)."""
    import paisoar_jax
    from paisoar_jax.checkpointing.weights import read_params, verify_weights

    run_dir, exported = tmp_path / "run", tmp_path / "export"
    train(run_config(run_dir))
    export(run_dir, exported)
    read_params(exported)  # intact: read as written
    flip_bytes(exported, item="params")
    damaged = rf"{exported} is damaged: params\.\S+ does not match the checksum written with it"
    with pytest.raises(UserError, match=damaged):
        read_params(exported)  # export, hf-export (read_weights) and load read through it
    with pytest.raises(UserError, match=damaged):
        paisoar_jax.load(exported)
    # A step's params are checked against the named checksums of its meta, as an export's.
    step_dir = run_dir / "checkpoints" / "4"
    params, _ = read_params(step_dir)
    verify_weights(step_dir, {"params": params})  # as saved
    changed = jax.tree.map(lambda leaf: leaf, params)
    first = jax.tree_util.tree_flatten_with_path(changed)[0][0][0]
    changed = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 1 if path == first else x, changed
    )
    with pytest.raises(UserError, match=rf"{step_dir} is damaged: params\."):
        verify_weights(step_dir, {"params": changed})
