"""fp8 matmuls (precision.policy=fp8), for Hopper-class GPUs: delayed or current scaling.

Each fp8 matmul quantizes its input and kernel to e4m3 and, in the backward pass, the
incoming gradient to e5m2, each with a per-tensor scale. Delayed scaling (NVIDIA
Transformer Engine's recipe): the scale used at step s comes from the largest |value| seen
in the previous `AMAX_HISTORY` steps, so quantizing needs no extra pass over the tensor;
the current step's amax is recorded for the next. The quantize, dequantize and
scale-update math is flax's (`flax.linen.fp8_ops.fp8_scaled_dot_general`): it emits a real
fp8 `dot_general`, which XLA runs as a cuBLASLt fp8 GEMM on an H100/H200 and emulates
elsewhere (so CPU tests check the numerics, not the speed).

The scales and histories are `Fp8Meta` variables: part of the train state's
`model_state`, saved in checkpoints, never seen by the optimizer. flax returns their new
values as their "gradients" (the backward pass is where the gradient's amax is known); the
train step (step.py) writes those over the old values instead of applying them. So each
Fp8Dot must be called once per forward pass: two calls would sum their "gradients".

Current scaling (precision.fp8=tensorwise or rowwise; `current_scaled`), torchao's and
torchtitan's default: each operand is scaled from its own amax as it is quantized, one scale
per tensor or one per row along the axes the matmul contracts, and each of the three GEMMs
(forward, input gradient, weight gradient) quantizes its operands for its own contraction.
It costs an amax pass over each operand and holds no state (the blocks keep their Fp8Meta,
unused, so a checkpoint has one shape whatever the scaling). Each GEMM is a dot of fp8
operands with fp32 accumulation, its scales multiplied in after; a matmul with a side under
precision.fp8_min_size stays in the compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from paisoar_jax.numerics.precision import Policy

# Steps of amax history a scale is taken from (Transformer Engine's default length). Each
# micro-batch is a step here: with train.grad_accum = k the history spans 1024 / k
# optimizer steps.
AMAX_HISTORY = 1024

# The three quantized tensors of one matmul, in flax's argument names.
_TENSORS = ("lhs", "rhs", "grad")

# The matmuls of a transformer block that run in fp8 (attention and the logits do not).
BLOCK_MATMULS = ("qkv", "out", "mlp_in", "mlp_out")


class Fp8Meta(nnx.Variable):
    """A scale or amax history of an fp8 matmul: overwritten each step, not trained."""


class Fp8Dot(nnx.Module):
    """The scaling state of one fp8 matmul, and the matmul itself.

    `history` is the amax history length; every variable is replicated (its one logical
    axis is unnamed), and a stacked (scanned) block adds the `layers` axis in front.
    """

    def __init__(self, history: int = AMAX_HISTORY):
        for tensor in _TENSORS:
            setattr(self, f"{tensor}_scale", Fp8Meta(jnp.ones((1,)), out_sharding=(None,)))
            history_values = jnp.zeros((history,))
            setattr(self, f"{tensor}_amax_history", Fp8Meta(history_values, out_sharding=(None,)))

    def __call__(self, x: jax.Array, kernel: jax.Array, contracting: int = 1) -> jax.Array:
        """The product of x and kernel over x's last and kernel's first `contracting` axes.

        Both operands arrive in the compute dtype (bf16); so does the result.
        """
        x_axes = tuple(range(x.ndim - contracting, x.ndim))
        kernel_axes = tuple(range(contracting))
        return fp8_ops.fp8_scaled_dot_general(
            x,
            kernel,
            ((x_axes, kernel_axes), ((), ())),
            preferred_element_type=x.dtype,
            quantize_compute_type=x.dtype,
            **self.meta(),
        )

    def meta(self) -> dict[str, jax.Array]:
        """The scales and amax histories, by flax's argument names."""
        return {
            name: getattr(self, name)[...]
            for tensor in _TENSORS
            for name in (f"{tensor}_scale", f"{tensor}_amax_history")
        }


@jax.custom_vjp
def _keep_meta(y: jax.Array, meta: dict[str, jax.Array]) -> jax.Array:
    """`y`; in the backward pass, `meta` comes back as its own "gradient".

    For a matmul that skips its fp8 state: the train step writes each Fp8Meta's gradient
    over it, and without this the unused state's zero gradient would set every scale to 0.
    """
    return y


def _keep_meta_forward(y, meta):
    return y, meta


def _keep_meta_backward(meta, cotangent):
    return cotangent, meta


_keep_meta.defvjp(_keep_meta_forward, _keep_meta_backward)


def block_dots(policy: Policy, names: tuple[str, ...] = BLOCK_MATMULS) -> nnx.Dict | None:
    """One Fp8Dot per named matmul of a transformer block under an fp8 policy; else None."""
    return nnx.Dict({name: Fp8Dot() for name in names}) if policy.fp8 else None


