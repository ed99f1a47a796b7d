"""`python -m paisoar_jax.doctor`: each finding comes from a real run that has the problem.

The runs are short trainings through `paisoar_jax.run.loop.run` in this process, on the 8
simulated CPU devices of conftest.py. Where a finding rests on numbers a CPU run cannot
produce (MFU needs a known peak, device memory needs memory_stats, recompilations are not
counted by the loop yet), the test takes a real run's files and edits only those fields;
its docstring says which.
"""

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import time

import pytest
from conftest import PYTHON, TINY, subprocess_env, train

from paisoar_jax.config import load_config
from paisoar_jax.errors import DivergenceError
from paisoar_jax.tools.doctor import command as doctor
from paisoar_jax.tools.doctor import findings
from paisoar_jax.tools.plan import command as plan_command

QUIET = ["train.eval_every=0", "checkpoint.enabled=false"]
# 12.75M params (over the 10M that has an MFU floor), split over 8 devices by tensor
# parallelism: 0.2 s a step on 2 cores, where data parallelism would take 1-2 s.
MEDIUM = [
    "model.width=512",
    "model.layers=4",
    "model.heads=8",
    "model.seq_len=8",
    "train.global_batch=8",
    "mesh.data=1",
    "mesh.tensor=8",
    "optim.lr=1e-3",
]
OVERRIDE = re.compile(r"`([a-z_]+\.[a-z_]+=[^`\s]+)`")


def train_run(run_dir, *overrides):
    """Trains TINY + overrides into run_dir; returns the summary."""
    return train(load_config(None, [*TINY, *QUIET, f"run.dir={run_dir}", *overrides]))


def diagnose(run_dir, *arguments):
    """(exit status, stdout, stderr) of the doctor on run_dir, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = doctor.main([str(run_dir), *arguments])
    return status, out.getvalue(), err.getvalue()


def found(run_dir):
    """{name: finding dict} of the doctor's --json answer for run_dir."""
    status, out, err = diagnose(run_dir, "--json")
    assert status == 0, err
    return {finding["name"]: finding for finding in json.loads(out)["findings"]}


def read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rewrite_records(run_dir, edit):
    """Applies edit(index, record) to every record of run_dir's metrics.jsonl."""
    records = read_records(run_dir)
    for index, record in enumerate(records):
        edit(index, record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, devices):
    """A real 6-step run of a 12.75M-param GPT that trains normally."""
    run_dir = tmp_path_factory.mktemp("healthy") / "run"
    train_run(run_dir, *MEDIUM, "train.steps=6", "train.log_every=1")
    return run_dir


@pytest.fixture
def healthy_copy(healthy_run, tmp_path):
    """A copy of the healthy run's directory, to edit."""
    return shutil.copytree(healthy_run, tmp_path / "copy")


def test_the_command_line_reads_a_run_directory(healthy_run, tmp_path):
    completed = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.doctor", str(healthy_run)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().endswith("no findings")


def test_an_input_bound_fit_run_is_told_to_time_its_own_data(tmp_path):
    """Before: the fix was `bench --data-only` with the run's data.*, which times the
    embedded corpus, not the data a fit program gave."""
    records = [
        {"step": step, "step_time_s": 0.1, "data_wait_frac": 0.5, "platform": "gpu"}
        for step in (1, 2, 3)
    ]
    config = load_config(None, [f"run.dir={tmp_path}"])
    for by_fit, wanted in ((True, "paisoar_jax.bench_fit(...)"), (False, "--data-only")):
        finding = findings.input_bound(findings.Run(tmp_path, config, records, None, by_fit))
        assert any(wanted in fix for fix in finding.fixes), finding.fixes
        # Workers import the program again: a fit program needs its main guard for them.
        guarded = ["if __name__" in fix for fix in finding.fixes if "data.workers=" in fix]
        assert guarded == [by_fit], finding.fixes


