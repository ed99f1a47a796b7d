"""Readable out-of-memory: the report, its fixes, and XLA's real RESOURCE_EXHAUSTED error.

The steps are compiled for the 8 simulated CPU devices as `plan` compiles them. The XLA
errors are real: an allocation of 1 PiB fails on any machine (it is more than the address
space), so the CPU backend raises the same RESOURCE_EXHAUSTED a GPU raises when it is full.
"""

import contextlib
import io

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY

from paisoar_jax import cli
from paisoar_jax.config import load_config
from paisoar_jax.engine import memory
from paisoar_jax.errors import UserError
from paisoar_jax.run import oom
from paisoar_jax.tools import plan
from paisoar_jax.tools.plan.core import memory_settings

PEBIBYTE = 2**50


def compile_tiny(devices, *overrides):
    """(config, layout, compiled, per-device bytes) of TINY + overrides."""
    config = load_config(None, [*TINY, *overrides])
    compiled, layout, _, _ = plan.compile_step(config, devices)
    return config, layout, compiled, memory.memory(layout, compiled)["total"]


@pytest.fixture(scope="module")
def tiny(devices):
    return compile_tiny(devices)


def allocate_a_pebibyte():
    """Runs a jitted function whose temporary needs 1 PiB: XLA's real out-of-memory.

    The error comes when the result is waited for (dispatch is asynchronous), as it does
    for a train step: the guard must hold until the first step's result is read.
    """
    step = jax.jit(lambda x: jnp.broadcast_to(x, (PEBIBYTE // 2**20, 2**20)).cumsum(0)[-1])
    return step(jnp.ones((2**20,), jnp.uint8)).block_until_ready()


def fix_lines(report):
    """The override of each fix line of a report, in order."""
    lines = report.split("fixes, in the order to try them (add to the command line):\n")[1]
    return [line.split()[0] for line in lines.splitlines()]


def test_a_step_over_the_limit_gets_the_breakdown_and_fixes_that_make_it_fit(tiny, devices):
    config, layout, compiled, needed = tiny
    with pytest.raises(oom.OutOfMemoryError) as raised:
        oom.check_fits(memory_settings(config), layout, compiled, needed - 1)
    report = str(raised.value)
    breakdown = memory.memory(layout, compiled)
    assert report.startswith(
        f"out of memory: the train step needs {memory.format_bytes(needed)} per device, more than "
        f"the {memory.format_bytes(needed - 1)} limit"
    )
    for label, key in [
        ("params", "params"),
        ("optimizer state", "optimizer_state"),
        ("gradients", "gradients"),
        ("temporaries", "temporaries"),
        ("total", "total"),
    ]:
        assert f"  {label:<17}{memory.format_bytes(breakdown[key]):>10}" in report, label
    overrides = fix_lines(report)
    assert overrides == [
        "remat.policy=dots",
        "mesh.zero=1",
        "train.grad_accum=2",
        "precision.policy=bf16",
    ]
    assert "over the 8 data devices" in report
    assert len(report.splitlines()) < 20
    # The fixes, all taken, make the step smaller: a limit between the two passes it only.
    fixed_config, fixed_layout, fixed_compiled, fixed_needed = compile_tiny(devices, *overrides)
    assert fixed_needed < 0.6 * needed
    limit = (fixed_needed + needed) // 2
    oom.check_fits(memory_settings(fixed_config), fixed_layout, fixed_compiled, limit)
    with pytest.raises(oom.OutOfMemoryError):
        oom.check_fits(memory_settings(config), layout, compiled, limit)


def test_a_step_that_fits_or_has_no_limit_passes(tiny):
    config, layout, compiled, needed = tiny
    oom.check_fits(memory_settings(config), layout, compiled, needed)
    oom.check_fits(
        memory_settings(config), layout, compiled, None
    )  # CPU: the device reports no limit


def test_fixes_already_in_effect_are_left_out():
    done = load_config(
        None,
        [
            *TINY,
            "remat.policy=full",
            "mesh.zero=3",
            "train.grad_accum=2",  # micro-batch 8 on 8 data devices: no smaller one splits
            "precision.policy=bf16",
        ],
    )
    assert oom.memory_fixes(memory_settings(done), {"data": 8, "fsdp": 1, "tensor": 1}) == []
    # One data device: ZeRO has nothing to shard over. dots_no_batch is the step after dots.
    single = load_config(None, [*TINY, "remat.policy=dots", "mesh.zero=1"])
    overrides = [
        override
        for override, _ in oom.memory_fixes(memory_settings(single), {"data": 1, "fsdp": 1})
    ]
    assert overrides == [
        "remat.policy=dots_no_batch",
        "train.grad_accum=2",
        "precision.policy=bf16",
    ]
    # Mesh unknown (the doctor without a plan, mesh.data=-1): ZeRO may help, so it is offered.
    assert "mesh.zero=3" in [override for override, _ in oom.memory_fixes(memory_settings(single))]


def test_xlas_real_out_of_memory_error_is_recognised():
    with pytest.raises(RuntimeError) as raised:
        jnp.zeros((PEBIBYTE,), jnp.uint8).block_until_ready()
    error = raised.value
    assert "RESOURCE_EXHAUSTED" in str(error)
    assert oom.is_out_of_memory(error)
    try:  # also when it is the cause of another error
        raise ValueError("the first step failed") from error
    except ValueError as wrapped:
        assert oom.is_out_of_memory(wrapped)
    # Constructed, with the text of XLA GPU's allocator (a GPU is not at hand here).
    gpu = RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes."
    )
    assert oom.is_out_of_memory(gpu)


def test_other_errors_are_not_out_of_memory():
    array = jnp.ones(3)
    jax.jit(lambda x: x + 1, donate_argnums=0)(array)
    with pytest.raises(RuntimeError) as raised:
        array + 1  # a real runtime error of jax: the donated array is gone
    assert not oom.is_out_of_memory(raised.value)
    assert not oom.is_out_of_memory(UserError("train.global_batch: out of memory? no: a typo"))


def test_an_out_of_memory_inside_the_guard_becomes_the_report(tiny):
    config, layout, compiled, needed = tiny
    with pytest.raises(oom.OutOfMemoryError) as raised:
        with oom.readable_out_of_memory(memory_settings(config), layout, None, compiled):
            allocate_a_pebibyte()
    report = str(raised.value)
    assert report.startswith(f"out of memory: the train step needs {memory.format_bytes(needed)}")
    assert "more than the device's memory" in report
    assert report.splitlines()[-1].startswith("XLA: RESOURCE_EXHAUSTED: Out of memory allocating")
    # Through the entrypoints' exit handling: the report on stderr and status 2.
    err = io.StringIO()

    def first_step():
        with oom.readable_out_of_memory(memory_settings(config), layout, None, compiled):
            allocate_a_pebibyte()

    with contextlib.redirect_stderr(err):
        status = cli.exit_status("paisoar_jax.train", first_step)
    assert status == 2
    assert err.getvalue().startswith("paisoar_jax.train: error: out of memory: the train step")
    # Any other error passes through as it was.
    with pytest.raises(ValueError, match="invalid literal"):
        with oom.readable_out_of_memory(memory_settings(config), layout, None, compiled):
            int("many")


def test_out_of_memory_while_compiling_reports_the_state(tiny):
    config, layout, _, _ = tiny
    with pytest.raises(oom.OutOfMemoryError) as raised:
        with oom.readable_out_of_memory(memory_settings(config), layout, 2**20, compiled=None):
            allocate_a_pebibyte()
    report = str(raised.value)
    assert report.startswith("out of memory: compiling the train step ran out of the 1 MiB limit")
    params = memory.per_device_bytes(layout.abstract_state.params)
    assert f"  {'params':<17}{memory.format_bytes(params):>10}" in report
    assert "optimizer state" in report and "temporaries" not in report
    assert "remat.policy=dots" in report


def test_the_limit_comes_from_the_config_or_the_device():
    assert oom.device_limit_bytes(2) == 2 * 2**30
    assert oom.device_limit_bytes(0.5) == 2**29
    # The CPU backend has no memory_stats(): no limit is known, so none is checked.
    assert jax.devices()[0].memory_stats() is None
    assert oom.device_limit_bytes(0) is None


def test_on_a_gpu_the_report_says_how_to_give_jax_more_memory(tiny, monkeypatch):
    """The GPU-only line, with the backend query answering "gpu" (the CPU has no fraction)."""
    config, layout, compiled, _ = tiny
    assert (
        oom.memory_fraction_hint(config.train.memory_limit_gb) is None
    )  # a CPU: jax holds no share of it
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    report = oom.memory_report(memory_settings(config), layout, compiled, 2**20)
    assert "jax holds 75% of each GPU's memory" in report
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in report
    assert "jax" not in fix_lines(report)  # a note, not one of the overrides
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert oom.memory_fraction_hint(config.train.memory_limit_gb) is None
    budget = load_config(None, [*TINY, "train.memory_limit_gb=1"])
    assert oom.memory_fraction_hint(budget.train.memory_limit_gb) is None  # the user set the limit
