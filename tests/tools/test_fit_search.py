"""`plan --fit`'s search (tools/plan/fit_search.py): which changes it tries, in which order, and how
it picks one. Here each variant's plan is a table of bytes and times; the search over the GPU
compiler's real plans is tests/tools/test_gpu_target.py's (gpu_aot tier)."""

from conftest import TINY

from paisoar_jax.config import load_config
from paisoar_jax.tools.plan import fit_search

MESH = {"data": 8, "stage": 1, "fsdp": 1, "expert": 1, "tensor": 1}


def test_the_changes_tried_are_the_memory_fixes_that_can_apply():
    config = load_config(None, [*TINY, "train.global_batch=32"])  # fp32, remat none, zero 0
    assert fit_search.candidates(config, MESH) == [
        ["mesh.zero=1"],
        ["remat.policy=dots"],
        ["remat.policy=full"],
        ["mesh.zero=3"],
        ["mesh.data=1", "mesh.fsdp=8", "mesh.zero=0"],
        ["train.grad_accum=2"],  # 16 per micro-batch: 2 per data device
        ["train.grad_accum=4"],  # 8: one per device, the most
        ["precision.policy=bf16"],
    ]
    # One device: nothing to shard over; remat full already: nothing less.
    single = load_config(None, [*TINY, "remat.policy=full", "precision.policy=bf16"])
    assert fit_search.candidates(single, {"data": 1}) == [
        ["train.grad_accum=2"],
        ["train.grad_accum=16"],
    ]


def plan_with(total_gib: float, step_ms: float) -> dict:
    limit = 10 * 2**30
    target = {"device_memory_bytes": limit, "estimate": {"step_s": step_ms / 1e3}}
    return {"memory_bytes": {"total": int(total_gib * 2**30)}, "mesh": MESH, "target": target}


def test_of_the_changes_that_fit_the_fastest_is_proposed():
    config = load_config(None, [*TINY, "train.global_batch=32"])
    costs = {  # (GiB, estimated ms) per variant's remat and zero
        ("none", 1): (9, 12.0),
        ("dots", 0): (11, 11.0),
        ("full", 0): (8, 14.0),
        ("none", 3): (9.5, 10.5),
    }

    def plan_of(variant):
        key = (variant.remat.policy, variant.mesh.zero)
        return plan_with(*costs.get(key, (12, 10.0)))

    found = fit_search.search(config, plan_with(12, 10.0), plan_of)
    assert not found["fits"] and found["limit_bytes"] == 10 * 2**30
    assert found["change"] == ["mesh.zero=3"], found["tried"]  # fits, and the fastest that does
    assert len(found["tried"]) == len(fit_search.candidates(config, MESH))


def test_when_no_single_change_fits_the_best_saving_is_kept_and_built_on():
    config = load_config(None, [*TINY, "train.global_batch=32"])

    def plan_of(variant):
        saved = (variant.remat.policy == "full") * 1.5 + (variant.mesh.zero == 1) * 1.0
        return plan_with(12 - saved, 10.0 + saved)

    found = fit_search.search(config, plan_with(12, 10.0), plan_of)
    assert found["change"] == ["remat.policy=full", "mesh.zero=1"], found["tried"]
    assert "\n".join(fit_search.fit_lines(found)).endswith(
        "smallest change that fits (add to the command line): remat.policy=full mesh.zero=1"
    )


def test_a_step_that_fits_needs_no_change_and_a_memory_limit_is_the_bar():
    config = load_config(None, [*TINY, "train.memory_limit_gb=20"])
    assert fit_search.limit_bytes(config, 141 * 2**30) == 20 * 2**30
    found = fit_search.search(config, plan_with(12, 10.0), lambda variant: None)
    assert found["fits"] and found["change"] == [] and found["tried"] == []
