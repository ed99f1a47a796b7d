"""Dropless experts on grouped matmuls: every choice computed, no capacity buffers.

The capacity path (models/moe.py) copies tokens into X x C buffers and runs every expert
over all its C seats, full or not; with C = T (dropless there) an expert computes every
token of its row. Here each device sorts its token choices by expert and runs the experts
as grouped matmuls over the sorted rows (`grouped_matmul`: row block g by expert g's
weights), so the experts' FLOPs are the routed tokens' own: T x K rows in all, not X x T.

The matmuls: tokamax's grouped-matmul kernels (Triton, Mosaic GPU) on an NVIDIA GPU when
tokamax is installed (`pip install "paisoar-jax[kernels]"`), else `jax.lax.ragged_dot`, which
XLA computes as one dense matmul over every expert at jax 0.10-0.11 (the CPU's results, the
same numbers; no saving). Rows past the groups give zeros, and an expert that got no row
gets a zero gradient.

The mesh (one shard_map over every axis; on CPU its collectives in fp32, as
parallel/context.py says why). Tokens stay split over the batch axes; each device holds
its experts (mesh.expert) with their hidden width split over tensor (the down matmul's
partial sums added over tensor). Under expert parallelism each device gathers the choices
of the rows its expert group holds, computes those routed to its own experts and adds each
token's outputs back to the device that holds it (a reduce-scatter): every device sends its
tokens to every expert device. A ragged all-to-all that sends each only where it is routed
is the GPU's next step. Shape suffixes: B rows, T tokens, D width, K choices a token,
X experts (L this device's), F hidden width (this device's share), N = B x T x K choices.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from paisoar_jax.errors import UserError
from paisoar_jax.numerics.precision import float32_island
from paisoar_jax.parallel.sharding import activation_axes
from paisoar_jax.runtime.platform import compile_platform, target_device


def grouped_matmul(x_MxD: jax.Array, w_GxDxF: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """Row block g of `x` (sizes_G[g] rows, in order) times w[g]; rows past them zeros.

    On an NVIDIA GPU with tokamax installed, its grouped-matmul kernels (and their
    gradients); elsewhere jax.lax.ragged_dot.
    """
    if compile_platform() == "gpu":
        try:
            import tokamax  # noqa: F401  (the `kernels` extra installs it)
        except ImportError:
            pass
        else:
            if target_device() is None:  # this process's GPU
                return _kernel(x_MxD, w_GxDxF, sizes_G)
            return _kernel_on_target(x_MxD, w_GxDxF, sizes_G)
    return jax.lax.ragged_dot(x_MxD, w_GxDxF, sizes_G)


def _kernel(x_MxD, w_GxDxF, sizes_G, implementation=("mosaic", "triton")):
    """The grouped matmul of tokamax: Mosaic GPU's kernel, else Triton's.

    Its tiles are tokamax's defaults for the shapes: it warns once per shape that it has
    not autotuned them (kept quiet: autotuning is a run of its own, `tokamax.autotune`).
    """
    import tokamax

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        return tokamax.ragged_dot(x_MxD, w_GxDxF, sizes_G, implementation=implementation)
    finally:
        absl.setLevel(level)


@jax.custom_vjp
def _kernel_on_target(x_MxD, w_GxDxF, sizes_G):
    """`_kernel` compiled for a target's GPU (plan --target), with its gradients.

    tokamax asks the default device what it is, when it traces the product and again when
    it traces the gradients: both happen with the target's device as the default. Triton's
    kernel: Mosaic GPU's picks its tiles by asking the process's own device.
    """
    return _kernel_on_target_forward(x_MxD, w_GxDxF, sizes_G)[0]


def _kernel_on_target_forward(x_MxD, w_GxDxF, sizes_G):
    with jax.default_device(target_device()):
        product = functools.partial(_kernel, sizes_G=sizes_G, implementation="triton")
        out_MxF, pullback = jax.vjp(product, x_MxD, w_GxDxF)
    return out_MxF, pullback


def _kernel_on_target_backward(pullback, d_out_MxF):
    with jax.default_device(target_device()):  # (the gradients are traced in the same plan)
        d_x_MxD, d_w_GxDxF = pullback(d_out_MxF)
    return d_x_MxD, d_w_GxDxF, None


_kernel_on_target.defvjp(_kernel_on_target_forward, _kernel_on_target_backward)


def dropless_experts(
    h_BxTxD: jax.Array,
    chosen_BxTxK: jax.Array,
    weights_BxTxK: jax.Array,
    kernels: tuple[jax.Array, jax.Array, jax.Array],
    biases: tuple[jax.Array, jax.Array, jax.Array] | None,
    activation: Callable,
) -> jax.Array:
    """Every token's experts' outputs, weighted and summed: B x T x D in h's dtype.

    `kernels`: gate X x D x F, up X x D x F, down X x F x D; `biases` (gate X x F, up
    X x F, down X x D) or None; `activation(gate, up)` the gated activation.
    """
    experts = kernels[0].shape[0]
    if jax.sharding.get_abstract_mesh().empty:  # one device: no collectives
        return _local_experts(
            h_BxTxD, chosen_BxTxK, weights_BxTxK, kernels, biases, experts, activation, False
        )
    local = functools.partial(
        _local_experts, experts=experts, activation=activation, collectives=True
    )
    dtype = h_BxTxD.dtype
    if compile_platform() == "cpu":  # XLA:CPU's half-precision collectives (module doc)
        h_BxTxD, kernels, biases = jax.tree.map(float32_island, (h_BxTxD, kernels, biases))
    rows = PartitionSpec(activation_axes("batch"), activation_axes("length"))
    kernel_specs = (
        PartitionSpec("expert", None, "tensor"),
        PartitionSpec("expert", None, "tensor"),
        PartitionSpec("expert", "tensor", None),
    )
    bias_specs = (PartitionSpec("expert", "tensor"),) * 2 + (PartitionSpec("expert"),)
    split = jax.shard_map(
        local,
        in_specs=(rows, rows, rows, kernel_specs, None if biases is None else bias_specs),
        out_specs=rows,
        # (Pallas kernels, tokamax's, declare no varying axes for their outputs.)
        check_vma=False,
    )
    return split(h_BxTxD, chosen_BxTxK, weights_BxTxK, kernels, biases).astype(dtype)


def check_mesh() -> None:
    """One line for a mesh the dropless path cannot run on (called as the model is built)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get("stage", 1) > 1:
        raise UserError(
            "model.moe_impl=dropless with mesh.stage > 1 is not supported yet: jax 0.10's "
            "ragged_dot does not batch over the pipeline's stages (use model.moe_impl=capacity)"
        )


