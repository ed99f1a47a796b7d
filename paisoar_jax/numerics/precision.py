"""Mixed-precision policies: which dtype params are stored in and which dtype math runs in.

Params stay fp32 (the master weights); a module casts them to `compute_dtype` where it uses
them. Layer norm, attention logits and softmax, the final logits (unless
model.fp32_logits=false) and the loss run in fp32 whatever the policy. fp8 is bf16 with the
transformer blocks' matmuls in fp8 (fp8.py). To keep more in fp32 (what PyTorch's
autocast(enabled=False) or custom_fwd do):

- a function: decorate it with `@fp32_function`; its floating inputs arrive in fp32;
- a submodule: `force_policy(model.blocks, "fp32")` before training (for a model of one's
  own, in the factory given to fit); every module under it computes in fp32 from then on.

A model of one's own built from flax's layers follows the policy through `follow_policy`:
each Linear, LinearGeneral, Einsum, Conv, ConvTranspose, Embed and MultiHeadAttention left
at `dtype=None` computes in the compute dtype (flax casts its inputs, kernel and bias to it),
and each LayerNorm, RMSNorm, GroupNorm and BatchNorm outputs the compute dtype while flax
keeps its statistics in fp32. A layer given a dtype of its own keeps it (an Embed's dtype
equal to its param_dtype counts as flax's default). What stays as the user wrote it: their
own jnp math (it sees compute-dtype activations and weights), the
softmax inside MultiHeadAttention (flax's, in the compute dtype after its max-subtraction)
and the loss (cast its logits to fp32 before a cross-entropy; the returned loss is fp32).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.errors import UserError


def allow_fp16_dots_on_cpu() -> None:
    """Lets XLA:CPU run dot_general's F16_F16_F32 algorithm: fp16 operands, fp32 accumulation.

    jax.nn.dot_product_attention (behind nnx.MultiHeadAttention and nnx.dot_product_attention)
    asks for it on fp16 inputs, and jax's CPU lowering refuses it ("The precision
    'F16_F16_F32' is not supported by dot_general on CPU"), at compile time, where jax's own
    fallback to the default precision never runs. F32_F32_F32 is the same product: fp16
    converts to fp32 exactly, the sum is fp32, the output keeps the dtype asked for. Other
    platforms, and every other precision, lower as jax lowers them.
    """
    from jax._src.interpreters import mlir
    from jax._src.lax import lax as lax_internal

    lower = getattr(lax_internal, "_dot_general_lower", None)
    if lower is None:  # another jax: its own lowering (compilation.py names the failure)
        return
    presets = jax.lax.DotAlgorithmPreset

    def lower_on_cpu(ctx, *args, precision, **params):
        if precision == presets.F16_F16_F32:
            precision = presets.F32_F32_F32
        return lower(ctx, *args, precision=precision, **params, platform="cpu")

    mlir.register_lowering(jax.lax.dot_general_p, lower_on_cpu, platform="cpu")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameter storage, compute and module outputs."""

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32
    # The transformer blocks' matmuls in fp8 (fp8.py); the rest of the math in compute_dtype.
    fp8: bool = False
    # fp8's scales: delayed (from past steps' amax), tensorwise or rowwise (current, from the
    # tensor being quantized); matmuls with a side under fp8_min_size stay in compute_dtype.
    fp8_scaling: str = "delayed"
    fp8_min_size: int = 0

    def cast_to_compute(self, x: jax.Array) -> jax.Array:
        """Casts a floating array to the compute dtype (integers pass unchanged)."""
        return x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


PRESETS = {
    "fp32": Policy(),
    "bf16": Policy(compute_dtype=jnp.bfloat16),
    "fp16": Policy(compute_dtype=jnp.float16),
    "fp8": Policy(compute_dtype=jnp.bfloat16, fp8=True),
}


