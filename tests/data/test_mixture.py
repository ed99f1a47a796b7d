"""data.mixture (paisoar_jax/data/mixture.py): shares, topologies, stages and resumes."""

import json
from fractions import Fraction

import numpy as np
import pytest
from conftest import resumable_run, run_module, run_records

from paisoar_jax.config import load_config
from paisoar_jax.data.mixture import MixtureBatches, apportion, open_mixture
from paisoar_jax.data.pipeline import batch_dataset
from paisoar_jax.data.sources import TokenWindows
from paisoar_jax.errors import UserError

SEQ_LEN = 8
SIZES = {"web": 900, "code": 300, "math": 50}  # math runs out (new epochs) within the tests
MARKS = {name: index for index, name in enumerate(SIZES)}


def marked_windows(name: str) -> TokenWindows:
    """A source's windows: each token is 100000 x the source's mark + the window's index."""
    windows = SIZES[name]
    window_ids = np.repeat(np.arange(windows + 1), SEQ_LEN)[: windows * SEQ_LEN + 1]
    return TokenWindows(MARKS[name] * 100_000 + window_ids, SEQ_LEN)


def mixture_config(weights: dict[str, float], stages=()):
    """The data section of a mixture of the marked sources, named by `weights`' keys."""
    mixture = [[f"arrayrecord:/{name}", weight] for name, weight in weights.items()]
    overrides = [f"data.mixture={json.dumps(mixture)}"]
    return load_config(None, [*overrides, f"data.mixture_stages={json.dumps(stages)}"]).data


def mixture_batches(weights, stages=(), batch=16, slot=(0, 1), seed=3) -> MixtureBatches:
    """The reader of a mixture of marked in-memory sources, for one process `slot` of some."""
    config = mixture_config(weights, stages)
    opened = lambda one: (marked_windows(one.source.removeprefix("arrayrecord:/")), None)
    train, _ = open_mixture(config, opened)
    return MixtureBatches(
        train, config, global_batch=batch, seed=seed, process_index=slot[0], process_count=slot[1]
    )


