"""The trained model as a plain NNX module, for inference in plain Python.

`fit` hands it back as `result.model`; `load(run_dir_or_step, model=factory)` rebuilds the
same from any run directory (its newest checkpoint), checkpoint step or export:

    result = paisoar_jax.fit(..., model=MyModel, ...)
    model = result.model                                    # or, later, anywhere:
    model = paisoar_jax.load("runs/my_run", model=MyModel)
    model.eval()                                            # dropout off, BatchNorm's averages
    logits = model(x)
    llama = paisoar_jax.load("imported")                    # a zoo run or import: no factory

The module is the factory's, built afresh (so it computes as the factory wrote it: fp32
unless a layer says otherwise; the training run's bf16/fp16 policy is not applied) and
holding the trained weights (fp32 master weights) and model state (BatchNorm's running
statistics, rng stream counters), as arrays on the default device.
"""

from __future__ import annotations

import pathlib
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from paisoar_jax.checkpointing import weights
from paisoar_jax.config import LoraConfig
from paisoar_jax.engine import lora


def model_with(
    factory: Callable[[nnx.Rngs], nnx.Module],
    params: Any,
    model_state: Any,
    adapters: LoraConfig | None = None,
) -> nnx.Module:
    """The factory's module holding `params` and `model_state` (pure dicts, any placement).

    `adapters`: the run's lora section; when enabled, the module gets its adapters, as the
    run did.
    Every array is gathered whole onto this process's first device: under several
    processes a collective, so every process must call it.
    """
    graphdef, abstract_params, abstract_rest = _abstract(_as_run_built(factory, adapters))
    nnx.replace_by_pure_dict(abstract_params, _on_this_host(params))
    nnx.replace_by_pure_dict(abstract_rest, _on_this_host(model_state))
    return nnx.merge(graphdef, abstract_params, abstract_rest)


def load(
    where: pathlib.Path,
    model: Callable[[nnx.Rngs], nnx.Module],
    adapters: LoraConfig | None = None,
    ema: bool = False,
) -> nnx.Module:
    """The module `model` builds, with the weights of a checkpoint step or an export.

    `where` holds them (`runs/x/checkpoints/400`, an export); `paisoar_jax.load` finds it
    for a run directory too. Their shapes are checked against the module's. `adapters`:
    the run's lora section, whose adapters (if enabled) the module gets. `ema`: the
    weights' moving average.
    """
    model = _as_run_built(model, adapters)
    _, abstract_params, abstract_rest = _abstract(model)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    place = lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
    target = types.SimpleNamespace(
        params=jax.tree.map(place, nnx.to_pure_dict(abstract_params)),
        model_state=jax.tree.map(place, nnx.to_pure_dict(abstract_rest)),
    )
    params, model_state = weights.load_weights(where, target, ema)
    if model_state is None:  # none saved (load_weights warned, or the model has none)
        model_state = _fresh_state(model) if jax.tree.leaves(abstract_rest) else {}
    return model_with(model, params, model_state)


def _as_run_built(factory: Callable, adapters: LoraConfig | None) -> Callable:
    """`factory`, its module given the LoRA adapters the run added (if any).

    The adapters' initial values do not matter: the weights loaded replace them.
    """
    if adapters is None or not adapters.enabled:
        return factory

    def with_adapters(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)
        lora.add_adapters(model, adapters, seed=0)
        return model

    return with_adapters


def _fresh_state(factory: Callable[[nnx.Rngs], nnx.Module]) -> Any:
    """A newly built module's model state (BatchNorm's, fp8 scales), placed on no mesh.

    Built with eager sharding off: a factory whose params are annotated with logical axis
    names (every zoo model's) would otherwise need a mesh and its axis rules.
    """
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.split(factory(nnx.Rngs(0)), nnx.Param, ...)[2])


def _abstract(factory: Callable[[nnx.Rngs], nnx.Module]):
    """(graphdef, params, other variables) of factory's module, traced, not built."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)


def _on_this_host(tree: Any) -> Any:
    """Arrays gathered whole onto this process's default device (a sharded run's too)."""

    def whole(leaf):
        device = jax.local_devices()[0]
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            # Typed keys (an nnx.Rngs stream) travel as their raw data.
            data = whole(jax.random.key_data(leaf))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        return jax.device_put(np.asarray(leaf), device)

    return jax.tree.map(whole, tree)