def test_a_plan_without_the_compute_makes_no_communication_finding(tmp_path):
    """A model of one's own planned without flops_per_example: its "step" is the collectives
    alone, not a step that communication bounds."""
    config = load_config(None, [f"run.dir={tmp_path}"])
    times = {"compute": 0.0, "communication": 0.01, "step_no_overlap": 0.01}
    plan = {"time_s": times, "flops_per_device": 0.0}
    records = [{"step": 1, "loss": 1.0}]
    assert findings.communication_bound(findings.Run(tmp_path, config, records, plan)) is None


def test_a_pipelined_run_is_not_told_to_compress_its_gradients(tmp_path):
    """mesh.grad_comm does not combine with pipeline stages yet: before, the doctor offered it
    to a communication-bound pipelined run, and the run then refused it."""
    times = {"compute": 0.1, "communication": 0.2, "step_no_overlap": 0.3}
    plan = {"time_s": times, "flops_per_device": 1e12, "mesh": {"data": 4}}
    records = [{"step": 1, "loss": 1.0}]
    offered = {}
    for name, stages in (
        ("pipelined", ["mesh.stage=2", "train.pipeline_microbatches=2"]),
        ("flat", []),
    ):
        config = load_config(None, [*TINY, "mesh.data=4", *stages, f"run.dir={tmp_path}"])
        finding = findings.communication_bound(findings.Run(tmp_path, config, records, plan))
        offered[name] = any("grad_comm=" in fix for fix in finding.fixes)
    assert offered == {"pipelined": False, "flat": True}


class SlowBatches:
    """Batches that take `delay` seconds each (decoding, augmentation, a slow tokenizer)."""

    def __init__(self, batches, delay: float):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(self.delay)
        return next(self.batches)

    def get_state(self):
        return self.batches.get_state()


def test_a_learning_rate_that_diverges(tmp_path, healthy_run):
    """optim.lr=1e4 with no loss scaler: the loop stops with DivergenceError.

    Until the loop writes the record with the non-finite loss before it stops, the run's
    last records show the loss exploding (5.7 -> 6e7 -> 5e10); after that change the last
    record's loss is NaN. The doctor reports both as a divergence, with the evidence of each.
    (After the healthy run, whose compiled init this run reuses.)
    """
    run_dir = tmp_path / "run"
    with pytest.raises(DivergenceError):
        train_run(
            run_dir,
            *MEDIUM,
            "train.steps=12",
            "train.log_every=1",
            "optim.lr=1e4",
            "precision.loss_scale=none",
        )
    records = read_records(run_dir)
    if math.isfinite(records[-1]["loss"]):  # a finite explosion (tests/tools/test_doctor_loss.py)
        finding = found(run_dir)["exploding"]
        assert finding["fixes"][0].startswith("`optim.lr=1000`: the loss rose")
    else:
        finding = found(run_dir)["diverging"]
        step = records[-1]["step"]
        assert finding["evidence"].startswith(f"the loss is nan at step {step}")
        assert "`optim.lr=1000` (now 10000)" in finding["fixes"]


def test_low_mfu_for_the_model_size(healthy_copy):
    """The healthy run's records with `mfu` set (a CPU has no known peak, so it is null).

    The model has 12.75M params (counted abstractly from config.yaml: no plan.json), whose
    floor is 5%: 2% is reported, 8% is not.
    """
    rewrite_records(healthy_copy, lambda index, record: record.update(mfu=0.08))
    assert "low-mfu" not in found(healthy_copy)
    rewrite_records(healthy_copy, lambda index, record: record.update(mfu=0.02))
    finding = found(healthy_copy)["low-mfu"]
    assert finding["evidence"].startswith("median MFU 2.0% over 5 log steps for 12.7M params")
    assert "reaches 5.0% or more" in finding["evidence"]
    assert any(fix.startswith("`precision.policy=bf16`") for fix in finding["fixes"])


