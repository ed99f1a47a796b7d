"""The XLA flags set for GPU compiles (paisoar_jax/runtime/gpu_flags.py): only on GPUs, never over
the user's XLA_FLAGS. What they change in a GPU program is tests/tools/test_gpu_target.py's."""

import types

import jax

from paisoar_jax.runtime import gpu_flags

GPU = [types.SimpleNamespace(platform="gpu")]  # a device as the mesh holds it


def test_a_cpu_compile_gets_no_flags():
    assert gpu_flags.compiler_options(128, jax.devices()) == {}


def test_a_gpu_compile_gets_the_buckets(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    options = gpu_flags.compiler_options(64, GPU)
    assert options == dict.fromkeys(gpu_flags.BUCKET_FLAGS, 64 * 2**20)
    assert gpu_flags.compiler_options(0, GPU) == {}  # mesh.bucket_mb=0: XLA's own


def test_the_users_xla_flags_win(monkeypatch):
    flag = "xla_gpu_all_gather_combine_threshold_bytes"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --{flag}=1024")
    options = gpu_flags.compiler_options(128, GPU)
    assert flag not in options and len(options) == len(gpu_flags.BUCKET_FLAGS) - 1
    rows = {row["flag"]: row for row in gpu_flags.describe(128)}
    assert rows[flag] == {"flag": flag, "value": "1024", "set_by": "XLA_FLAGS"}
    other = rows["xla_gpu_all_reduce_combine_threshold_bytes"]
    assert other["set_by"] == "mesh.bucket_mb" and other["value"] == 128 * 2**20
    assert {row["set_by"] for row in gpu_flags.describe(0)} == {"XLA", "XLA_FLAGS"}