def _local_experts(
    h_BxTxD, chosen_BxTxK, weights_BxTxK, kernels, biases, experts, activation, collectives
):
    """One device's side (inside the shard_map, `collectives`): its experts over its rows.

    Without `collectives` (no shard_map) it is the whole computation.
    """
    expert_devices = jax.lax.axis_size("expert") if collectives else 1
    tensor_devices = jax.lax.axis_size("tensor") if collectives else 1
    B, T, D = h_BxTxD.shape
    if expert_devices > 1:  # the choices of every row of this expert group
        h_BxTxD, chosen_BxTxK, weights_BxTxK = (
            jax.lax.all_gather(array, "expert", tiled=True)
            for array in (h_BxTxD, chosen_BxTxK, weights_BxTxK)
        )
    rows, K = h_BxTxD.shape[0], chosen_BxTxK.shape[-1]
    L = kernels[0].shape[0]  # this device's experts: first + 0 .. first + L - 1
    first = jax.lax.axis_index("expert") * L if expert_devices > 1 else 0
    assert L * expert_devices == experts, (L, expert_devices, experts)
    # Each choice's expert among this device's (L: another device's); sorted by it, stably,
    # so an expert's rows keep the tokens' order.
    own_N = chosen_BxTxK.reshape(-1) - first
    own_N = jnp.where((own_N >= 0) & (own_N < L), own_N, L)
    order_N = jnp.argsort(own_N, stable=True)
    sizes_L = jnp.bincount(own_N, length=L + 1)[:L]
    token_N = order_N // K  # the token (row x T + position) of each sorted choice
    x_NxD = h_BxTxD.reshape(rows * T, D)[token_N]
    gate_kernel, up_kernel, down_kernel = kernels
    gate_NxF = grouped_matmul(x_NxD, gate_kernel, sizes_L)
    up_NxF = grouped_matmul(x_NxD, up_kernel, sizes_L)
    expert_N = own_N[order_N]
    if biases is not None:  # (a row of another device's expert: its zeros stay zeros)
        gate_NxF, up_NxF = (
            product + _per_row(bias, expert_N, L)
            for product, bias in zip((gate_NxF, up_NxF), biases[:2], strict=True)
        )
    out_NxD = grouped_matmul(activation(gate_NxF, up_NxF), down_kernel, sizes_L)
    if tensor_devices > 1:  # each tensor device's share of F: partial sums
        out_NxD = jax.lax.psum(out_NxD, "tensor")
    if biases is not None:
        out_NxD = out_NxD + _per_row(biases[2], expert_N, L)
    weight_N = weights_BxTxK.reshape(-1)[order_N].astype(out_NxD.dtype)
    weight_N = jnp.where(expert_N < L, weight_N, 0)  # another device's choices add nothing
    y_SxD = jnp.zeros((rows * T, D), out_NxD.dtype).at[token_N].add(out_NxD * weight_N[:, None])
    y_BxTxD = y_SxD.reshape(rows, T, D)
    if expert_devices > 1:  # each token's sum over the expert devices, back to its own
        y_BxTxD = jax.lax.psum_scatter(y_BxTxD, "expert", scatter_dimension=0, tiled=True)
    assert y_BxTxD.shape == (B, T, D), (y_BxTxD.shape, (B, T, D))
    return y_BxTxD


def _per_row(bias_LxF: jax.Array, expert_N: jax.Array, experts: int) -> jax.Array:
    """Each sorted row's expert's bias (zeros for a row of another device's expert)."""
    padded = jnp.concatenate([bias_LxF, jnp.zeros_like(bias_LxF[:1])])
    return padded[expert_N]