def test_communication_bound_from_the_runs_plan(healthy_copy):
    """plan.json from `plan --output` for the run's own config: nothing is edited.

    Tensor parallelism over 8 devices at 64 tokens a step all-reduces far more than it
    computes, on any link: the projected step is almost all communication.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        output = ["--output", str(healthy_copy / "plan.json")]
        status = plan_command.main(["--devices", "8", *TINY, *MEDIUM, "--json", *output])
    assert status == 0, err.getvalue()
    written = json.loads((healthy_copy / "plan.json").read_text())
    assert written == json.loads(out.getvalue())  # the file holds what --json prints
    times = written["time_s"]
    share = times["communication"] / times["step_no_overlap"]
    assert share > 0.3
    finding = found(healthy_copy)["communication-bound"]
    assert f"{share:.0%} of the step without overlap" in finding["evidence"]
    assert "note: plan.json was made for" not in finding["evidence"]
    assert any(fix.startswith("`mesh.tensor=1`") for fix in finding["fixes"])
    bucket = "fewer, larger collectives: `mesh.bucket_mb=256`"
    assert any(fix.startswith(bucket) for fix in finding["fixes"])


@pytest.mark.parametrize(
    "peak_share, expected",
    [(0.3, "memory-headroom"), (0.7, None), (0.95, "memory-near-limit")],
)
def test_memory_headroom_and_memory_near_the_limit(healthy_copy, peak_share, expected):
    """The healthy run's records with device memory added (null on CPU), limit 80 GiB."""
    limit = 80 * 2**30

    def add_memory(index, record):
        peak = int(peak_share * limit * (index + 1) / 6)  # the peak grows to its last value
        record.update(memory_peak_bytes=peak, memory_in_use_bytes=peak, memory_limit_bytes=limit)

    rewrite_records(healthy_copy, add_memory)
    result = found(healthy_copy)
    names = {"memory-headroom", "memory-near-limit"} & set(result)
    assert names == ({expected} if expected else set())
    if expected == "memory-headroom":
        assert result[expected]["evidence"].startswith("peak device memory 24 GiB of 80 GiB (30%)")
        assert any(fix.startswith("`train.global_batch=16`") for fix in result[expected]["fixes"])
    if expected == "memory-near-limit":
        fixes = result[expected]["fixes"]
        assert fixes[0].startswith("`remat.policy=dots`")
        # mesh.data=1: ZeRO has nothing to shard over, so it is not offered.
        assert not any("mesh.zero" in fix for fix in fixes)


@pytest.mark.parametrize(
    "needed_gib, fit_change, expected",
    [(40, None, "memory-headroom"), (160, ["remat.policy=full"], "memory-near-limit")],
)
def test_without_a_measured_peak_the_gpu_plan_is_judged(needed_gib, fit_change, expected):
    """A CPU try-out (no memory figures) beside `plan --target h200 [--fit] --output`."""
    config = load_config(None, [*TINY, "mesh.data=1"])
    records = [{"step": 1, "loss": 3.0, "step_time_s": 0.1}]
    limit = 141 * 2**30
    plan_result = {
        "devices": 8,
        "memory_bytes": {"total": needed_gib * 2**30},
        "target": {"name": "h200", "device_memory_bytes": limit, "limit_bytes": limit},
    }
    if fit_change:
        plan_result["fit"] = {"change": fit_change}
    run = findings.Run(config.run_dir, config, records, plan_result)
    result = {finding.name: finding for finding in doctor.diagnose(run)}
    finding = result[expected]
    share = f"{needed_gib * 2**30 / limit:.0%}"
    assert finding.evidence.startswith(
        f"the plan for 8 x h200 (plan.json: compiled for the GPU, not run) needs "
        f"{needed_gib} GiB of 141 GiB per device ({share})"
    ), finding.evidence
    if fit_change:
        assert finding.title == "device memory is over its limit"
        assert finding.fixes[0].startswith("`remat.policy=full`: the smallest change the GPU")


def test_recompilations(healthy_copy):
    """The healthy run's records with `recompiles` added (the loop does not count them yet)."""
    rewrite_records(healthy_copy, lambda index, record: record.update(recompiles=int(index >= 2)))
    finding = found(healthy_copy)["recompiles"]
    assert finding["evidence"].startswith("1 recompilation by step 6, the first logged at step 3")
    assert "`model.seq_len=8`" in finding["fixes"][0]


