"""The train state and its sharded initialisation.

Nothing full-size is ever built on one device: the model is first traced abstractly
(`nnx.eval_shape`), its logical axis names give every parameter a sharding, the optimizer
state's sharding follows from the parameters', and only then does `jax.jit(init,
out_shardings=...)` create the real arrays, each device computing just its own shards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from paisoar_jax import output
from paisoar_jax.config import MeshConfig, ShardingConfig, TrainConfig
from paisoar_jax.engine import lora
from paisoar_jax.engine.muon import NeedsAxes
from paisoar_jax.engine.optim import decay_mask
from paisoar_jax.numerics.precision import Policy, get_policy, policy_lookup
from paisoar_jax.parallel import grad_comm, pipeline, rules, sharding
from paisoar_jax.parallel.pipeline import Pipeline


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
    # The compressed gradient exchange's state (grad_comm.py): {"residual": ...} with error
    # feedback, else empty.
    comm: dict[str, Any] = struct.field(default_factory=dict)
    # train.ema_decay > 0: {"params": the moving average of the params}, else empty.
    ema: dict[str, Any] = struct.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LayoutSettings:
    """The config sections a state's layout reads (run/setup.py hands them over)."""

    mesh: MeshConfig  # zero, grad_comm and the pipeline's stages
    sharding: ShardingConfig  # the parameter rules
    train: TrainConfig  # ema_decay and the pipeline's micro-batches
    precision_policy: str  # precision.policy
    lora: bool  # lora.enabled: only the adapters train


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The static half of the state: the model's graph, the optimizer and the shardings."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    shardings: TrainState  # a TrainState of NamedShardings
    gradient_shardings: dict[str, Any]  # where gradients go before the update (ZeRO >= 1)
    param_count: int
    abstract_state: TrainState  # shapes, dtypes and shardings: the target of a restore
    # Builds the model (the run's seed, remat and precision settings applied); traced only.
    create_model: Callable[[], nnx.Module]
    # Per parameter, the dtype it is cast to before the forward pass where it is stored (so
    # an FSDP gather moves that dtype), or None to pass it as stored; None for the whole
    # tree when nothing is cast here (each zoo layer then casts as it uses its weights).
    compute_dtypes: Any = None
    # mesh.stage > 1: the schedule `pipeline.scan_layers` runs the model's stack with.
    pipeline: Pipeline | None = None
    # mesh.grad_comm=bf16|int8: the compressed gradient exchange (grad_comm.py), else None.
    exchange: grad_comm.Exchange | None = None
    # LoRA (lora.py): the key paths of the params that train, the rest frozen; None: all.
    trainable: frozenset[tuple] | None = None
    trainable_count: int = 0  # the parameters that train (param_count without LoRA)
    ema_decay: float = 0.0  # train.ema_decay: the weights' moving average (0: none)

    @property
    def flops_param_count(self) -> float:
        """N of the 6 N rule of training FLOPs per token or example.

        A frozen weight (LoRA) costs 4 of the 6: its forward product and its input's
        gradient, but no weight gradient.
        """
        frozen = self.param_count - self.trainable_count
        return self.trainable_count + frozen * 2 / 3

    def describe_size(self) -> str:
        """`0.86M params`, and with LoRA the part that trains: `(LoRA: 12,288 trainable)`."""
        size = output.describe_params(self.param_count)
        if self.trainable is None:
            return size
        trainable = output.describe_params(self.trainable_count).removesuffix(" params")
        return f"{size} (LoRA: {trainable} trainable)"


