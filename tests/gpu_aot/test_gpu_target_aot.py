"""The gpu_aot tier beside tests/tools/test_gpu_target.py: what needs the CUDA plugin.

Steps compiled for an 8 x H200 target on this CPU machine (tools/plan/gpu_target.py): what the GPU
compiler makes of them. The gpu_aot tier (`python -m pytest -m gpu_aot`, with the gpu-aot
extra's CUDA plugin); the first tests run in any environment.
"""

import json
import math
import re
import subprocess

import pytest
from conftest import PYTHON, REPO, run_module, subprocess_env
from test_gpu_target import (
    CONFIGS,
    PEER_1B_DONATED_TEMPORARIES,
    PEER_1B_DONATED_TOTAL,
    PEER_TEMPORARIES,
    target_plan,
)

from paisoar_jax.tools.plan import gpu_target

# Unrolled real-size stacks (their blocks differ) compile one pattern's worth of layers here:
# the whole stack took 377 s (gemma3_27b) and 163 s (gpt_oss_20b) on 2 cores; its full
# plan is in benchmarks/RESULTS.md.
ONE_PATTERN = {"gemma3_27b": ["model.layers=6"], "gpt_oss_20b": ["model.layers=2"]}
ONE_PATTERN["gpt_oss_120b"] = ["model.layers=2"]
# DeepSeek-V3 and V2-Lite: their dense blocks and one of experts (V3 is a cluster's model)
ONE_PATTERN["deepseek_v3_671b"] = ["model.layers=4"]
ONE_PATTERN["deepseek_v2_lite_16b"] = ["model.layers=2"]


@pytest.mark.parametrize("config_name", CONFIGS)
def test_every_shipped_config_compiles_for_8_h200(config_name):
    result = target_plan(config_name, *ONE_PATTERN.get(config_name, []))
    assert result["target"]["device"] == "NVIDIA H200 141GB HBM3e"
    assert result["memory_bytes"]["total"] > 0 and result["target"]["matmuls"]
    assert result["target"]["estimate"]["step_s"] > 0


@pytest.mark.parametrize("config_name", ["gpt2_124m", "gpt_1b", "llama3_1b", "llama3_8b"])
def test_decoders_in_bf16_use_cudnn_attention_and_16_bit_matmuls_only(config_name):
    found = target_plan(config_name, "mesh.data=1", "mesh.fsdp=8", "precision.policy=bf16")
    kernels = found["target"]
    assert kernels["attention"] == "cudnn", kernels["attention_kernels"]
    assert kernels["fp32_matmuls"] == [], kernels["fp32_matmuls"]
    assert all(row["operands"] == "bf16 x bf16" for row in kernels["matmuls"]), kernels
    # FSDP: the weights' all-gathers and the gradients' reduce-scatters are async, and the
    # scheduler runs compute between start and done.
    collectives = kernels["collectives"]
    assert {"all-gather", "reduce-scatter"} <= {row["kind"] for row in collectives}
    assert sum(row["overlapped"] for row in collectives) >= len(collectives) / 2


def test_experts_split_over_8_h200_trade_tokens_by_overlapped_all_to_all():
    found = target_plan("qwen3_30b_a3b", "mesh.data=1", "mesh.expert=8", "model.layers=4")
    kernels = found["target"]
    assert kernels["fits"] and kernels["attention"] == "cudnn"
    all_to_all = [row for row in kernels["collectives"] if row["kind"] == "all-to-all"]
    assert all_to_all and all(row["overlapped"] for row in all_to_all)
    # The only fp32 matmuls are the router's (its logits in fp32 by design), forward and back.
    routers = kernels["fp32_matmuls"]
    assert routers and all("btd,dx->btx" in name for name in routers), routers


def test_a_128k_window_split_over_8_h200_fits_with_cudnn_over_the_gathered_keys():
    """llama3_8b_128k as shipped: one sequence of 131,072 tokens, 16,384 per device."""
    found = target_plan("llama3_8b_128k", "train.global_batch=1")
    kernels = found["target"]
    assert kernels["fits"] and kernels["attention"] == "cudnn", kernels["attention_kernels"]
    assert kernels["fp32_matmuls"] == [], kernels["fp32_matmuls"]
    split = found["context"]
    assert split["tokens_per_device"] == 16384 and split["strategy"] == "gather"
    assert split["hop_seconds"] < split["hop_attention_seconds"]  # the transfer can hide
    assert {"all-gather"} <= {row["kind"] for row in kernels["collectives"]}


