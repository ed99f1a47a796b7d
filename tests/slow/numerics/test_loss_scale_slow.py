"""The slow tier beside tests/numerics/test_loss_scale.py: longer runs, more settings.

Loss scaling: skip non-finite steps untouched, back off, grow, agree across meshes.
"""

from test_loss_scale import scale_trajectory


def test_sharded_scale_trajectory_equals_one_device(devices):
    reference, ref_unchanged = scale_trajectory(["mesh.data=1"], devices[:1])
    sharded, unchanged = scale_trajectory(["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], devices)
    assert sharded == reference
    skipped = reference[-1][1]
    assert 0 < skipped < 8, reference  # some steps overflowed, later ones went through
    assert reference[0][0] == 2.0**23  # the first step overflowed and backed off
    assert all(ref_unchanged) and all(unchanged)