def state_layout(
    mesh: Mesh,
    optimizer: optax.GradientTransformation | NeedsAxes,
    create_model: Callable[[], nnx.Module],
    follows_policy: bool,
    *,
    settings: LayoutSettings,
) -> StateLayout:
    """Traces model and optimizer abstractly and derives every sharding.

    `follows_policy`: the model's own modules cast to the precision policy (the zoo's);
    otherwise the step casts its weights (not norms or biases) to the compute dtype.
    """
    graphdef, abstract_variables, abstract_model_variables = _trace_model(create_model)
    policy = get_policy(settings.precision_policy)
    # LoRA: only the adapters train; the frozen weights are stored in the compute dtype.
    trainable = lora.trainable_paths(abstract_variables) if settings.lora else None
    abstract_params = _frozen_in_compute_dtype(
        nnx.to_pure_dict(abstract_variables), trainable, policy
    )
    logical_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_variables))
    param_shardings, state_param_shardings = rules.parameter_shardings(
        abstract_params, logical_specs, mesh, settings.sharding, settings.mesh.zero
    )
    # What the optimizer and the gradients see: the trainable params (all, without LoRA).
    trained_params = trainable_part(abstract_params, trainable)
    if isinstance(optimizer, NeedsAxes):  # Muon: its matrices by their logical axes
        optimizer = optimizer.build(trainable_part(logical_specs, trainable), trained_params)
    state_param_shardings = trainable_part(state_param_shardings, trainable)
    abstract_model_state, model_state_shardings = _model_state_layout(
        abstract_model_variables, mesh, settings.mesh.zero
    )
    abstract_opt_state, opt_shardings = _optimizer_layout(
        optimizer, trained_params, state_param_shardings, mesh
    )
    trained_shardings = trainable_part(param_shardings, trainable)
    exchange = grad_comm.plan(
        settings.mesh, mesh, trained_params, trained_shardings, state_param_shardings
    )
    grad_comm.check_model_state(exchange, abstract_model_state)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=param_shardings,
        model_state=model_state_shardings,
        opt_state=opt_shardings,
        rng=sharding.replicated(mesh),
        comm=grad_comm.comm_state_shardings(exchange, mesh),
        ema={"params": param_shardings} if settings.train.ema_decay else {},
    )
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=abstract_params,
        model_state=abstract_model_state,
        opt_state=abstract_opt_state,
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        comm=jax.eval_shape(lambda: grad_comm.initial_comm_state(exchange, mesh)),
        ema={"params": abstract_params} if settings.train.ema_decay else {},
    )
    abstract_state = jax.tree.map(_placed, shapes, shardings)
    compute_dtypes = (
        _gather_dtypes(abstract_params, param_shardings, policy)
        if follows_policy
        else compute_casts(graphdef, abstract_variables, abstract_model_variables, policy)
    )
    return StateLayout(
        graphdef=graphdef,
        optimizer=optimizer,
        shardings=shardings,
        gradient_shardings=state_param_shardings,
        param_count=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params)),
        trainable_count=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(trained_params)),
        abstract_state=abstract_state,
        create_model=create_model,
        compute_dtypes=compute_dtypes,
        pipeline=pipeline.schedule(settings.mesh, settings.train),
        exchange=exchange,
        trainable=trainable,
        ema_decay=settings.train.ema_decay,
    )


def _optimizer_layout(
    optimizer: optax.GradientTransformation, trained_params, param_shardings, mesh: Mesh
) -> tuple[Any, Any]:
    """(the optimizer state's shapes, its shardings).

    Each moment is laid out as its parameter; anything else (counts, scalars) replicated.
    """
    abstract_opt_state = jax.eval_shape(optimizer.init, trained_params)
    try:
        opt_shardings = optax.tree_map_params(
            # Its init on a placeholder, traced: eager zeros inside the mesh would be placed
            # on its devices, which a compile-only target (plan --target) cannot hold.
            lambda placeholder: jax.eval_shape(lambda: optimizer.init(placeholder)),
            lambda _, param_sharding: param_sharding,
            abstract_opt_state,
            param_shardings,
            transform_non_params=lambda _: sharding.replicated(mesh),
        )
    except (ValueError, TypeError):  # an init that reads the params' tree (Muon's labels)
        opt_shardings = _by_parameter_path(abstract_opt_state, trained_params, param_shardings)
        opt_shardings = jax.tree.map(
            lambda found: found or sharding.replicated(mesh),
            opt_shardings,
            is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding),
        )
    return abstract_opt_state, opt_shardings


def _by_parameter_path(abstract_opt_state, trained_params, param_shardings) -> Any:
    """Each optimizer-state leaf's sharding: its parameter's, found by the end of its path.

    A moment of parameter blocks/q_kernel sits at ...["blocks"]["q_kernel"] of the state,
    with its shape; a leaf that ends no parameter's path (a count) gets None.
    """
    params = {
        tuple(path): (leaf.shape, param_sharding)
        for (path, leaf), param_sharding in zip(
            jax.tree_util.tree_flatten_with_path(trained_params)[0],
            jax.tree.leaves(param_shardings),
            strict=True,
        )
    }

    def one(path, leaf):
        for length in range(len(path), 0, -1):
            found = params.get(tuple(path[-length:]))
            if found is not None and found[0] == leaf.shape:
                return found[1]
        return None

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def _model_state_layout(abstract_model_variables, mesh: Mesh, zero: int) -> tuple[Any, Any]:
    """(the model's non-parameter state as a pure dict of shapes, its shardings)."""
    abstract_model_state = nnx.to_pure_dict(abstract_model_variables)
    shardings = sharding.tree_shardings(
        nnx.to_pure_dict(nnx.get_partition_spec(abstract_model_variables)),
        abstract_model_state,
        mesh,
        sharding.parameter_rules(zero),
    )
    return abstract_model_state, shardings


