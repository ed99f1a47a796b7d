"""The slow tier beside tests/tools/test_doctor.py: longer runs, more settings.

`python -m paisoar_jax.doctor`: each finding comes from a real run that has the problem.
"""

import contextlib
import io
import json
import re
import statistics

from conftest import TINY, TINY_RESNET, train
from test_doctor import (  # noqa: F401 (fixtures)
    MEDIUM,
    QUIET,
    SlowBatches,
    diagnose,
    found,
    healthy_copy,
    healthy_run,
    read_records,
    train_run,
)

from paisoar_jax.config import load_config
from paisoar_jax.tasks import builtin as tasks
from paisoar_jax.tools.plan import command as plan_command


def test_a_healthy_run_has_no_findings(healthy_run):
    status, out, err = diagnose(healthy_run)
    assert status == 0 and err == ""
    assert out.strip() == f"{healthy_run}: no findings"
    losses = [record["loss"] for record in read_records(healthy_run)]
    assert losses[-1] < losses[0]  # it did train


def test_a_slow_input_pipeline_is_input_bound(tmp_path, monkeypatch, healthy_run):
    """The healthy run again, its grain pipeline given a last stage of 3 steps per batch.

    The stage takes three times the healthy run's median step (about 0.2 s on an idle
    machine), and at least 1.5 s: when tests run side by side, this run's steps may be
    slower than the healthy run's were (a CI run saw a 0.3 s step against a stage
    calibrated on a faster one, and no finding). So after the batches made ready during
    compilation the step waits most of its time for each batch.

    The stage wraps the pipeline's iterator, so it runs in the thread that feeds the
    devices and only `data.prefetch` batches are ready ahead of the step. A slow
    source instead would be read ahead by grain's 16 threads into a 500-element buffer
    during compilation, which hides it for the few steps a test can afford. (The healthy
    run comes first so that this one finds the same step compiled in the cache.)
    """
    make_batches = tasks.batch_dataset

    records = map(json.loads, (healthy_run / "metrics.jsonl").read_text().splitlines())
    delay = max(1.5, 3 * statistics.median(record["step_time_s"] for record in records))

    def slow_batches(*arguments, **keywords):
        return SlowBatches(make_batches(*arguments, **keywords), delay)

    monkeypatch.setattr(tasks, "batch_dataset", slow_batches)
    run_dir = tmp_path / "run"
    train_run(run_dir, *MEDIUM, "train.steps=6", "train.log_every=1")
    finding = found(run_dir)["input-bound"]
    share = int(re.search(r"waited for input (\d+)% of the step time", finding["evidence"])[1])
    assert share > 20, finding["evidence"]  # about 65% here; 5% makes a finding
    cores = read_records(run_dir)[0]["host_cores"]  # workers beyond them only contend
    workers = min(2, max(1, cores - 1))
    assert any(f"`data.workers={workers}`" in fix for fix in finding["fixes"])
    assert any("`data.prefetch=4`" in fix for fix in finding["fixes"])
    # The embedded corpus is in memory already: converting it would not help.
    assert not any("convert" in fix for fix in finding["fixes"])


def test_fp16_starting_far_too_high_only_finds_its_level(tmp_path, devices):
    """fp16 starting at a loss scale of 2^24: the first steps overflow until it falls to
    where steps go through. Those halvings are the scaler finding its level (before: every
    short fp16 run was told skipped-steps for them): no finding of the loss scale."""
    run_dir = tmp_path / "run"
    train_run(
        run_dir,
        "train.steps=12",
        "train.log_every=2",
        "precision.policy=fp16",
        "precision.initial_scale=16777216",
    )
    records = read_records(run_dir)
    assert records[-1]["skipped_steps"] >= 5  # it did skip the start-up's steps
    assert records[-1]["loss_scale"] < 16777216
    result = found(run_dir)
    assert not {"skipped-steps", "loss-scale-collapse", "diverging", "exploding"} & set(result)


def test_fp16_exploding_gradients_collapse_the_loss_scale(tmp_path, devices):
    """A huge step blows the params up: every later step overflows whatever the scale."""
    run_dir = tmp_path / "run"
    train_run(
        run_dir,
        "train.steps=8",
        "train.log_every=1",
        "precision.policy=fp16",
        "optim.lr=1e30",
        "optim.warmup_steps=0",
    )
    result = found(run_dir)
    assert {"loss-scale-collapse", "skipped-steps", "diverging"} <= set(result)
    scales = [record["loss_scale"] for record in read_records(run_dir)]
    assert f"-> {scales[-1]:.0f} at step 8" in result["loss-scale-collapse"]["evidence"]
    assert "`optim.lr=1e+29` (now 1e+30)" in result["diverging"]["fixes"]
    # Still falling: there is no settled scale to start from.
    assert not any("initial_scale" in fix for fix in result["skipped-steps"]["fixes"])


def test_an_image_model_run_with_its_plan_is_diagnosed(tmp_path, devices):
    """A real ResNet run with a known peak (so MFU is computed) and its own plan.json: the
    checks that read language-model keys (seq_len, attention) handle image models."""
    run_dir = tmp_path / "run"
    # ResNet-18 at full width (11.2M params: over the 10M that has an MFU floor), 16 px.
    overrides = [*TINY_RESNET, *QUIET, "model.width=64", "train.steps=4", "train.log_every=2"]
    train(load_config(None, [*overrides, "train.peak_tflops=100", f"run.dir={run_dir}"]))
    with contextlib.redirect_stdout(io.StringIO()):
        output = ["--output", str(run_dir / "plan.json")]
        assert plan_command.main(["--devices", "8", *overrides, *output]) == 0
    findings = found(run_dir)
    assert "low-mfu" in findings  # a CPU against 100 TFLOP/s
    assert not any("attention" in fix for fix in findings["low-mfu"]["fixes"])
    assert "image_size" not in findings.get("communication-bound", {}).get("evidence", "")


def test_a_data_parallel_run_bound_by_a_slow_link_is_told_about_grad_comm(healthy_copy):
    """plan --compare-grad-comm on 1 GbE for data=8: the doctor suggests compressing the
    gradients and quotes plan's projected step for each setting."""
    out, err = io.StringIO(), io.StringIO()
    arguments = ["--devices", "8", *TINY, *MEDIUM, "mesh.data=8", "mesh.tensor=1"]
    arguments += ["--link", "1gbe", "--compare-grad-comm"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan_command.main([*arguments, "--output", str(healthy_copy / "plan.json")])
    assert status == 0, err.getvalue()
    table = out.getvalue()
    assert "mesh.grad_comm side by side" in table and "all-to-all s8" not in table
    comparison = json.loads((healthy_copy / "plan.json").read_text())["grad_comm_comparison"]
    steps = {
        name: comparison[name]["links"]["1gbe"]["time_s"]["step_no_overlap"]
        for name in ("fp32", "bf16", "int8")
    }
    assert steps["int8"] < steps["bf16"] < steps["fp32"]
    assert comparison["int8"]["wire_bytes"] < 0.3 * comparison["fp32"]["wire_bytes"]
    (fix,) = [
        fix for fix in found(healthy_copy)["communication-bound"]["fixes"] if "grad_comm" in fix
    ]
    assert "`mesh.grad_comm=int8 mesh.grad_comm_error_feedback=true`" in fix
    assert f"int8 {steps['int8'] * 1e3:.3g} ms" in fix
