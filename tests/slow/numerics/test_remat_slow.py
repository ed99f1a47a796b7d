"""The slow tier beside tests/numerics/test_remat.py: longer runs, more settings.

Remat policies: the same gradients, and measurably less compiled memory.
"""

from test_remat import temporary_bytes


def test_full_remat_needs_at_least_half_less_temporary_memory(devices):
    none, full = temporary_bytes(devices, "none"), temporary_bytes(devices, "full")
    assert none >= 2 * full, (none, full)