def test_llama3_8b_with_lora_needs_under_half_of_full_fine_tuning_on_one_h200():
    from paisoar_jax.config import load_config
    from paisoar_jax.tools import plan

    one = gpu_target.target_devices("h200", 1, 1)
    config = load_config(REPO / "configs" / "llama3_8b_lora.yaml")
    lora = plan.plan(config, one, target="h200")
    assert lora["target"]["fits"], lora["memory_bytes"]
    # The frozen model in bf16, the optimizer state of the adapters alone.
    assert lora["trainable_count"] < 0.01 * lora["param_count"]
    frozen = lora["param_count"] - lora["trainable_count"]
    assert lora["memory_bytes"]["params"] == 2 * frozen + 4 * lora["trainable_count"]
    assert lora["memory_bytes"]["optimizer_state"] < 1 << 30
    # The same shape and settings without the lora section: every parameter trains, with
    # fp32 weights, gradients and Adam's two moments. (It fits since the loss takes the
    # vocabulary in slices: 131 GiB, 157 with the logits whole, benchmarks/RESULTS.md.)
    full = plan.plan(load_config(REPO / "configs" / "llama3_8b.yaml"), one, target="h200")
    held = full["memory_bytes"]
    assert held["params"] + held["gradients"] + held["optimizer_state"] >= 16 * frozen
    assert lora["memory_bytes"]["total"] < 0.5 * held["total"]


def test_llama3_8b_fits_on_fsdp_and_not_on_data_parallel_without_remat():
    sharded = target_plan("llama3_8b", "mesh.data=1", "mesh.fsdp=8")
    assert sharded["target"]["fits"] and sharded["target"]["memory_share"] < 0.5
    replicated = target_plan(
        "llama3_8b", "mesh.data=8", "train.global_batch=64", "remat.policy=none"
    )
    assert not replicated["target"]["fits"]


def test_fp8_int8_exchange_and_stages_show_in_the_gpu_program():
    fp8 = target_plan("gpt2_124m", "precision.policy=fp8", "model.layers=2")
    assert any("f8e4m3" in row["operands"] for row in fp8["target"]["matmuls"]), fp8["target"]
    int8 = target_plan("gpt2_124m", "mesh.grad_comm=int8", "model.layers=2")
    assert any(row["dtype"] == "s8" for row in int8["collectives_by_dtype"])
    staged = target_plan(
        "gpt2_124m",
        "mesh.stage=4",
        "mesh.data=2",
        "model.layers=4",
        "model.scan_layers=true",  # stages split the stacked blocks
        "train.global_batch=16",
    )
    assert staged["collectives"].get("collective-permute", {}).get("count", 0) > 0


def test_cpu_runs_never_initialise_the_cuda_plugin(tmp_path):
    """With the plugin installed, no driver and JAX_PLATFORMS unset: a clean CPU run."""
    env = {key: value for key, value in subprocess_env().items() if key != "JAX_PLATFORMS"}
    result = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.train", "train.steps=2", "model.layers=1", "run.dir=r"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for sign in ("cuInit", "plugin configuration error", "Traceback"):
        assert sign not in result.stderr, result.stderr[-2000:]


def test_importing_the_package_with_the_plugin_installed_changes_nothing():
    """The plugin there and no driver: importing sets no JAX_PLATFORMS and no jax platform;
    the CPU is chosen where a run starts (the clean run above)."""
    from test_packaging import import_changes

    assert import_changes(PYTHON) == {"changed": [], "jax_platforms": None}


def test_a_model_of_ones_own_plans_for_the_target():
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import paisoar_jax

    def loss(model, batch, rng):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    data = {"x": np.zeros((64, 256), np.float32), "y": np.zeros((64, 256), np.float32)}
    result = paisoar_jax.plan_fit(
        None,
        ["train.global_batch=64", "precision.policy=bf16", "mesh.fsdp=8", "mesh.data=1"],
        model=lambda rngs: nnx.Linear(256, 256, rngs=rngs),
        loss=loss,
        data=data,
        target="h200",
        show=False,
    )
    assert result["target"]["fits"]
    assert [row["operands"] for row in result["target"]["matmuls"]] == ["bf16 x bf16"]