def every_check_firing(config_overrides):
    """A Run of the given config whose records and plan make every check fire."""
    config = load_config(None, [*TINY, "train.skip_spikes=4", *config_overrides])
    records = [
        {
            "step": step,
            "loss": loss,
            "loss_scale": 2.0 ** (15 - step),
            "skipped_steps": step - 1,  # none in the first interval: the scale had settled
            "skipped_spikes": step // 3,  # (train.skip_spikes: one in steps 3 and 4)
            "step_time_s": 0.1,
            "data_wait_frac": 0.5,
            "mfu": 0.01,
            "memory_peak_bytes": 79 * 2**30,
            "memory_limit_bytes": 80 * 2**30,
            "recompiles": 1,
        }
        for step, loss in enumerate([3.0, 2.0, 2.5, 3.0, math.nan], start=1)
    ]
    context = {}
    if config.mesh.contexts > 1:  # a slice's transfer outlasts the attention to it
        context = {
            "context": {
                "context_shards": config.mesh.contexts,
                "tokens_per_device": config.model.seq_len // config.mesh.contexts,
                "hop_seconds": 2e-5,
                "hop_attention_seconds": 1e-5,
                "min_tokens_per_device": 2 * config.model.seq_len // config.mesh.contexts,
            }
        }
    if config.model.experts:  # layer 1's experts imbalanced and dropping
        for record in records:
            record.update({"moe_layer_load/0": 1.1, "moe_layer_load/1": 3.0})
            record.update({"moe_layer_dropped/0": 0.0, "moe_layer_dropped/1": 0.2})
        for step, record in enumerate(records):  # layer 1's router collapsing
            record.update({"moe_layer_entropy/0": 0.9, "moe_layer_entropy/1": 0.9 - 0.2 * step})
    plan_result = {
        "param_count": 2 * 10**9,
        "flops_per_device": 1e12,
        "time_s": {"compute": 0.1, "communication": 0.2, "step_no_overlap": 0.3},
        "collectives": {"all-reduce": {"count": 2, "bytes": 2**30, "seconds": 0.2}},
        "link": {"name": "infiniband", "gb_per_s": 50.0},
        **context,
    }
    # Measured beside the records: a step that did not fit once, and the scaling of the step.
    config.run_dir.mkdir(parents=True, exist_ok=True)
    oom_fixes = [{"override": "remat.policy=full", "why": "recompute activations"}]
    oom_record = {
        "step": 1,
        "report": "out of memory: the train step needs 9 GiB",
        "fixes": oom_fixes,
    }
    (config.run_dir / "out_of_memory.json").write_text(json.dumps(oom_record))
    row = {"global_batch": 16, "compute_s": 0.01, "input_wait_s": 0.0, "host_s": 0.0}
    strong = [
        {**row, "devices": 1, "step_s": 0.01, "collectives_s": 0.0, "efficiency": 1.0},
        {**row, "devices": 8, "step_s": 0.04, "collectives_s": 0.03, "efficiency": 0.03},
    ]
    scaling = {"platform": "gpu", "device_kind": "H100", "strong": strong, "weak": []}
    (config.run_dir / "scaling.json").write_text(json.dumps(scaling))
    return findings.Run(config.run_dir, config, records, plan_result)


