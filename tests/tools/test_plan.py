"""`python -m paisoar_jax.plan`: counted bytes against the formulas, on 8 CPU devices.

What XLA CPU emits for the tiny GPT (jax 0.10.2 and 0.12), read off `compiled.as_text()`:

- data parallel (data=8): gradients are all-reduced, in two combined tuple all-reduces: one
  inside the backward scan over layers (one block's gradients per trip) and one after it
  (embeddings, final norm, the loss). The tied embedding is all-reduced twice, once for the
  lookup's gradient and once for the output head's, and only then added: the reduced bytes
  are 4 x (params + vocab x width), not 4 x params.
- FSDP (fsdp=8): each block's sharded params are all-gathered inside the forward scan and
  again inside the backward scan (XLA does not keep the gathered weights between them), the
  backward leaving out the biases it does not need; the embedding is gathered twice (lookup,
  head). The gradients are all-reduced at full size and sliced: XLA CPU has no
  reduce-scatter, where XLA GPU turns all-reduce + dynamic-slice into one.
- grad_accum=2: the all-reduces sit inside the accumulation scan, so every micro-batch
  reduces its gradients (twice the bytes of one step without accumulation).
"""

import contextlib
import io
import json

import pytest
from conftest import TINY, build_run

from paisoar_jax.engine import memory
from paisoar_jax.tools.plan import command as plan_command
from paisoar_jax.tools.plan.table import _duration, format_table

FP32 = 4
# TINY's model: vocab 256 (the default), width 64, 32 tokens, 2 layers, learned positions.
VOCAB, WIDTH, SEQ_LEN, LAYERS = 256, 64, 32, 2
MESHES = {
    "data": ["mesh.data=8"],
    "fsdp": ["mesh.data=1", "mesh.fsdp=8"],
    "accumulate": ["mesh.data=8", "train.grad_accum=2"],
}