def rows_of(batches, count):
    """(source name, window index) of each row of the next `count` batches, batch by batch."""
    names = {mark: name for name, mark in MARKS.items()}
    read = [next(batches) for _ in range(count)]
    return [[(names[int(row[0]) // 100_000], int(row[0]) % 100_000) for row in b] for b in read]


@pytest.mark.parametrize(
    "weights",
    [{"web": 0.75, "code": 0.25}, {"web": 0.7, "code": 0.2, "math": 0.1}, {"web": 1, "code": 2}],
)
def test_each_source_gets_its_share_within_rounding_over_100_batches(weights):
    batch, total = 16, sum(weights.values())
    rows = [row for read in rows_of(mixture_batches(weights, batch=batch), 100) for row in read]
    for name, weight in weights.items():
        count = sum(1 for source, _ in rows if source == name)
        # D'Hondt: at least the lower quota, less than a row per source over it
        assert abs(count - weight / total * 100 * batch) < len(weights), (name, count)
        windows = [window for source, window in rows if source == name]
        # whole epochs read every window once (in a new shuffle each), the last one in part
        epochs, rest = divmod(len(windows), SIZES[name])
        times = np.bincount(windows, minlength=SIZES[name])
        assert set(times) <= {epochs, epochs + 1} and (times == epochs + 1).sum() == rest
        assert windows != sorted(windows)
    assert all(len(read) == batch for read in rows_of(mixture_batches(weights, batch=batch), 3))


def test_apportion_never_takes_back_a_row():
    weights = (Fraction(7, 10), Fraction(2, 10), Fraction(1, 10))
    splits = [apportion(weights, rows) for rows in range(300)]
    for rows, split in enumerate(splits):
        assert sum(split) == rows
        assert all(int(w * rows) <= seats for w, seats in zip(weights, split, strict=True))
    steps = np.diff(np.array(splits), axis=0)
    assert steps.min() >= 0


def test_processes_read_their_slices_of_the_one_global_batch():
    weights = {"web": 0.6, "code": 0.3, "math": 0.1}
    whole = rows_of(mixture_batches(weights), 20)
    for processes in (2, 4):
        slices = [
            rows_of(mixture_batches(weights, slot=(p, processes)), 20) for p in range(processes)
        ]
        joined = [sum((part[b] for part in slices), []) for b in range(20)]
        assert joined == whole
    # sources are shuffled together: the first process's slice is not one source alone
    assert len({source for source, _ in rows_of(mixture_batches(weights, slot=(0, 2)), 1)[0]}) > 1


def test_a_stage_changes_the_shares_from_its_step():
    reader = mixture_batches({"web": 0.75, "code": 0.25}, stages=[[11, 0.25, 0.75]])
    counts = [sum(source == "web" for source, _ in read) for read in rows_of(reader, 20)]
    assert counts[:10] == [12] * 10 and counts[10:] == [4] * 10


def resumed(weights, stages, saved_state, step, **options):
    reader = mixture_batches(weights, stages, **options)
    note = reader.continue_from(saved_state, step, "refuse")
    return reader, note


def test_a_resume_with_changed_weights_reads_what_a_stage_at_that_step_reads():
    before, after = {"web": 0.75, "code": 0.25}, {"web": 0.3, "code": 0.7}
    staged = rows_of(mixture_batches(before, stages=[[8, *after.values()]]), 19)
    first = mixture_batches(before)
    read = rows_of(first, 7)
    state = json.loads(json.dumps(first.get_state()))  # as the checkpoint keeps it
    reader, note = resumed(after, (), state, 7)
    assert read + rows_of(reader, 12) == staged  # batch for batch, not only the same union
    assert "every source goes on from where it was (web at example 84, code at example 28)" in note
    assert "weights from step 8 are web 0.3, code 0.7" in note
    _, note = resumed(before, [[5, 0.5, 0.5]], state, 7)  # new base weights, a stage in effect
    assert note.endswith("web 0.5, code 0.5 (data.mixture_stages' stage from step 5)")
    # the new run's own checkpoints go on exactly, with no line to say
    again, note = resumed(after, (), reader.get_state(), 19)
    assert note is None and rows_of(again, 5) == rows_of(reader, 5)


def test_a_resume_with_the_same_mixture_goes_on_exactly():
    stages = [[5, 0.5, 0.2, 0.3]]
    weights = {"web": 0.7, "code": 0.2, "math": 0.1}
    whole = rows_of(mixture_batches(weights, stages), 12)
    first = mixture_batches(weights, stages)
    read = rows_of(first, 6)
    reader, note = resumed(weights, stages, first.get_state(), 6, slot=(1, 2))
    other, _ = resumed(weights, stages, first.get_state(), 6, slot=(0, 2))
    assert note is None
    rest = [a + b for a, b in zip(rows_of(other, 6), rows_of(reader, 6), strict=True)]
    assert read + rest == whole  # on another process count too


def test_a_source_added_on_resume_starts_from_its_first_example():
    first = mixture_batches({"web": 0.5, "code": 0.5})
    rows_of(first, 4)
    reader, note = resumed({"web": 0.5, "code": 0.25, "math": 0.25}, (), first.get_state(), 4)
    assert "math is new and starts from its first example" in note
    assert "web at example 32, code at example 32" in note
    positions = reader.get_state()["positions"]
    assert positions == {"web": 32, "code": 32, "math": 0}
    rows_of(reader, 1)
    assert reader.get_state()["positions"] == {"web": 40, "code": 36, "math": 4}
    dropped, note = resumed({"web": 1.0}, (), first.get_state(), 4)
    assert "code is no longer read" in note
    mixture = 'data.mixture=[["arrayrecord:/web",0.5,python],["arrayrecord:/code",0.5]]'
    config = load_config(None, [mixture]).data  # web's data, now named python
    train, _ = open_mixture(config, lambda one: (marked_windows(one.source[13:]), None))
    renamed = MixtureBatches(train, config, global_batch=16, seed=3)
    note = renamed.continue_from(first.get_state(), 4, "refuse")
    assert "python was web" in note and renamed.get_state()["positions"]["python"] == 32
    fresh, note = resumed({"web": 0.5, "code": 0.5}, (), None, 4)  # a checkpoint without one
    assert note.startswith("checkpoint step 4 holds no position of these sources; web is new")
    assert fresh.get_state()["positions"] == {"web": 0, "code": 0}


def test_one_source_runs_on_into_a_mixture_and_back():
    source = marked_windows("web")
    alone = batch_dataset(source, global_batch=16, seed=3)
    [next(alone) for _ in range(5)]
    reader, note = resumed({"web": 0.5, "code": 0.5}, (), alone.get_state(), 5)
    assert reader.get_state()["positions"]["web"] == 80 and "web at example 80" in note
    # and the reader of one source again goes on with it from the mixture's position
    from paisoar_jax.data.pipeline import resume_position

    again = batch_dataset(source, global_batch=16, seed=3)
    rows_of(reader, 2)
    examples, note = resume_position(reader.get_state(), again, 7, 16, "refuse")
    assert examples == 96 and "data.source is its web, which goes on from example 96" in note


def test_changed_data_under_a_source_is_refused_on_resume():
    first = mixture_batches({"web": 0.5, "code": 0.5})
    rows_of(first, 2)
    state = first.get_state()
    state["sources"]["code"]["fingerprint"] = "0123456789abcdef"
    with pytest.raises(UserError, match="data.mixture: code had 300 examples .* data.on_change"):
        resumed({"web": 0.5, "code": 0.5}, (), state, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.mixture=[[embedded,-0.5],[synthetic,1]]"],
            "the weight of embedded must be >= 0, got -0.5",
        ),
        (["data.mixture=[[embedded,0],[synthetic,0]]"], "weights from step 1 are all 0"),
        (["data.mixture=[[embedded,1],[synthetic,0]]"], "synthetic has weight 0 in every stage"),
        (["data.mixture=[[embedded,1],[nosuch,1]]"], "'nosuch' is not a token source"),
        (["data.mixture=[[embedded,1],[images:/x,1]]"], "'images:/x' is not a token source"),
        (
            ["data.mixture=[[embedded,1]]", "data.mixture_stages=[[50,1],[20,2]]"],
            "the stage at step 20 comes after the one at step 50",
        ),
        (
            ["data.mixture=[[embedded,1]]", "data.mixture_stages=[[1,1]]"],
            "the step it starts at \\(>= 2\\)",
        ),
        (
            ["data.mixture=[[embedded,1]]", "data.mixture_stages=[[5,1,1]]"],
            "has 2 weights for the mixture's 1 sources",
        ),
        (["data.mixture_stages=[[5,1]]"], "changes the weights of data.mixture: set it"),
        (["data.mixture=[[embedded,1],[embedded,1]]"], "two sources are named embedded"),
        (
            ["data.mixture=[[embedded,1]]", "data.source=synthetic"],
            "data.mixture replaces data.source",
        ),
        (
            ["data.mixture=[[synthetic,1]]", "model.name=resnet"],
            "model.name=resnet reads one data.source",
        ),
        (["data.mixture=embedded"], "expected a list of \\[source, weight\\]"),
        (["data.source=hf:"], "data.source=hf: names no path: hf:DIR"),
        (['data.mixture=[[embedded,1],["arrayrecord:",1]]'], "arrayrecord: names no path"),
        (["data.hf_format=instruction", "data.hf_field=question"], "PROMPT,RESPONSE"),
    ],
)
def test_bad_mixtures_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


def test_a_bad_mixture_is_exit_status_2_with_one_line(tmp_path):
    result = run_module("train", "data.mixture=[[embedded,1],[nosuch,2]]", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "paisoar_jax.train: error: data.mixture: 'nosuch' is not a token source (embedded, "
        "synthetic, arrayrecord:DIR, hf:DIR)"
    ]


MIXTURE = ["data.mixture=[[embedded,0.75,web],[synthetic,0.25]]"]


def test_a_run_resumed_with_new_weights_trains_as_one_with_that_stage(tmp_path, capsys):
    staged = resumable_run(tmp_path / "staged", [*MIXTURE, "data.mixture_stages=[[4,1,3]]"], 6)
    resumable_run(tmp_path / "cut", MIXTURE, 3)
    capsys.readouterr()
    cut = resumable_run(tmp_path / "cut", ["data.mixture=[[embedded,1,web],[synthetic,3]]"], 6)
    assert cut == staged  # losses equal: the same batches, bit for bit
    assert "web at example 36, synthetic at example 12" in capsys.readouterr().out
    counts = [
        {key: record[key] for key in ("examples/web", "examples/synthetic")}
        for record in run_records(tmp_path / "staged")
    ]
    assert counts[2] == {"examples/web": 36, "examples/synthetic": 12}
    assert counts[5] == {"examples/web": 48, "examples/synthetic": 48}
    assert [r["examples/web"] for r in run_records(tmp_path / "cut")][3:] == [40, 44, 48]
