"""Compressed gradient exchange: bytes and dtypes in the HLO, fp32 sums, losses, resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, build_run, resumable_run, run_records, token_batches, train
from jax.sharding import NamedSharding, PartitionSpec

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import grad_comm
from paisoar_jax.tools.plan import hlo


def compiled_step(overrides, devices):
    """(collectives of one compiled data=8 step, HLO text, layout)."""
    config, mesh, layout, state, train_step = build_run(["mesh.data=8", *overrides], devices)
    with jax.set_mesh(mesh):
        text = train_step.lower(state, token_batches(1)[0]).compile().as_text()
    return hlo.collectives(text, len(devices)), layout


def wire_bytes(found, kinds=hlo.KINDS):
    """Bytes one device sends per step over the busiest link (NCCL's ring costs)."""
    return sum(
        op.count * op.bytes * hlo.ring_factor(op.kind, op.group_size)
        for op in found
        if op.kind in kinds
    )


@pytest.mark.parametrize(
    "dtype, wire_type, ratio",
    [pytest.param("bf16", "u16", 1 / 2, marks=pytest.mark.slow), ("int8", "s8", 1 / 4)],
)
def test_the_exchange_carries_bf16_or_int8_with_the_expected_bytes(
    dtype, wire_type, ratio, devices
):
    """fp32: XLA's all-reduce of every gradient. bf16/int8: an all-to-all and an all-gather
    of one buffer in the wire dtype, 1/2 and about 1/4 of fp32's bytes (scales included)."""
    reference, layout = compiled_step([], devices)
    found, compressed = compiled_step([f"mesh.grad_comm={dtype}"], devices)
    fp32_exchange = [op for op in reference if op.kind == "all-reduce" and op.bytes > 1024]
    # XLA reduces every gradient in fp32 (the tied embedding's two uses apart: more bytes).
    assert sum(op.count * op.bytes for op in fp32_exchange) >= 4 * layout.param_count
    exchange = [op for op in found if op.kind in ("all-to-all", "all-gather")]
    assert sorted(op.kind for op in exchange) == ["all-gather", "all-to-all"]
    assert {op.dtype for op in exchange} == {wire_type}
    assert all(op.group_size == 8 and op.count == 1 for op in exchange)
    # Nothing of gradient size is reduced in fp32 any more.
    assert all(op.bytes <= 1024 for op in found if op.kind == "all-reduce")
    per_value = 2 if dtype == "bf16" else 1 + 4 / 256  # int8: a float32 scale per 256
    padded = 8 * compressed.exchange.row  # every leaf padded to a multiple of 8 shards
    assert layout.param_count <= padded < layout.param_count * 1.01
    for op in exchange:  # the all-to-all also carries each shard's loss and metrics (fp32)
        riding = 8 * 4 * 8 if op.kind == "all-to-all" else 0
        assert 0 <= op.bytes - padded * per_value <= riding
    # Against an fp32 all-reduce of the same gradient, and against XLA's fp32 program.
    same_gradient = hlo.ring_factor("all-reduce", 8) * 4 * layout.param_count
    expected = ratio * per_value / (2 if dtype == "bf16" else 1)
    assert wire_bytes(exchange) / same_gradient == pytest.approx(expected, rel=0.01)
    assert wire_bytes(exchange) / wire_bytes(fp32_exchange) <= expected


def shard_gradients(shards=8, seed=0):
    """Per-shard gradients [P, ...] of two leaves with spread-out magnitudes."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0, 2, (shards, 1, 1)))
    return {
        "w": (rng.normal(0, 1, (shards, 64, 48)) * scales).astype(np.float32),
        "b": rng.normal(0, 1, (shards, 40)).astype(np.float32),
    }


STATS = np.random.default_rng(1).normal(3, 1, (8, 3)).astype(np.float32)  # [P, S]


def run_exchange(dtype, devices, hosts=8, zero=0, block=256, residual=False):
    """The mean of `shard_gradients` through the compressed exchange on a data=8 mesh."""
    config = load_config(None, [*TINY, f"mesh.grad_comm={dtype}", f"mesh.grad_comm_block={block}"])
    from paisoar_jax.parallel.sharding import build_mesh

    mesh = build_mesh(config.mesh, devices)
    gradients = shard_gradients()
    params = {
        name: jax.ShapeDtypeStruct(value.shape[1:], jnp.float32)
        for name, value in gradients.items()
    }
    replicated = NamedSharding(mesh, PartitionSpec())
    split = {"w": NamedSharding(mesh, PartitionSpec("data")), "b": replicated}
    gradient_shardings = split if zero else {"w": replicated, "b": replicated}
    exchange = grad_comm.plan(
        config.mesh, mesh, params, {"w": replicated, "b": replicated}, gradient_shardings
    )
    exchange = grad_comm.dataclasses.replace(exchange, hosts=hosts, error_feedback=residual)
    state = grad_comm.initial_comm_state(exchange, mesh)
    with jax.set_mesh(mesh):
        placed = jax.device_put(gradients, NamedSharding(mesh, PartitionSpec("data")))
        stats = jax.device_put(STATS, NamedSharding(mesh, PartitionSpec("data")))
        run = jax.jit(lambda g, s, c: grad_comm.exchange_gradients(g, s, c, 1.0, exchange, mesh))
        text = run.lower(placed, stats, state).compile().as_text()
        mean, stats_mean, new_state = run(placed, stats, state)
    # Loss and metrics ride along in fp32 bits: their mean is exact.
    np.testing.assert_allclose(stats_mean, STATS.mean(0), rtol=1e-6)
    return jax.device_get(mean), new_state, hlo.collectives(text, 8), gradients


def quantised(values, block=256):
    """What int8 blockwise rounding leaves of a flat fp32 vector (numpy, as the wire sees it)."""
    padded = np.pad(values, (0, -values.size % block)).reshape(-1, block)
    scale = np.abs(padded).max(axis=1, keepdims=True) / 127
    rounded = np.clip(np.round(padded / np.where(scale == 0, 1, scale)), -127, 127) * scale
    return rounded.reshape(-1)[: values.size]


def test_bf16_is_summed_in_fp32_on_arrival(devices):
    """The mean equals fp32 sums of the bf16-rounded shards, then one bf16 rounding of the
    reduced piece for the all-gather: not a bf16 sum."""
    mean, _, _, gradients = run_exchange("bf16", devices)
    for name, shards in gradients.items():
        rounded = shards.astype(jnp.bfloat16).astype(np.float32)
        summed = rounded.astype(np.float64).sum(0) / 8
        expected = np.asarray(jnp.asarray(summed, jnp.float32).astype(jnp.bfloat16), np.float32)
        np.testing.assert_allclose(mean[name], expected, rtol=1e-2, atol=0)
        np.testing.assert_allclose(
            mean[name], shards.mean(0), rtol=2e-2, atol=1e-3 * np.abs(shards).max()
        )


def test_int8_blocks_keep_their_scale_and_zero_one_keeps_the_reduce_scatter(devices):
    """ZeRO-1: the leaf the optimizer splits over data comes back split (no all-gather of
    it) as the fp32 mean of each shard's int8-rounded rows; the other leaf within rounding."""
    mean, _, found, gradients = run_exchange("int8", devices, zero=1)
    shards = gradients["w"]  # [8, 64, 48]: data shard p receives rows 8p .. 8p + 7
    rows = shards.reshape(8, 8, 8 * 48)  # [shard, piece, values]
    rounded = np.stack([[quantised(row) for row in pieces] for pieces in rows])
    np.testing.assert_allclose(mean["w"], rounded.mean(0).reshape(64, 48), rtol=1e-5, atol=1e-7)
    assert np.abs(mean["w"] - shards.mean(0)).max() > 0  # and it was rounded
    bias = gradients["b"]
    np.testing.assert_allclose(mean["b"], bias.mean(0), atol=2 * np.abs(bias).max() / 127)
    gathers = [op for op in found if op.kind == "all-gather"]
    assert gathers and all(op.bytes < 8 * 256 * 2 for op in gathers)  # only "b"'s piece


def test_scope_dcn_reduces_inside_each_host_in_fp32_first(devices):
    """hosts=2 on 8 devices: an fp32 reduce-scatter in groups of 4, then int8 between the
    2 hosts, then an fp32 all-gather in groups of 4; the mean is as close as scope all's."""
    mean, _, found, gradients = run_exchange("int8", devices, hosts=2)
    by_kind = {(op.kind, op.dtype, op.group_size) for op in found}
    assert ("reduce-scatter", "f32", 4) in by_kind or ("all-reduce", "f32", 4) in by_kind
    assert ("all-to-all", "s8", 2) in by_kind and ("all-gather", "s8", 2) in by_kind
    assert ("all-gather", "f32", 4) in by_kind
    assert not any(op.dtype == "s8" and op.group_size != 2 for op in found)
    np.testing.assert_allclose(
        mean["w"], gradients["w"].mean(0), atol=np.abs(gradients["w"]).max() / 127
    )


def test_error_feedback_keeps_what_rounding_took(devices):
    """The residual is the rounding error of each device's rows: rows + residual decode to
    the exact rows, and the reduced result plus the residuals' mean is the exact mean."""
    mean, state, _, gradients = run_exchange("int8", devices, residual=True)
    residual = np.asarray(jax.device_get(state["residual"]))
    assert residual.shape[0] == 8 and np.abs(residual).max() > 0
    assert np.abs(residual).max() <= np.abs(gradients["w"]).max() / 127


def steps(overrides, devices, count=3):
    """Losses and final params of `count` train steps on fixed batches."""
    config, mesh, _, state, train_step = build_run(overrides, devices)
    losses = []
    with jax.set_mesh(mesh):
        for batch in token_batches(count, batch=config.train.global_batch):
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state)