def matmul(
    equation: str,
    x: jax.Array,
    kernel: jax.Array,
    name: str,
    *,
    policy: Policy,
    dots: nnx.Dict | None,
) -> jax.Array:
    """`einsum(equation, x, kernel)` in the compute dtype, through `dots[name]` under fp8.

    The equation must contract x's last axes with the kernel's first ones and keep the rest
    in order ("btd,df->btf"). A block forced to another policy (precision.force_policy)
    skips its fp8 matmuls and keeps their scaling state as it is.
    """
    kernel = policy.cast_to_compute(kernel)
    contracting = _contracting(equation) if policy.fp8 else 0
    if not policy.fp8 or _too_small(kernel, contracting, policy.fp8_min_size):
        y = jnp.einsum(equation, x, kernel)
        return y if dots is None else _keep_meta(y, dots[name].meta())
    if dots is None:
        raise ValueError("this block was built without fp8 state: build it under the fp8 policy")
    if policy.fp8_scaling != "delayed":
        y = current_scaled(x, kernel, contracting, policy.fp8_scaling == "rowwise")
        return _keep_meta(y, dots[name].meta())
    return dots[name](x, kernel, contracting)


def _contracting(equation: str) -> int:
    """How many of x's last axes an fp8 matmul's equation contracts with the kernel's first.

    The other axes must stay in order (x's, then the kernel's): a ValueError otherwise.
    """
    inputs, output = equation.split("->")
    x_axes, kernel_axes = inputs.split(",")
    contracting = len(set(x_axes) - set(output))
    x_free, x_contracted = x_axes[: len(x_axes) - contracting], x_axes[len(x_axes) - contracting :]
    if x_contracted != kernel_axes[:contracting] or output != x_free + kernel_axes[contracting:]:
        raise ValueError(
            f"{equation}: an fp8 matmul contracts x's last axes with the kernel's first and "
            "keeps the other axes in order"
        )
    return contracting


def _too_small(kernel: jax.Array, contracting: int, min_size: int) -> bool:
    """Whether the matmul's contracted or output size is under `min_size` (0: never)."""
    if not min_size:
        return False
    contracted = math.prod(kernel.shape[:contracting])
    return min(contracted, math.prod(kernel.shape[contracting:])) < min_size


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _scaled_dot(a, b, a_contracted, b_contracted, a_type, b_type, rowwise: bool):
    """dot_general(a, b) over the given axes in fp8, each operand scaled from its amax now.

    Rowwise: a scale per element of the axes a matmul keeps (each row of `a`, each column of
    `b`), from the amax over the axes it contracts; else one per operand. The fp8 product
    accumulates in fp32; the scales multiply the result.
    """

    def quantized(array, contracted, dtype):
        axes = contracted if rowwise else tuple(range(array.ndim))
        amax = jnp.max(jnp.abs(array.astype(jnp.float32)), axis=axes, keepdims=True)
        scale = jnp.maximum(amax, 1e-12) / float(jnp.finfo(dtype).max)
        quantized = (array.astype(jnp.float32) / scale).astype(dtype)
        return quantized, jnp.squeeze(scale, axis=axes) if rowwise else scale.reshape(())

    qa, scale_a = quantized(a, a_contracted, a_type)
    qb, scale_b = quantized(b, b_contracted, b_type)
    dims = ((a_contracted, b_contracted), ((), ()))
    out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
    if rowwise:  # the result's axes: a's kept, then b's kept
        kept_b = b.ndim - len(b_contracted)
        return out * scale_a.reshape(scale_a.shape + (1,) * kept_b) * scale_b
    return out * (scale_a * scale_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def current_scaled(x: jax.Array, kernel: jax.Array, contracting: int, rowwise: bool):
    """The product of x and kernel over x's last and its first `contracting` axes, current-scaled.

    e4m3 operands forward; the gradient e5m2 in both backward GEMMs. In x's dtype.
    """
    x_axes = tuple(range(x.ndim - contracting, x.ndim))
    out = _scaled_dot(x, kernel, x_axes, tuple(range(contracting)), E4M3, E4M3, rowwise)
    return out.astype(x.dtype)


def _current_scaled_forward(x, kernel, contracting, rowwise):
    return current_scaled(x, kernel, contracting, rowwise), (x, kernel)


def _current_scaled_backward(contracting, rowwise, residuals, d_out):
    x, kernel = residuals
    kept_x = x.ndim - contracting  # x's free axes lead d_out; the kernel's free ones follow
    d_out_kernel_axes = tuple(range(kept_x, d_out.ndim))
    kernel_free_axes = tuple(range(contracting, kernel.ndim))
    # d_x = d_out . kernel over the kernel's free axes: x_free + x_contracted, x's order.
    d_x = _scaled_dot(d_out, kernel, d_out_kernel_axes, kernel_free_axes, E5M2, E4M3, rowwise)
    # d_kernel = x . d_out over x's free axes: x_contracted + kernel_free, the kernel's order.
    free = tuple(range(kept_x))
    d_kernel = _scaled_dot(x, d_out, free, free, E4M3, E5M2, rowwise)
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


current_scaled.defvjp(_current_scaled_forward, _current_scaled_backward)


def meta_mask(graphdef: nnx.GraphDef, params: dict, model_state: dict) -> dict:
    """`model_state` (a pure dict) with True at every Fp8Meta leaf and False elsewhere."""
    model = nnx.merge(graphdef, params, model_state)
    meta = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
    meta_paths = {path for path, _ in jax.tree_util.tree_flatten_with_path(meta)[0]}
    return jax.tree_util.tree_map_with_path(lambda path, _: path in meta_paths, model_state)
