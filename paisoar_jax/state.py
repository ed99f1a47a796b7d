"""The train state and its sharded initialisation.

Nothing full-size is ever built on one device: the model is first traced abstractly
(`nnx.eval_shape`), its logical axis names give every parameter a sharding, the optimizer
state's sharding follows from the parameters', and only then does `jax.jit(init,
out_shardings=...)` create the real arrays, each device computing just its own shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from paisoar_jax import sharding
from paisoar_jax.config import Config
from paisoar_jax.models import build_model
from paisoar_jax.precision import get_policy


@struct.dataclass
class TrainState:
    """Everything that changes during training, as one pytree of arrays."""

    step: jax.Array
    params: dict[str, Any]  # nnx.Param values as a pure nested dict
    # Every other model variable (BatchNorm's running statistics): updated by the forward
    # pass, not by the optimizer. An empty dict for models that have none (gpt).
    model_state: dict[str, Any]
    opt_state: optax.OptState
    # The run's random key (raw uint32[2]): randomness of step s is fold_in(rng, s), so the
    # key and the step saved in a checkpoint reproduce it exactly on resume.
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The static half of the state: the model's graph, the optimizer and the shardings."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    shardings: TrainState  # a TrainState of NamedShardings
    gradient_shardings: dict[str, Any]  # where gradients go before the update (ZeRO >= 1)
    param_count: int
    abstract_state: TrainState  # shapes, dtypes and shardings: the target of a restore
    # The dtype weights are gathered in when params are split over devices (FSDP, ZeRO-3)
    # and computed in a narrower dtype; None when nothing is gathered or nothing is cast.
    gather_dtype: Any = None


def _model_factory(config: Config):
    """A zero-argument function that builds the configured model from the run's seed."""
    policy = get_policy(config.precision.policy)

    def create() -> nnx.Module:
        # Eager sharding off: shardings are given to jit below, not attached at creation.
        with nnx.use_eager_sharding(False):
            return build_model(
                config.model, policy, config.remat.policy, nnx.Rngs(params=config.train.seed)
            )

    return create


def plan_state(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation) -> StateLayout:
    """Traces model and optimizer abstractly and derives every sharding from the rules."""
    create_model = _model_factory(config)
    graphdefs = []

    def split_model():
        graphdef, params, model_state = nnx.split(create_model(), nnx.Param, ...)
        graphdefs.append(graphdef)  # static: the same for the abstract and the real model
        return params, model_state

    # jax.eval_shape rather than nnx.eval_shape: the latter would resolve the logical names
    # against the active mesh, and `layers`, `embed`, ... are not mesh axes.
    abstract_variables, abstract_model_variables = jax.eval_shape(split_model)
    graphdef = graphdefs[0]
    abstract_params = nnx.to_pure_dict(abstract_variables)
    abstract_model_state = nnx.to_pure_dict(abstract_model_variables)
    logical_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_variables))
    param_shardings = sharding.tree_shardings(
        logical_specs, abstract_params, mesh, sharding.parameter_rules(config.mesh.zero)
    )
    state_param_shardings = sharding.tree_shardings(
        logical_specs,
        abstract_params,
        mesh,
        sharding.parameter_rules(config.mesh.zero, optimizer_state=True),
    )
    model_state_shardings = sharding.tree_shardings(
        nnx.to_pure_dict(nnx.get_partition_spec(abstract_model_variables)),
        abstract_model_state,
        mesh,
        sharding.parameter_rules(config.mesh.zero),
    )
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, param_sharding: param_sharding,
        abstract_opt_state,
        state_param_shardings,
        transform_non_params=lambda _: sharding.replicated(mesh),
    )
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=param_shardings,
        model_state=model_state_shardings,
        opt_state=opt_shardings,
        rng=sharding.replicated(mesh),
    )
    param_count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    abstract_state = jax.tree.map(
        lambda shape, leaf_sharding: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=leaf_sharding
        ),
        TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=abstract_params,
            model_state=abstract_model_state,
            opt_state=abstract_opt_state,
            rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        ),
        shardings,
    )
    policy = get_policy(config.precision.policy)
    params_split = not all(leaf.is_fully_replicated for leaf in jax.tree.leaves(param_shardings))
    narrower = policy.compute_dtype != policy.param_dtype
    return StateLayout(
        graphdef,
        optimizer,
        shardings,
        state_param_shardings,
        param_count,
        abstract_state,
        gather_dtype=policy.compute_dtype if params_split and narrower else None,
    )


def init_state(config: Config, layout: StateLayout) -> TrainState:
    """Creates the train state directly in its shardings (jit with out_shardings)."""
    create_model = _model_factory(config)

    def init() -> TrainState:
        _, variables, model_variables = nnx.split(create_model(), nnx.Param, ...)
        params = nnx.to_pure_dict(variables)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=nnx.to_pure_dict(model_variables),
            opt_state=layout.optimizer.init(params),
            rng=jax.random.PRNGKey(config.train.seed),
        )

    return jax.jit(init, out_shardings=layout.shardings)()
