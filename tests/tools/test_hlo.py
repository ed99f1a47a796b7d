"""The HLO collective counter on a handmade module: shapes, groups, async pairs, loops."""

import pytest

from paisoar_jax.tools.plan import hlo

# Written the way XLA prints a compiled module. The loops: `outer` runs 4 times (its
# backend_config says so, although its condition's constant says 99); `inner`, inside it,
# runs 3 times per outer trip (no backend_config: the condition's constant); `mystery` has
# neither, so it counts once and is reported.
HANDMADE = """\
HloModule handmade, entry_computation_layout={(f32[64]{0})->f32[8]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %shard = f32[2]{0} constant({1, 2})
  %gather-start = (f32[2]{0}, f32[16]{0}) all-gather-start(%shard), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %gather-done = f32[16]{0} all-gather-done(%gather-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[16]{0}) tuple(%next, %gather-done)
}

%inner_condition (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%outer_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %v = f32[64]{0} get-tuple-element(%p), index=1
  %b = bf16[32,2]{1,0} constant({...})
  %c = f32[] constant(0)
  %sums = (f32[64]{0}, /*index=1*/bf16[32,2]{1,0}, f32[]) all-reduce(%v, %b, %c), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %zero = s32[] constant(0)
  %empty = f32[16]{0} constant({...})
  %start = (s32[], f32[16]{0}) tuple(%zero, %empty)
  %inner = (s32[], f32[16]{0}) while(%start), condition=%inner_condition, body=%inner_body
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %out = (s32[], f32[64]{0}) tuple(%i, %v)
}

%outer_condition (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %limit = s32[] constant(99)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%mystery_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %w = f32[4]{0} get-tuple-element(%p), index=1
  %total = f32[4]{0} all-reduce(%w), channel_id=5, replica_groups={}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %out = (s32[], f32[4]{0}) tuple(%i, %total)
}

%mystery_condition (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%wrapped_reduce_scatter (x: f32[64]) -> f32[8] {
  %x = f32[64]{0} parameter(0)
  ROOT %scatter = f32[8]{0} reduce-scatter(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'a','b'}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[64]) -> f32[8] {
  %x = f32[64]{0} parameter(0)
  %scatter-start = ((f32[64]{0}), f32[8]{0}) async-start(%x), calls=%wrapped_reduce_scatter
  %scatter-done = f32[8]{0} async-done(%scatter-start), calls=%wrapped_reduce_scatter
  %shifted = f32[8]{0} collective-permute(%scatter-done), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %table = f32[8,8]{1,0} constant({...})
  %swapped = f32[8,8]{1,0} all-to-all(%table), channel_id=6, replica_groups=mesh['x'=4,'y'=2] {'x':(2)2}, dimensions={0}
  %zero = s32[] constant(0)
  %loop_start = (s32[], f32[64]{0}) tuple(%zero, %x)
  %outer = (s32[], f32[64]{0}) while(%loop_start), condition=%outer_condition, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  %few = f32[4]{0} constant({...})
  %mystery_start = (s32[], f32[4]{0}) tuple(%zero, %few)
  %mystery = (s32[], f32[4]{0}) while(%mystery_start), condition=%mystery_condition, body=%mystery_body
  ROOT %result = f32[8]{0} copy(%shifted)
}
"""  # noqa: E501 (HLO lines are as long as XLA prints them)


def by_name(found):
    return {collective.name: collective for collective in found}


def test_every_collective_is_found_once_with_its_bytes_group_and_runs():
    found, unknown = hlo.analyze(HANDMADE, device_count=8)
    collectives = by_name(found)
    # The async all-gather counts once (at -done, its output); the async-wrapped
    # reduce-scatter once (inside the wrapped computation, not again at async-done).
    assert sorted(collectives) == ["gather-done", "scatter", "shifted", "sums", "swapped", "total"]
    expected = {
        # name: (kind, bytes per run, group size, runs per step)
        "sums": ("all-reduce", 64 * 4 + 32 * 2 * 2 + 4, 4, 4),  # a tuple, in outer (4 trips)
        "gather-done": ("all-gather", 16 * 4, 8, 4 * 3),  # output; inner loop inside outer
        "scatter": ("reduce-scatter", 8 * 4 * 8, 8, 1),  # input = output x group
        "shifted": ("collective-permute", 8 * 4, 8, 1),
        "swapped": ("all-to-all", 8 * 8 * 4, 2, 1),  # a size-2 sub-axis of x
        "total": ("all-reduce", 4 * 4, 8, 1),  # empty groups: every device; loop unknown
    }
    for name, (kind, size, group, runs) in expected.items():
        collective = collectives[name]
        assert (collective.kind, collective.bytes, collective.group_size, collective.count) == (
            kind,
            size,
            group,
            runs,
        ), name
    assert unknown == ["mystery"]
    assert collectives["gather-done"].computation == "inner_body"


def test_totals_multiply_bytes_by_runs():
    totals = hlo.totals_by_kind(hlo.collectives(HANDMADE, device_count=8))
    assert totals["all-reduce"] == {"count": 4 + 1, "bytes": 4 * 388 + 16}
    assert totals["all-gather"] == {"count": 12, "bytes": 12 * 64}
    assert totals["reduce-scatter"] == {"count": 1, "bytes": 256}
    assert set(totals) == set(hlo.KINDS)
    timed = hlo.totals_by_kind(hlo.collectives(HANDMADE, device_count=8), gb_per_s=1.0)
    ring_bytes = 4 * 388 * 2 * 3 / 4 + 16 * 2 * 7 / 8  # groups of 4 in the loop, 8 outside
    assert timed["all-reduce"]["seconds"] == pytest.approx(ring_bytes / 1e9)
    assert timed["collective-permute"]["seconds"] == pytest.approx(32 / 1e9)


def test_shape_bytes_counts_nested_tuples_and_sub_byte_types():
    shape = "(f32[64]{0}, /*index=5*/bf16[2,3]{1,0}, pred[], (s4[3]{0}, token[]))"
    assert hlo.shape_bytes(shape) == 256 + 12 + 1 + 2
    assert hlo.shape_bytes("f32[]") == 4
    assert hlo.shape_bytes("f32[<=8,2]{1,0}") == 64  # a dynamic dimension: its bound


@pytest.mark.parametrize(
    "attributes, size",
    [
        ("replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add", 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}", 8),
        ("replica_groups=mesh['a'=8,'b'=4] {'a':(4)2,'b'}, to_apply=%add", 8),
        ("replica_groups={}, to_apply=%add", 16),
        ("source_target_pairs={{0,1},{1,0}}", 16),
    ],
)
def test_group_size_reads_every_spelling(attributes, size):
    assert hlo.group_size(f"  %c = f32[8]{{0}} all-reduce(%x), {attributes}", 16) == size


def test_ring_factors():
    assert hlo.ring_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    assert hlo.ring_factor("all-gather", 8) == pytest.approx(7 / 8)
    assert hlo.ring_factor("reduce-scatter", 4) == pytest.approx(3 / 4)
    assert hlo.ring_factor("collective-permute", 8) == 1.0
    assert hlo.ring_factor("all-reduce", 1) == 0.0