def run_plan(*arguments):
    """(exit status, stdout, stderr) of `plan --devices 8 ...`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan_command.main(["--devices", "8", *arguments])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plans(devices):
    """The --json plan of each mesh in MESHES (one compile each)."""
    results = {}
    for name, overrides in MESHES.items():
        status, out, err = run_plan("--json", *TINY, *overrides)
        assert status == 0, err
        results[name] = json.loads(out)
    return results


def block_params(result):
    """Params of one transformer block: all but embeddings and the final norm, per layer."""
    outside = VOCAB * WIDTH + SEQ_LEN * WIDTH + 2 * WIDTH
    return (result["param_count"] - outside) / LAYERS


def in_layer_loops(result, kind):
    """Bytes per step of the `kind` collectives that run once per layer (inside a scan)."""
    return sum(
        op["bytes"] * op["count"]
        for op in result["collective_ops"]
        if op["kind"] == kind and op["count"] == LAYERS
    )


def test_fsdp_gathers_params_forward_and_backward_and_reduces_gradients(plans):
    result = plans["fsdp"]
    param_bytes = FP32 * result["param_count"]
    gathered = result["collectives"]["all-gather"]["bytes"]
    # Forward and backward each gather the params; the backward skips the biases it does
    # not need and the embedding is gathered for the head too: within 5% of 2 x params.
    assert gathered == pytest.approx(2 * param_bytes, rel=0.05)
    assert in_layer_loops(result, "all-gather") == pytest.approx(
        2 * FP32 * block_params(result) * LAYERS, rel=0.05
    )
    assert all(op["group_size"] == 8 for op in result["collective_ops"])
    # Gradients: reduce-scatter on GPU; all-reduce + slice on CPU (its input bytes either way).
    reduced = sum(
        result["collectives"].get(kind, {"bytes": 0})["bytes"]
        for kind in ("all-reduce", "reduce-scatter")
    )
    assert reduced == pytest.approx(param_bytes + FP32 * VOCAB * WIDTH, rel=0.01)


def test_fsdp_divides_state_memory_by_about_the_mesh_size(plans, devices):
    replicated, split = plans["data"]["memory_bytes"], plans["fsdp"]["memory_bytes"]
    assert replicated["params"] == FP32 * plans["data"]["param_count"]
    for key in ("params", "optimizer_state", "gradients"):
        # Not quite 8: the QKV and MLP-in biases have no `embed` axis and stay replicated.
        assert 7 < replicated[key] / split[key] <= 8, key
    # The abstract count agrees with the bytes the real sharded arrays hold.
    _, _, layout, state, _ = build_run(MESHES["fsdp"], devices)
    assert memory.per_device_bytes(layout.abstract_state.params) == split["params"]
    assert memory.per_device_bytes(state.params) == split["params"]
    assert memory.per_device_bytes(state.opt_state) == split["optimizer_state"]


def test_step_time_adds_compute_and_ring_communication(plans):
    result = plans["fsdp"]
    times, link = result["time_s"], result["link"]
    assert (link["name"], link["gb_per_s"], result["peak_tflops"]) == ("nvlink", 450.0, 989.0)
    ring = {"all-reduce": 2 * 7 / 8, "all-gather": 7 / 8}
    communication = sum(
        totals["bytes"] * ring[kind] / 450e9 for kind, totals in result["collectives"].items()
    )
    assert times["communication"] == pytest.approx(communication)
    tokens = 16 * SEQ_LEN
    flops = (6 * result["param_count"] + 12 * LAYERS * WIDTH * SEQ_LEN) * tokens / 8
    assert times["compute"] == pytest.approx(flops / (989e12 * 0.5))
    assert times["step_no_overlap"] == pytest.approx(times["compute"] + times["communication"])
    efficiency = result["scaling_efficiency"]["no_overlap"]
    assert efficiency == pytest.approx(times["compute"] / times["step_no_overlap"])


def test_a_mixture_of_experts_shows_its_split_and_its_all_to_all():
    moe = ["model.name=llama", "model.experts=4", "model.mlp_width=48", "model.kv_heads=2"]
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"]
    status, out, err = run_plan("--json", *TINY, *moe, *mesh)
    assert status == 0, err
    experts = json.loads(out)["experts"]
    # 2 layers x 4 experts x (gate, up, down) of 64 x 48, over expert=2 and fsdp=2 (embed).
    expert_bytes = LAYERS * 4 * 3 * WIDTH * 48 * FP32 // 4
    assert experts["experts_per_device"] == 2
    assert experts["expert_bytes_per_device"] == expert_bytes
    assert experts["all_to_all_bytes"] > 0 and experts["all_to_all_seconds"] > 0
    table = format_table(json.loads(out))
    assert "experts: 4, 2 per token, capacity factor 0 (dropless)" in table
    assert "mesh data=2 fsdp=2 expert=2 tensor=1" in table


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["train.stepz=3"], "unknown config key train.stepz"),
        (["mesh.data=1", "mesh.fsdp=16"], "needs 16 devices, but 8 are present"),
        (["--link", "carrier-pigeon"], "--link 'carrier-pigeon'"),
        (["--devices", "4"], "jax already started in this process with 8 CPU devices"),
        (["--devices", "x"], "--devices 'x'"),
        (["--flag-effects"], "--flag-effects compiles for a GPU: give --target"),
        (["mesh.bucket_mb=-1"], "mesh.bucket_mb must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_status_2(devices, arguments, message):
    status, out, err = run_plan(*arguments)
    assert status == 2
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_output_that_cannot_be_written_is_one_line_and_status_2(devices):
    status, out, err = run_plan(*TINY, *MESHES["data"], "--output", "/dev/null/plan.json")
    assert status == 2 and out == ""
    assert err.strip() == (
        "paisoar_jax.plan: error: --output /dev/null/plan.json: cannot write it (File exists)"
    )


def test_durations_fit_their_column_down_to_a_few_bytes_collective():
    """Before: 0.853 ns printed as "0.000853 us", 11 characters, flush against the bytes."""
    assert [_duration(s) for s in (8.53e-10, 5e-8, 2e-6, 3e-3)] == [
        "0.853 ns",
        "50 ns",
        "2 us",
        "3 ms",
    ]
    assert all(len(_duration(10.0**-exponent)) <= 9 for exponent in range(1, 13))


def test_without_a_target_the_step_is_judged_against_the_limit_and_fit_finds_the_change(devices):
    """Before: 229 GiB per device printed beside train.memory_limit_gb=80, no verdict, no
    fixes, and --fit refused without --target. Now the CPU estimate is judged and --fit
    compiles each fix on it, saying that the numbers are the CPU compiler's."""
    limit = "train.memory_limit_gb=0.001"  # 1 MiB: the tiny step needs about 3
    status, out, err = run_plan(*TINY, *MESHES["data"], limit, "--fit")
    assert status == 0, err
    assert "--fit without --target: judged on the CPU compiler's estimate" in err
    assert "--fit: compiling with mesh.zero=1 (1 of " in err  # its progress, one per compile
    assert "does not fit 1.02 MiB (train.memory_limit_gb)" in out
    assert "fixes, in the order to try them" in out and "    mesh.zero=1  shard" in out
    change = out.split("smallest change that fits (add to the command line): ")[1].split()
    assert change and all("=" in override for override in change)
    status, out, err = run_plan(*TINY, *MESHES["data"])  # the host's share: it fits
    assert "fits " in out and "this host's memory over 8 device(s)" in out
