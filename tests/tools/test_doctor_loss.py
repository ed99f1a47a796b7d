"""The doctor judges a run from what it measured: the loss, an out-of-memory stop, the input.

Each finding is induced in a tiny run of this process (the 8 simulated CPU devices) and a
healthy run of the same kind gets none: a loss that exploded (fp32, bf16 and fp16 at too
high a learning rate), one that does not move, a healthy fp16 run whose loss scale only
found its level, a step over train.memory_limit_gb. The first fix is the one for the cause.
"""

import json

import pytest
from conftest import TINY, train

from paisoar_jax.config import load_config
from paisoar_jax.run.oom import OutOfMemoryError
from paisoar_jax.tools.doctor import command as doctor
from paisoar_jax.tools.doctor.findings import Run

SHORT = [*TINY, "train.eval_every=0", "checkpoint.enabled=false", "train.steps=16"]
SHORT += ["train.log_every=2", "train.sample_bytes=0", "run.progress=false"]
LOSS_FINDINGS = {"exploding", "diverging", "not-learning", "skipped-steps", "loss-scale-collapse"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, devices):
    """{name: the doctor's findings} of tiny runs, each with its problem (or none)."""
    settings = {
        "healthy": [],
        "healthy-fp16": ["precision.policy=fp16"],
        "exploding": ["optim.lr=30", "precision.loss_scale=none"],
        "exploding-bf16": ["precision.policy=bf16", "optim.lr=10"],
        "exploding-fp16": ["precision.policy=fp16", "optim.lr=30"],
        "unmoved": ["optim.lr=1e-9"],
    }
    found = {}
    for name, overrides in settings.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        train(load_config(None, [*SHORT, f"run.dir={run_dir}", *overrides]))
        found[name] = {
            finding.name: finding for finding in doctor.diagnose(doctor.load_run(run_dir))
        }
    return found


def test_healthy_runs_have_no_loss_finding(runs):
    """The fp16 run's scale halved from 32768 as it started: its level, not a problem."""
    for name in ("healthy", "healthy-fp16"):
        assert not LOSS_FINDINGS & set(runs[name]), (name, list(runs[name]))


@pytest.mark.parametrize("name", ["exploding", "exploding-bf16", "exploding-fp16"])
def test_a_finite_explosion_is_named_with_the_learning_rate_first(runs, name):
    """fp32 at lr 30, bf16 at lr 10 (before: `no findings`, at lr 1 too), fp16 at lr 30
    (before: the loss scale's settings first, the learning rate third)."""
    found = runs[name]
    exploding = found["exploding"]
    assert exploding.evidence.startswith("the loss went from 5.4")
    assert "(the first step, before any update)" in exploding.evidence
    assert exploding.fixes[0].startswith("`optim.lr=")
    assert "the loss rose within the first steps" in exploding.fixes[0]
    assert "diverging" not in found  # said once
    if name == "exploding-fp16":
        assert found["skipped-steps"].fixes[0].startswith("`optim.lr=3`")
        assert found["exploding"].fixes[-1].startswith("`precision.policy=bf16`")


def test_a_loss_that_does_not_move_is_told_to_raise_the_learning_rate(runs):
    finding = runs["unmoved"]["not-learning"]
    assert "it does not fall" in finding.evidence and "(chance: 5.545)" in finding.evidence
    assert finding.fixes[0].startswith("`optim.lr=1e-08` (now 1e-09)")
    assert "exploding" not in runs["unmoved"]


def test_a_loss_that_settles_back_is_told_to_lower_the_learning_rate(tmp_path):
    """A collapse: the loss moved, then came back to where it started (made by hand)."""
    config = load_config(None, [*SHORT, f"run.dir={tmp_path}"])
    losses = [4.0, 5.3, 5.5, 5.45, 5.5]
    records = [{"step": 2 * (index + 1), "loss": loss} for index, loss in enumerate(losses)]
    records[0]["first_step_loss"] = 5.4
    finding = doctor.diagnose(Run(tmp_path, config, records, None))[0]
    assert finding.name == "not-learning"
    assert finding.fixes[0].startswith("`optim.lr=0.0003`")


def test_a_run_that_ran_out_of_memory_is_diagnosed_from_its_record(tmp_path, devices):
    """Before: `cannot read .../metrics.jsonl`. The run leaves out_of_memory.json."""
    run_dir = tmp_path / "run"
    with pytest.raises(OutOfMemoryError) as raised:
        train(load_config(None, [*SHORT, f"run.dir={run_dir}", "train.memory_limit_gb=0.0001"]))
    record = json.loads((run_dir / "out_of_memory.json").read_text())
    assert record["step"] == 1 and record["fixes"]
    [finding] = doctor.diagnose(doctor.load_run(run_dir))
    assert finding.name == "out-of-memory"
    assert finding.evidence.startswith("the run stopped at step 1: the train step needs")
    first = raised.value.fixes[0]
    assert finding.fixes[0] == f"`{first[0]}`: {first[1]}"
    # The same run, fitting now: its first step removes the old record.
    train(load_config(None, [*SHORT, f"run.dir={run_dir}", "train.steps=2"]))
    assert not (run_dir / "out_of_memory.json").exists()


@pytest.mark.parametrize(("cores", "workers", "proposed"), [(2, 0, 1), (2, 1, None), (16, 2, 4)])
def test_the_input_workers_proposed_fit_the_cores_the_run_had(tmp_path, cores, workers, proposed):
    """Before: data.workers=8 on a 2-core machine. The first record says the run's cores."""
    config = load_config(None, [*SHORT, f"run.dir={tmp_path}", f"data.workers={workers}"])
    records = [
        {"step": step, "loss": 5.0 - step / 10, "step_time_s": 0.1, "data_wait_frac": 0.6}
        for step in (2, 4, 6)
    ]
    records[0] |= {"host_cores": cores, "platform": "cpu"}
    finding = doctor.diagnose(Run(tmp_path, config, records, None))
    fixes = {one.name: one for one in finding}["input-bound"].fixes
    if proposed is None:
        assert not any("`data.workers=" in fix for fix in fixes)
        assert fixes[-1].startswith(f"more cores for the input: data.workers={workers}")
    else:
        assert fixes[0].startswith(f"`data.workers={proposed}`")


def test_a_fine_tune_or_skipped_updates_are_not_called_not_learning(tmp_path):
    """A fine-tune's loss starts trained (checkpoint.init_from); a run that skipped most of
    its updates did not learn because of the skips (skipped-steps says so)."""
    records = [{"step": step, "loss": 2.0, "skipped_steps": 0} for step in (2, 4, 6, 8)]
    records[0]["first_step_loss"] = 2.0

    def names(*overrides):
        config = load_config(None, [*SHORT, f"run.dir={tmp_path}", *overrides])
        return {one.name for one in doctor.diagnose(Run(tmp_path, config, records, None))}

    assert "not-learning" in names()
    assert "not-learning" not in names(f"checkpoint.init_from={tmp_path}")
    for record in records:
        record["skipped_steps"] = record["step"] - 1
    assert "not-learning" not in names()