def _placed(shape: jax.ShapeDtypeStruct, leaf_sharding) -> jax.ShapeDtypeStruct:
    """An abstract array with its sharding."""
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=leaf_sharding)


def trainable_part(tree: dict[str, Any], trainable: frozenset[tuple] | None) -> dict[str, Any]:
    """The part of a params-shaped tree that trains: all of it unless LoRA froze the rest."""
    return tree if trainable is None else lora.split(tree, trainable)[0]


def _frozen_in_compute_dtype(params, trainable: frozenset[tuple] | None, policy: Policy):
    """`params` with every frozen floating leaf in the compute dtype (no LoRA: unchanged).

    A frozen weight needs no fp32 master copy: nothing is ever added to it.
    """
    if trainable is None:
        return params
    trained, frozen = lora.split(params, trainable)

    def narrow(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, policy.compute_dtype, sharding=leaf.sharding)

    return lora.join(trained, jax.tree.map(narrow, frozen))


def _trace_model(create_model: Callable[[], nnx.Module]):
    """(graphdef, abstract params, abstract other variables): the model traced, not built."""
    graphdefs = []

    def split_model():
        graphdef, params, model_state = nnx.split(create_model(), nnx.Param, ...)
        graphdefs.append(graphdef)  # static: the same for the abstract and the real model
        return params, model_state

    # jax.eval_shape rather than nnx.eval_shape: the latter would resolve the logical names
    # against the active mesh, and `layers`, `embed`, ... are not mesh axes.
    abstract_variables, abstract_model_variables = jax.eval_shape(split_model)
    return graphdefs[0], abstract_variables, abstract_model_variables


def _gather_dtypes(abstract_params, param_shardings, policy: Policy):
    """Zoo models: weights cast where stored only when split (FSDP, ZeRO-3) and narrower.

    Each zoo layer casts its weights as it uses them; casting split weights first makes
    the all-gather move the compute dtype instead of fp32 (half the bytes in bf16).
    """
    params_split = not all(leaf.is_fully_replicated for leaf in jax.tree.leaves(param_shardings))
    if not params_split or policy.compute_dtype == policy.param_dtype:
        return None
    return jax.tree.map(
        lambda cast: policy.compute_dtype if cast else None,
        decay_mask(abstract_params),
    )


def compute_casts(graphdef, abstract_variables, abstract_model_variables, policy: Policy):
    """A model of one's own: each weight's compute dtype, or None to keep it as stored.

    Weights (not norms or biases, see optim.decay_mask) take the compute dtype of the
    nearest module above them that `precision.force_policy` set, else the run's policy;
    None for the whole tree when no weight would change dtype.
    """
    model = nnx.merge(graphdef, abstract_variables, abstract_model_variables)
    policy_at = policy_lookup(model, policy)
    abstract_params = nnx.to_pure_dict(abstract_variables)

    def dtype_of(path, value, cast: bool):
        compute = policy_at(tuple(getattr(key, "key", key) for key in path)).compute_dtype
        floating = jnp.issubdtype(value.dtype, jnp.floating)
        return compute if cast and floating and compute != value.dtype else None

    dtypes = jax.tree_util.tree_map_with_path(
        dtype_of, abstract_params, decay_mask(abstract_params)
    )
    return dtypes if any(dtype is not None for dtype in jax.tree.leaves(dtypes)) else None


def init_state(seed: int, layout: StateLayout) -> TrainState:
    """Creates the train state directly in its shardings (jit with out_shardings).

    `seed`: train.seed, the start of the step's random stream (dropout, ...).
    """

    def init() -> TrainState:
        _, variables, model_variables = nnx.split(layout.create_model(), nnx.Param, ...)
        params = jax.tree.map(
            lambda value, shape: value.astype(shape.dtype),
            nnx.to_pure_dict(variables),
            layout.abstract_state.params,
        )
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=nnx.to_pure_dict(model_variables),
            opt_state=layout.optimizer.init(trainable_part(params, layout.trainable)),
            rng=jax.random.PRNGKey(seed),
            comm=grad_comm.initial_comm_state(layout.exchange, layout.shardings.step.mesh),
            ema=ema_start(params) if layout.ema_decay else {},
        )

    return jax.jit(init, out_shardings=layout.shardings)()


def ema_start(params: dict[str, Any]) -> dict[str, Any]:
    """The moving average's start: a copy of the weights.

    A copy: buffers of its own, as the step takes the state donated, every buffer once.
    """
    return {"params": jax.tree.map(jnp.copy, params)}
