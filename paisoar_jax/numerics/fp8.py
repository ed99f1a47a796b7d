"""fp8 matmuls with delayed scaling (precision.policy=fp8), for Hopper-class GPUs.

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
"""

from __future__ import annotations

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
    if not policy.fp8:
        y = jnp.einsum(equation, x, kernel)
        return y if dots is None else _keep_meta(y, dots[name].meta())
    if dots is None:
        raise ValueError("this block was built without fp8 state: build it under the fp8 policy")
    inputs, output = equation.split("->")
    x_axes, kernel_axes = inputs.split(",")
    contracting = len(set(x_axes) - set(output))
    x_free, x_contracted = x_axes[: len(x_axes) - contracting], x_axes[len(x_axes) - contracting :]
    if x_contracted != kernel_axes[:contracting] or output != x_free + kernel_axes[contracting:]:
        raise ValueError(
            f"{equation}: an fp8 matmul contracts x's last axes with the kernel's first and "
            "keeps the other axes in order"
        )
    return dots[name](x, kernel, contracting)


def meta_mask(graphdef: nnx.GraphDef, params: dict, model_state: dict) -> dict:
    """`model_state` (a pure dict) with True at every Fp8Meta leaf and False elsewhere."""
    model = nnx.merge(graphdef, params, model_state)
    meta = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
    meta_paths = {path for path, _ in jax.tree_util.tree_flatten_with_path(meta)[0]}
    return jax.tree_util.tree_map_with_path(lambda path, _: path in meta_paths, model_state)