def test_gpt2_on_one_h200_never_makes_the_fp32_logits_and_holds_less_than_the_peer():
    """gpt2_124m as shipped (B16 T1024): the loss takes the vocabulary in slices, so no f32
    buffer of B x T x V elements is made, and the step holds under 0.7x the temporaries of
    the plain-JAX step that ran at the same speed on a real H200 (0.64x: slices of bf16
    logits, and a GELU that keeps only its inputs for the backward)."""
    from paisoar_jax.config import load_config
    from paisoar_jax.tools import plan

    config = load_config(REPO / "configs" / "gpt2_124m.yaml")
    model, batch = config.model, config.train.global_batch
    compiled, *_ = plan.compile_step(config, gpu_target.target_devices("h200", 1, 1))
    text = compiled.as_text()
    logits = batch * model.seq_len * model.vocab_size
    f32_sizes = {
        math.prod(int(n) for n in dims.split(",") if n)
        for dims in re.findall(r"f32\[([\d,]*)\]", text)
    }
    assert logits not in f32_sizes
    assert f"bf16[{batch},{model.seq_len},{model.vocab_size}]" not in text
    assert compiled.memory_analysis().temp_size_in_bytes < 0.7 * PEER_TEMPORARIES


def test_gpt_1b_on_one_h200_holds_less_than_the_peer_like_for_like():
    """gpt_1b as shipped, against the plain-JAX step compiled with the same donation: under
    0.8x its temporaries (0.77x) and under 0.87x its device memory in all (0.83x)."""
    from paisoar_jax.config import load_config
    from paisoar_jax.engine.memory import step_total
    from paisoar_jax.tools import plan

    config = load_config(REPO / "configs" / "gpt_1b.yaml")
    compiled, *_ = plan.compile_step(config, gpu_target.target_devices("h200", 1, 1))
    analysis = compiled.memory_analysis()
    assert analysis.temp_size_in_bytes < 0.8 * PEER_1B_DONATED_TEMPORARIES, analysis
    assert step_total(analysis) < 0.87 * PEER_1B_DONATED_TOTAL, analysis


def test_the_estimate_is_labelled_and_in_a_plausible_range():
    """gpt2_124m on 8 x H200, FSDP: a roofline of the compiled kernels. A single H200 runs a
    plain JAX GPT-2 124M step at 467k tokens/s (../shared/gpu/README.md): this step's
    estimate must be of that order, neither free nor hopeless."""
    from paisoar_jax.tools import plan

    result = target_plan("gpt2_124m", "mesh.data=1", "mesh.fsdp=8", "precision.policy=bf16")
    estimate = result["target"]["estimate"]
    assert estimate["gemm_s"] > 0 and estimate["attention_s"] > 0
    assert 0.05 < estimate["mfu"] < 0.6, estimate
    assert "estimated step (a roofline of the GPU program's kernels, not a run)" in (
        plan.format_table(result)
    )


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unscanned"])
def test_remat_lowers_the_temporaries_on_the_gpu_target(scanned):
    """On the CPU plan an unscanned model's temporaries are the same with remat none and full:
    that is XLA:CPU's schedule. The GPU compiler's follow the policy."""
    layers = ["model.layers=4", f"model.scan_layers={str(scanned).lower()}", "mesh.fsdp=8"]
    temporaries = {
        policy: target_plan("gpt2_124m", *layers, "mesh.data=1", f"remat.policy={policy}")[
            "memory_bytes"
        ]["temporaries"]
        for policy in ("none", "dots", "full")
    }
    assert temporaries["full"] < temporaries["dots"] < temporaries["none"], temporaries


def test_the_bucket_flags_combine_the_fsdp_all_gathers():
    """gpu_flags.py's buckets against XLA's own thresholds (mesh.bucket_mb=0), both compiled."""
    shape = ("gpt2_124m", "mesh.data=1", "mesh.fsdp=8", "precision.policy=bf16")
    ours, theirs = target_plan(*shape), target_plan(*shape, "mesh.bucket_mb=0")
    gathers = [found["collectives"]["all-gather"]["count"] for found in (ours, theirs)]
    assert gathers[0] < gathers[1], gathers
    assert {row["set_by"] for row in ours["target"]["xla_flags"]} == {"mesh.bucket_mb"}
    assert {row["set_by"] for row in theirs["target"]["xla_flags"]} == {"XLA"}
    summary = gpu_target.schedule_summary(ours)
    assert summary["overlapped"] == summary["async"] > 0, summary


