"""The GPU roofline's byte counts (paisoar_jax/tools/plan/gpu_kernels.py) on small programs.

The programs are compiled for the CPU here: the estimator reads any XLA program's
post-optimisation HLO, and these hold the loop shapes a scanned stack of layers makes (a
while loop whose kernels slice one layer's row of a stacked buffer, or update it in place).
"""

import jax
import jax.numpy as jnp
import pytest

from paisoar_jax.tools.plan import gpu_kernels

N = 1 << 16  # elements of one row
ROW = N * 4  # its bytes (fp32)


def hlo_of(function, *arguments) -> str:
    return jax.jit(function).lower(*arguments).compile().as_text()


def bytes_moved(hlo_text: str) -> float:
    return gpu_kernels.roofline_seconds(hlo_text, 1e15, 1.0)["memory_bound_s"]


def every_fourth_row(table, x):
    """A loop of 4 over a [16, N] table, each turn reading one row of it."""

    def turn(x, i):
        return jnp.tanh(x * jax.lax.dynamic_index_in_dim(table, i * 4, keepdims=False)), None

    return jax.lax.scan(turn, x, jnp.arange(4))[0]


def one_element(table, x):
    """A loop of 4 over a [16, N] table, each turn reading one element of it."""

    def turn(x, i):
        return x + table[i * 4, 7], None

    return jax.lax.scan(turn, x, jnp.arange(4))[0]


def rows_written(x):
    """A loop of 4 writing one row of a [16, N] buffer in place each turn."""

    def turn(carry, i):
        buffer, x = carry
        x = jnp.tanh(x)
        return (jax.lax.dynamic_update_index_in_dim(buffer, x, i * 4, 0), x), None

    return jax.lax.scan(turn, (jnp.zeros((16, N)), x), jnp.arange(4))[0][0]


@pytest.mark.parametrize(
    ("function", "least"),
    [
        (every_fourth_row, 4 * 3 * ROW),  # each turn: x and the row in, x out
        (one_element, 4 * 2 * ROW),  # each turn: x in and out, one element
        (rows_written, 16 * ROW + 4 * 3 * ROW),  # the zeros once; x in, x out, the row
    ],
)
def test_a_kernel_is_charged_the_slices_it_reads_and_the_rows_it_updates(function, least):
    """Before: each turn was charged the whole [16, N] table (16 rows, not 1; one element
    of it cost 16 rows), and each in-place row update the whole buffer, twice."""
    arguments = (jnp.ones((16, N)), jnp.ones((N,)))[1 if function is rows_written else 0 :]
    moved = bytes_moved(hlo_of(function, *arguments))
    # What must move at least, and at most one more copy of a row per turn (a kernel of its
    # own for tanh) and the loop's scalars.
    assert least <= moved <= least + 4 * ROW + 4096, (moved / ROW, least / ROW)


def layer(x, w):
    y = jnp.tanh(x * w)
    return y / jnp.sum(y)


def scanned(stack, x):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stack)[0]


def unrolled(stack, x):
    for index in range(len(stack)):
        x = layer(x, stack[index])
    return x


def test_a_stack_scanned_and_unrolled_prices_its_common_kernels_alike():
    """The kernels both programs have (the same JAX op and result shape) move the same
    bytes per run: a scanned layer's dynamic slice of the stacked weights counts as the
    unrolled layer's static slice does. Before: the unrolled layers were each charged the
    whole stack (a static slice of it is not a loop's stacked operand)."""
    arguments = (jnp.ones((6, N)), jnp.ones((N,)))
    per_run = []
    for program in (scanned, unrolled):
        by_op: dict[tuple, list[float]] = {}
        for kernel in gpu_kernels.priced_kernels(hlo_of(program, *arguments)):
            if kernel["kind"] == "bytes" and kernel["amount"] >= ROW:
                key = (kernel["op"].rsplit("/", 1)[-1], kernel["shape"])
                by_op.setdefault(key, []).append(kernel["amount"])
        per_run.append(by_op)
    common = set(per_run[0]) & set(per_run[1])
    assert common, per_run
    for key in common:  # (an unrolled stack's first and last layers may differ: any of them)
        for amount in per_run[0][key]:
            assert any(amount == pytest.approx(other, rel=0.01) for other in per_run[1][key]), (
                key,
                amount,
                per_run[1][key],
            )


SCALAR_AFTER_A_BIG_WRITE = """\
HloModule counter

%fused_add (param_0: s32[]) -> s32[] {
  %param_0 = s32[] parameter(0)
  %constant_1 = s32[] constant(1)
  ROOT %add = s32[] add(%param_0, %constant_1)
}

%fused_fill (param_0.1: f32[]) -> f32[1024,1024] {
  %param_0.1 = f32[] parameter(0)
  ROOT %broadcast = f32[1024,1024]{1,0} broadcast(%param_0.1), dimensions={}
}

ENTRY %main (counter: s32[], value: f32[]) -> (s32[], f32[1024,1024]) {
  %counter = s32[] parameter(0)
  %value = f32[] parameter(1)
  %fill = f32[1024,1024]{1,0} fusion(%value), kind=kLoop, calls=%fused_fill
  %next = s32[] fusion(%counter), kind=kLoop, calls=%fused_add, control-predecessors={%fill}
  ROOT %tuple = (s32[], f32[1024,1024]{1,0}) tuple(%next, %fill)
}
"""


def test_names_after_the_operands_are_not_read():
    """Before: a loop counter's add was charged the buffers its control-predecessors
    named (13.95 GB a step of gpt2_124m's scanned program on the H200 target)."""
    kernels = {k["name"]: k["amount"] for k in gpu_kernels.priced_kernels(SCALAR_AFTER_A_BIG_WRITE)}
    assert kernels == {"fill": 4 + 4 * 1024 * 1024, "next": 8}