@pytest.mark.parametrize(
    "config_overrides",
    [
        ["precision.loss_scale=dynamic", "mesh.stage=2", "train.pipeline_microbatches=2"],
        [
            "mesh.stage=2",
            "train.pipeline_microbatches=2",
            "precision.policy=fp16",
            "remat.policy=dots",
            "mesh.zero=3",
            "mesh.tensor=2",
            "optim.clip_norm=0",
            "model.attention=xla",
            "train.grad_accum=2",
        ],
        [
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "mesh.stage=2",
            "train.pipeline_microbatches=2",
            "precision.policy=bf16",
            "precision.loss_scale=dynamic",
            "remat.policy=full",
        ],
        ["model.name=llama", "model.experts=4", "precision.policy=fp16"],
        ["precision.loss_scale=dynamic", "mesh.stage=2", "train.pipeline_microbatches=2"]
        + ["model.name=llama", "mesh.context=4", "model.context_attention=ring"],
    ],
)
def test_every_fix_names_real_config_keys(config_overrides, tmp_path):
    run = every_check_firing([f"run.dir={tmp_path}", *config_overrides])
    results = doctor.diagnose(run)
    names = {finding.name for finding in results}
    expected = {check.__name__.replace("_", "-") for check in doctor.CHECKS}
    expected = expected - {"memory-headroom"} | {"memory-near-limit"}
    # A mixture of experts does not pipeline; the MoE checks need a MoE's records.
    moe = ["model.experts=4"] if run.config.model.experts else []
    moe_checks = {"expert-imbalance", "dropped-tokens", "collapsing-router"}
    expected -= {"pipeline-bubble"} if moe else moe_checks
    expected -= set() if run.config.mesh.contexts > 1 else {"context-bound"}
    # A loss not finite before any update, and no gradient at all, rule out the rest: they
    # fire alone (tests/tasks/test_own_model_mistakes.py). A loss that exploded, or does
    # not fall, rules out this one that fell, then rose (their own runs below).
    expected -= {"bad-inputs", "no-gradient", "exploding", "not-learning"}
    assert names == expected
    for finding in results:
        assert any(OVERRIDE.search(fix) for fix in finding.fixes), finding
        for fix in finding.fixes:  # the overrides of one fix go together
            load_config(None, [*moe, *OVERRIDE.findall(fix)])  # UserError: unknown key or value


def test_an_imbalanced_and_dropping_moe_layer_is_named(tmp_path):
    run = every_check_firing([f"run.dir={tmp_path}", "model.name=llama", "model.experts=4"])
    results = {finding.name: finding for finding in doctor.diagnose(run)}
    imbalance, drops = results["expert-imbalance"], results["dropped-tokens"]
    assert imbalance.title == "the experts of layer 1 are imbalanced"
    assert imbalance.evidence.startswith("layer 1's busiest expert takes 3.0x the mean")
    assert imbalance.fixes[0].startswith("`model.router_aux_loss=0.02`")
    assert imbalance.fixes[1].startswith("`model.router_bias_rate=0.001`")
    assert "`model.expert_capacity_factor=1.25`" in imbalance.fixes[2]  # dropless now
    assert drops.evidence.startswith("layer 1 drops 20% of its expert choices")
    assert drops.fixes[0].startswith("`model.expert_capacity_factor=0.5`")
    collapsing = results["collapsing-router"]
    assert collapsing.title == "the router of layer 1 is collapsing"
    assert collapsing.evidence.startswith("layer 1's router entropy fell from 0.90 to 0.30")
    assert "model.router_z_loss=0.001" in collapsing.fixes[1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda run_dir: None, "no such run directory"),
        (lambda run_dir: run_dir.mkdir(), "is not a run directory (no config.yaml)"),
        (lambda run_dir: (run_dir / "metrics.jsonl").unlink(), "cannot read"),
        (lambda run_dir: (run_dir / "metrics.jsonl").write_text("not json\n"), ":1 is not a"),
        (lambda run_dir: (run_dir / "metrics.jsonl").write_text(""), "holds no records yet"),
        (lambda run_dir: (run_dir / "plan.json").write_text("{"), "cannot read"),
    ],
)
def test_an_unreadable_run_is_one_line_and_status_2(healthy_run, tmp_path, make, message):
    run_dir = tmp_path / "run"
    if "config.yaml" not in message and "no such" not in message:
        shutil.copytree(healthy_run, run_dir)
    make(run_dir)
    status, out, err = diagnose(run_dir)
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paisoar_jax.doctor: error: ")
    assert message in lines[0]


def test_a_context_split_that_communication_bounds(healthy_copy):
    """plan.json of an 8-way context split of 32 tokens (4 a device) over 1 GbE."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        arguments = ["--devices", "8", *TINY, "mesh.data=1", "mesh.context=8", "--link", "1gbe"]
        status = plan_command.main([*arguments, "--output", str(healthy_copy / "plan.json")])
    assert status == 0, err.getvalue()
    finding = found(healthy_copy)["context-bound"]
    assert finding["evidence"].startswith("mesh.context=8 leaves 4 tokens per device")
    assert finding["fixes"][0].startswith("`mesh.context=")