def get_policy(name: str) -> Policy:
    """The preset policy called `name` (fp32, bf16, fp16, fp8)."""
    if name not in PRESETS:
        raise UserError(f"precision.policy={name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]


def policy_of(precision_config) -> Policy:
    """The policy a precision section asks for, its fp8 scaling included (a zoo model's)."""
    policy = get_policy(precision_config.policy)
    if not policy.fp8:
        return policy
    return dataclasses.replace(
        policy,
        fp8_scaling=precision_config.fp8,
        fp8_min_size=precision_config.fp8_min_size,
    )


def fp32_function(function: Callable) -> Callable:
    """Decorator: runs `function` with every floating array argument cast to fp32.

    Args:
        function: a function of arrays (a norm, a softmax of one's own).

    Returns:
        `function`, its floating arguments cast to fp32 first.

    Example:
        ```python
        import jax
        import jax.numpy as jnp

        import paisoar_jax


        @paisoar_jax.fp32_function
        def rms_norm(x):
            return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


        print(rms_norm(jnp.ones((2, 4), jnp.bfloat16)).dtype)  # float32
        ```

    """

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        cast = lambda x: float32_island(x) if _is_floating_array(x) else x
        return function(*jax.tree.map(cast, args), **jax.tree.map(cast, kwargs))

    return wrapped


def _is_floating_array(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def force_policy(module: nnx.Module, name: str) -> None:
    """Makes `module` and every module under it compute with the preset policy `name`.

    Args:
        module: an nnx.Module of the model (a head to keep in fp32, say).
        name: a precision.policy preset: `fp32`, `bf16`, `fp16`, `fp8`.

    Example:
        ```python
        import jax.numpy as jnp
        from flax import nnx

        import paisoar_jax


        class Classifier(nnx.Module):
            def __init__(self, rngs):
                self.body = nnx.Linear(16, 64, rngs=rngs)
                self.head = nnx.Linear(64, 10, rngs=rngs)
                paisoar_jax.force_policy(self.head, "fp32")  # the head in fp32 in a bf16 run

            def __call__(self, x):
                return self.head(self.body(x))


        print(Classifier(nnx.Rngs(0))(jnp.ones((2, 16))).shape)  # (2, 10)
        ```

    """
    policy = get_policy(name)
    for _, submodule in nnx.iter_modules(module):
        # The zoo's modules read `policy`; in a model of one's own it marks the weights the
        # step casts to this policy's dtype (state.compute_casts). Another `policy` stays.
        if isinstance(submodule, nnx.Dict):  # an attribute of a Dict is one of its entries
            continue
        if isinstance(getattr(submodule, "policy", None), Policy | None):
            submodule.policy = policy


# flax layers whose `dtype` is the dtype they compute in (matmuls, convolutions, lookups) or,
# for the norms, the dtype of their output (their statistics are fp32 whatever it is).
POLICY_LAYERS = (
    nnx.Linear,
    nnx.LinearGeneral,
    nnx.Einsum,
    nnx.Conv,
    nnx.ConvTranspose,
    nnx.Embed,
    nnx.MultiHeadAttention,
    nnx.LayerNorm,
    nnx.RMSNorm,
    nnx.GroupNorm,
    nnx.BatchNorm,
)


def follow_policy(model: nnx.Module, policy: Policy) -> int:
    """Sets the compute dtype on every flax layer of `model` left at dtype=None.

    A layer under a module `force_policy` marked takes that module's policy. Returns how
    many layers were set (0 under fp32, where None already means fp32 for fp32 inputs).
    """
    policy_at = policy_lookup(model, policy)
    if any(policy_at(path).compute_dtype == jnp.float16 for path, _ in nnx.iter_modules(model)):
        allow_fp16_dots_on_cpu()  # stock attention asks CPU for an algorithm jax refuses there
    changed = 0
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, POLICY_LAYERS) or not _dtype_left_unset(module):
            continue
        compute = policy_at(path).compute_dtype
        if compute != jnp.float32:
            module.dtype = compute
            changed += 1
    return changed


def policy_lookup(model: nnx.Module, default: Policy) -> Callable[[tuple], Policy]:
    """A function of a module path: the policy `force_policy` set nearest at or above it.

    `default` where none is; paths are tuples of attribute names and indices.
    """
    forced = {
        path: module.policy
        for path, module in nnx.iter_modules(model)
        if isinstance(getattr(module, "policy", None), Policy)
    }

    def policy_at(path: tuple) -> Policy:
        owner = next((path[:n] for n in range(len(path), -1, -1) if path[:n] in forced), None)
        return default if owner is None else forced[owner]

    return policy_at


def _dtype_left_unset(layer: nnx.Module) -> bool:
    """Whether a flax layer's dtype is its default (nnx.Embed turns None into param_dtype)."""
    if isinstance(layer, nnx.Embed):
        return layer.dtype == layer.param_dtype
    return layer.dtype is None


def float32_island(x: jax.Array) -> jax.Array:
    """Casts to fp32 for a numerically sensitive op (norms, softmax, logits, loss)."""
    return x.astype(jnp.float32)


def matmul_fp32_out(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(subscripts, x, w)` accumulated and returned in fp32 (logits, class scores).

    Its backward pass runs in the inputs' dtype: the fp32 cotangent is rounded to it before
    the two gradient matmuls, as PyTorch's autocast does. Plain autodiff would multiply the
    fp32 cotangent with the 16-bit operands as fp32 x fp32 gemms, several times slower on a
    GPU (the GPU-target plan names them: tools/plan/gpu_kernels.py). With fp32 inputs it is the
    plain einsum.
    """
    if x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return jnp.einsum(subscripts, x, w)
    return _matmul_fp32_out(subscripts, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_fp32_out(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, x, w, preferred_element_type=jnp.float32)


def _matmul_fp32_out_forward(subscripts, x, w):
    return _matmul_fp32_out(subscripts, x, w), (x, w)


def _matmul_fp32_out_backward(subscripts, residuals, cotangent):
    x, w = residuals
    inputs, output = subscripts.split("->")
    x_axes, w_axes = inputs.split(",")
    cotangent = cotangent.astype(x.dtype)
    dx = jnp.einsum(
        f"{output},{w_axes}->{x_axes}", cotangent, w, preferred_element_type=jnp.float32
    )
    dw = jnp.einsum(
        f"{x_axes},{output}->{w_axes}", x, cotangent, preferred_element_type=jnp.float32
    )
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul_fp32_out.defvjp(_matmul_fp32_out_forward, _matmul_fp32_out_backward)
