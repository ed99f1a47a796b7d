"""`python -m paisoar_jax.bench --scaling`: the step measured on 1, 2, 4 and 8 devices.

On the 8 simulated CPU devices of conftest.py, in this process: strong and weak rows for
each count, their parts from the profile adding up to no more than the step, scaling.json
beside the run, and the doctor's verdict read from it (on CPUs: expected).
"""

import contextlib
import io
import json

import pytest
from conftest import TINY, train

from paisoar_jax.config import FIT_CONFIG_NOTE, load_config
from paisoar_jax.tools import bench
from paisoar_jax.tools.doctor import command as doctor
from paisoar_jax.tools.scaling import device_counts, scaled_overrides

SMALL = [*TINY, "train.global_batch=16", "run.progress=false"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, devices):
    """(the table printed, scaling.json) of a tiny GPT's step on 1 .. 8 devices."""
    run_dir = tmp_path_factory.mktemp("scaling") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = bench.main(["--scaling", "--steps", "3", *SMALL, f"run.dir={run_dir}"])
    assert status == 0
    return run_dir, out.getvalue(), json.loads((run_dir / "scaling.json").read_text())


def test_strong_and_weak_scaling_on_one_to_eight_devices(measured):
    _, table, summary = measured
    for mode in ("strong", "weak"):
        rows = summary[mode]
        assert [row["devices"] for row in rows] == [1, 2, 4, 8]
        assert rows[0]["efficiency"] == 1.0
        batches = [row["global_batch"] for row in rows]
        assert batches == ([16] * 4 if mode == "strong" else [2, 4, 8, 16])
        for row in rows:
            parts = row["compute_s"] + row["collectives_s"] + row["input_wait_s"] + row["host_s"]
            assert row["step_s"] > 0 and parts <= row["step_s"] * 1.05 + 1e-4
            assert 0 < row["efficiency"]
        assert rows[0]["collectives_s"] == 0.0  # one device exchanges nothing
        assert rows[0]["collective_bytes"] == 0 and rows[0]["projected_efficiency"] == 1.0
        assert all(row["collective_bytes"] > 0 for row in rows[1:])  # plan's count of them
        assert all(0 < row["projected_efficiency"] <= 1.0 for row in rows)
        assert any(row["collectives_s"] > 0 for row in rows[1:])  # the profile saw them
        for row in rows:
            assert f"{mode:<7}{row['devices']:>8}{row['global_batch']:>7}" in table
    assert summary["platform"] == "cpu" and summary["per_device_batch"] == 2
    # The plot extra's matplotlib (in the test extra) draws scaling.png beside the JSON.
    run_dir = measured[0]
    assert summary_plot(run_dir).startswith(b"\x89PNG")


def summary_plot(run_dir):
    """The bytes of the run's scaling.png."""
    return (run_dir / "scaling.png").read_bytes()


def test_the_doctor_reads_the_measured_scaling(measured, tmp_path):
    """Beside a run's metrics: on CPUs poor strong scaling is named, and said expected."""
    run_dir, _, summary = measured
    train(
        load_config(
            None, [*SMALL, "train.steps=2", "checkpoint.enabled=false", f"run.dir={run_dir}"]
        )
    )
    found = {one.name: one for one in doctor.diagnose(doctor.load_run(run_dir))}
    if summary["strong"][-1]["efficiency"] < 0.5:
        finding = found["poor-scaling"]
        assert finding.evidence.startswith("measured (scaling.json, cpu)")
        assert finding.fixes[0].startswith("expected on CPUs")
    # Known numbers, the finding said whatever this machine measured: 20% at 8 devices.
    for row, efficiency in zip(summary["strong"], (1.0, 0.6, 0.4, 0.2), strict=True):
        row["efficiency"] = efficiency
    (run_dir / "scaling.json").write_text(json.dumps(summary))
    finding = {one.name: one for one in doctor.diagnose(doctor.load_run(run_dir))}["poor-scaling"]
    assert "a strong-scaling efficiency of 20%" in finding.evidence
    assert finding.fixes[0].startswith("expected on CPUs")
    assert any(fix.startswith("`train.global_batch=32`") for fix in finding.fixes)
    # The same run with a step that scales (its numbers made so): no finding.
    for row in summary["strong"]:
        row["step_s"], row["efficiency"] = 0.1 / row["devices"], 1.0
    (run_dir / "scaling.json").write_text(json.dumps(summary))
    assert "poor-scaling" not in {one.name for one in doctor.diagnose(doctor.load_run(run_dir))}


def test_the_counts_and_the_mesh_each_count_runs_on():
    assert device_counts(8) == [1, 2, 4, 8] and device_counts(6) == [1, 2, 4, 6]
    config = load_config(None, [*SMALL, "mesh.fsdp=2", "mesh.data=4"])
    assert "mesh.fsdp=2" in scaled_overrides(config, 4, 16)
    assert "mesh.data=2" in scaled_overrides(config, 4, 16)
    assert "mesh.fsdp=1" in scaled_overrides(config, 1, 16)  # fsdp=2 does not fit one device


def test_the_doctor_measures_the_scaling_of_a_run_on_request(tmp_path, devices):
    """`doctor RUN_DIR --measure-scaling`: bench --scaling on the run's config, then the
    verdict from it; a run of fit's is told to measure through bench_fit."""
    run_dir = tmp_path / "run"
    settings = [*SMALL, "train.steps=2", "checkpoint.enabled=false", f"run.dir={run_dir}"]
    train(load_config(None, settings))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert doctor.main([str(run_dir), "--measure-scaling", "--json"]) == 0
    summary = json.loads((run_dir / "scaling.json").read_text())
    assert [row["devices"] for row in summary["strong"]] == [1, 2, 4, 8]
    names = {finding["name"] for finding in json.loads(out.getvalue())["findings"]}
    assert ("poor-scaling" in names) == (summary["strong"][-1]["efficiency"] < 0.5)
    config_yaml = run_dir / "config.yaml"  # as fit writes it: the model was the program's
    config_yaml.write_text(FIT_CONFIG_NOTE + config_yaml.read_text())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert doctor.main([str(run_dir), "--measure-scaling"]) == 2
    assert "was trained by paisoar_jax.fit: measure its scaling with" in err.getvalue()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--scaling", "--steps", "0"], "--steps 0: time at least one step"),
        (["--scaling", "--data-only"], "--scaling and --data-only: choose one"),
        (["--scaling", "train.global_batch=12"], "does not split over the 8 devices"),
    ],
)
def test_a_scaling_that_cannot_be_measured_is_one_line(devices, tmp_path, arguments, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = bench.main([*TINY, *arguments, f"run.dir={tmp_path}"])
    assert status == 2 and message in err.getvalue(), err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1