def test_a_plan_that_does_not_fit_names_the_fixes_and_fit_finds_one(tmp_path):
    """The default model in bf16 on one H200 under a 40 MiB limit (train.memory_limit_gb):
    full remat (29 MiB) and 16 micro-batches (26 MiB) fit; remat is estimated faster."""
    result = run_module(
        "plan",
        *["--target", "h200", "--devices", "1", "--fit", "precision.policy=bf16"],
        *["train.memory_limit_gb=0.04", "--output", "plan.json"],
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout
    assert "the step does NOT fit" in table and "(train.memory_limit_gb)" in table, table
    assert "    remat.policy=dots  recompute activations" in table, table
    found = json.loads((tmp_path / "plan.json").read_text())["fit"]
    fitting = {" ".join(row["change"]) for row in found["tried"] if row["fits"]}
    assert fitting == {"remat.policy=full", "train.grad_accum=16"}, found["tried"]
    assert found["change"] == ["remat.policy=full"], found["tried"]
    assert "smallest change that fits (add to the command line): remat.policy=full" in table


def test_dropless_experts_compile_to_grouped_matmuls_of_the_routed_rows_only():
    """Two of Qwen3-30B-A3B's layers over fsdp=8: tokamax's kernels, no capacity buffers.

    The grouped kernels' FLOPs are those of each device's routed rows (tokens x k), forward,
    recomputed forward (full remat) and two gradients, where the capacity path's buffers
    compute capacity x experts rows.
    """
    shape = ["mesh.data=1", "mesh.fsdp=8", "model.layers=2"]
    dropless = target_plan(
        "qwen3_30b_a3b", *shape, "model.moe_impl=dropless", "model.expert_capacity_factor=0"
    )
    capacity = target_plan("qwen3_30b_a3b", *shape)
    grouped = [row for row in dropless["target"]["matmuls"] if row["backend"] == "grouped"]
    assert grouped and all(row["operands"] == "bf16 x bf16" for row in grouped), grouped
    assert not any(row["backend"] == "grouped" for row in capacity["target"]["matmuls"])
    from paisoar_jax.config import load_config

    model = load_config(REPO / "configs" / "qwen3_30b_a3b.yaml").model
    rows = dropless["seq_len"] * model.experts_per_token  # a device's routed rows (B 1)
    expert_flops = 3 * 2 * rows * model.width * model.expert_width
    routed = 2 * 4 * expert_flops  # two layers: forward twice, two gradients
    dropless_flops = dropless["target"]["estimate"]["gemm_flops"]
    capacity_flops = capacity["target"]["estimate"]["gemm_flops"]
    # What the rest of the step computes (attention, router, head) is the same in both.
    assert capacity_flops - dropless_flops == pytest.approx(routed * (1.25 - 1), rel=0.05), (
        capacity_flops,
        dropless_flops,
        routed,
    )


def test_each_fp8_scaling_compiles_the_blocks_matmuls_to_fp8_gemms():
    """gpt_1b's block matmuls: forward e4m3 x e4m3, both gradients with e5m2, every mode."""
    shape = ["mesh.data=1", "mesh.fsdp=8", "model.layers=2", "precision.policy=fp8"]
    counts = {}
    for mode in ("delayed", "tensorwise", "rowwise"):
        matmuls = target_plan("gpt_1b", *shape, f"precision.fp8={mode}")["target"]["matmuls"]
        fp8 = {row["operands"]: row["count"] for row in matmuls if "f8" in row["operands"]}
        assert "f8e4m3fn x f8e4m3fn" in fp8 and any("f8e5m2" in kind for kind in fp8), mode
        counts[mode] = sum(fp8.values())
    # The current modes run in fp8 the matmuls delayed scaling does (no more, no fewer).
    assert counts["tensorwise"] == counts["rowwise"] == counts["delayed"], counts