def run_steps(run_dir, overrides, steps):
    return resumable_run(run_dir, ["mesh.data=8", *overrides], steps)


def saved_residual(run_dir, step):
    """The error-feedback residual a checkpoint holds, read back by Orbax without a target."""
    import orbax.checkpoint as ocp

    (path,) = [path for path in run_dir.rglob("state") if path.parent.name == str(step)]
    return np.asarray(ocp.PyTreeCheckpointer().restore(path)["comm"]["residual"])


EF = ["mesh.grad_comm=int8", "mesh.grad_comm_error_feedback=true"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.grad_comm=fp16"], "mesh.grad_comm"),
        (["mesh.grad_comm=int8", "mesh.grad_comm_block=100"], "must be a power of two, got 100"),
        (["mesh.grad_comm_error_feedback=true"], "is for a compressed exchange"),
        (["mesh.grad_comm=bf16", "mesh.stage=2"], "does not combine with pipeline stages"),
        (["mesh.grad_comm=int8", "precision.policy=fp8"], "does not combine with precision"),
    ],
)
def test_bad_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        load_config(None, [*TINY, *overrides])
    assert "\n" not in str(error.value)


def test_batchnorm_models_are_refused(devices):
    from conftest import TINY_RESNET, plan_run

    with pytest.raises(UserError, match="BatchNorm statistics"):
        plan_run(["mesh.data=8", "mesh.grad_comm=int8"], devices, base=TINY_RESNET)


def test_one_data_shard_is_a_warning_not_an_error(devices, capsys):
    """grad_comm on a 1-device mesh: one warning line, and the fp32 program."""
    _, _, layout, _, _ = build_run(["mesh.data=1", "mesh.grad_comm=int8"], devices[:1])
    assert layout.exchange is None
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "has nothing to compress" in warning[0]


def final_eval_loss(run_dir, overrides):
    settings = [*TINY, "mesh.data=8", "train.steps=200", "train.eval_every=200"]
    settings += ["train.log_every=50", "checkpoint.every=0", f"run.dir={run_dir}", *overrides]
    train(load_config(None, settings))
    return [record for record in run_records(run_dir) if "eval_loss" in record][-1]["eval_loss"]
