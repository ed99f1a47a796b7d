"""The device mesh, the logical-axis rules and the shardings they give.

Every parameter carries logical axis names (`embed`, `mlp`, `heads`, `vocab`, ...). One short
table maps them to the mesh axes (data, stage, fsdp, expert, context, tensor); the ZeRO
stage only changes where `embed` goes:

    stage   parameters embed ->   optimizer state embed ->
    0       fsdp                  fsdp                      (replicated over data)
    1, 2    fsdp                  data+fsdp                 (ZeRO-1/2: state and grads split)
    3       data+fsdp             data+fsdp                 (ZeRO-3 / FSDP over all of them)

(with `context` beside fsdp in each: a context split's devices share the weights' shards.)

Heads, MLP hidden and vocab go over `tensor` (Megatron style); conv output channels go
where `embed` goes; a stacked model's `layers` axis goes over `stage` (pipeline.py: each
pipeline stage holds its contiguous group of blocks); a mixture's stacked `experts` go over
`expert` (models/moe.py). The batch is split over (data, fsdp, expert), and each sequence's
tokens over `context` (parallel/context.py; every context device reads the same
rows, which are tiny, and keeps its own slice of their activations). ZeRO-2 is the same
program as ZeRO-1 here: XLA reduce-scatters the gradients straight into the
optimizer-state layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from paisoar_jax.config import MeshConfig
from paisoar_jax.config.mesh import AXES, AXIS_NAMES, DCN_NAMES
from paisoar_jax.errors import UserError

# The axes, in mesh order, and which of them say what: config/mesh.py's table.
MESH_AXES = AXIS_NAMES
# The axes a reader is told of only when they split.
OPTIONAL_AXES = tuple(axis.name for axis in AXES if axis.optional)
# The batch is split over expert too: outside the experts that axis is one more data axis.
BATCH_AXES = tuple(axis.name for axis in AXES if axis.batch)

# Logical activation axes -> mesh axes. Used by `constrain` inside the model so XLA keeps
# the batch split over BATCH_AXES (data, fsdp, expert) instead of inventing a layout from
# the weights.
ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "length": "context",  # context parallelism: each device its slice of every sequence
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    "act_experts": "expert",  # a mixture's token buffers, each expert's on its devices
    "head_dim": None,
}


def parameter_rules(zero: int, optimizer_state: bool = False) -> dict[str, tuple[str, ...]]:
    """Logical parameter axis -> mesh axes, for params or for optimizer state."""
    split_over_data = zero >= 3 or (optimizer_state and zero >= 1)
    # The devices of a context split hold the same rows, different tokens: FSDP splits the
    # weights over them too (gathered per layer), or each would hold the whole model.
    embed = ("data", "fsdp", "context") if split_over_data else ("fsdp", "context")
    return {
        "embed": embed,
        "vocab": ("tensor",),
        "heads": ("tensor",),
        "kv_heads": ("tensor",),  # grouped-query attention: each tensor shard its kv heads
        "mlp": ("tensor",),
        "experts": ("expert",),  # a mixture's stacked experts: expert parallelism
        "router": (),  # the router's scores of the experts: small, whole everywhere
        "latent": (),  # multi-head latent attention's latents (models/latent.py): small
        "mtp": (),  # multi-token prediction's two halves of its projection (models/mtp.py)
        "qkv": (),
        "head_dim": (),
        "length": (),
        "layers": ("stage",),  # pipeline stages: stage s holds its group of stacked blocks
        # Image models: a conv's output channels go where `embed` goes (FSDP splits them),
        # its input channels, BatchNorm's vectors and the classes stay whole.
        "conv_in": (),
        "conv_out": embed,
        "norm": (),
        "classes": (),
    }


def _mesh_sizes(mesh_config: MeshConfig, device_count: int) -> tuple[list[int], list[int]]:
    """Resolves -1 in the ici sizes and checks that ici x dcn covers every device."""
    ici, dcn = mesh_config.ici_sizes(), mesh_config.dcn_sizes()
    if ici.count(-1) > 1:
        fills = ", ".join(f"mesh.{axis.name}" for axis in AXES if axis.fills)
        raise UserError(f"at most one of {fills} may be -1")
    fixed = math.prod(size for size in ici if size != -1) * math.prod(dcn)
    if -1 in ici:
        if device_count % fixed:
            raise UserError(
                f"mesh sizes {mesh_config.describe()} do not divide the {device_count} devices"
            )
        ici[ici.index(-1)] = device_count // fixed
    elif fixed != device_count:
        raise UserError(
            f"mesh {mesh_config.describe()} needs {fixed} devices, but {device_count} are present"
        )
    return ici, dcn


def build_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes MESH_AXES; a hybrid ici x dcn mesh across processes."""
    devices = list(devices if devices is not None else jax.devices())
    ici, dcn = _mesh_sizes(mesh_config, len(devices))
    if math.prod(dcn) > 1 and math.prod(dcn) != jax.process_count():
        raise UserError(
            f"mesh.{' x '.join(DCN_NAMES)} = {math.prod(dcn)} must equal the number of "
            f"processes ({jax.process_count()}): the dcn axes span processes"
        )
    if math.prod(dcn) > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    elif len(devices) == 1:
        device_array = np.array(devices).reshape((1,) * len(MESH_AXES))
    else:
        device_array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    # Auto axes: XLA propagates shardings, and stock flax layers work under FSDP.
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes for a reader: stage, expert and context only when they split."""
    return {
        axis: size for axis, size in mesh.shape.items() if axis not in OPTIONAL_AXES or size > 1
    }


def context_shards() -> int:
    """How many ways the sequences are split in the mesh being traced under (1: whole).

    1 outside a mesh, and while `sequence_whole` holds (decoding runs unsplit).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _LENGTH_AXIS.get() is None:
        return 1
    return mesh.shape.get("context", 1)


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the (data, fsdp, expert) axes."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def check_batch(global_batch: int, grad_accum: int, mesh: Mesh, pipelined: int = 1) -> None:
    """Raises UserError unless every micro-batch splits evenly over the batch axes.

    `pipelined`: the pipeline's micro-batches per pass (pipeline.py), each split too.
    """
    shards = batch_shards(mesh)
    micro_batch = global_batch // grad_accum
    if micro_batch % shards:
        detail = f" (micro-batch {micro_batch} with grad_accum={grad_accum})" * (grad_accum > 1)
        raise UserError(
            f"train.global_batch={global_batch}{detail} is not divisible by the {shards} "
            f"batch shards (mesh {_batch_split(mesh)})"
        )
    if (micro_batch // pipelined) % shards:
        raise UserError(
            f"train.pipeline_microbatches={pipelined} cuts the batch of {micro_batch} per pass "
            f"into micro-batches of {micro_batch // pipelined}, which do not split over the "
            f"{shards} batch shards (mesh {_batch_split(mesh)})"
        )
    _, readers = input_slot(mesh)
    if micro_batch % readers:
        raise UserError(
            f"train.global_batch={global_batch} does not split over the {readers} processes "
            f"that read it"
        )


def _batch_split(mesh: Mesh) -> str:
    """The batch axes as `data x fsdp = 2 x 4` (expert only when it splits)."""
    axes = [axis for axis in BATCH_AXES if axis != "expert" or mesh.shape[axis] > 1]
    return f"{' x '.join(axes)} = {' x '.join(str(mesh.shape[axis]) for axis in axes)}"


def input_slot(mesh: Mesh | None = None) -> tuple[int, int]:
    """(slot, slots): which share of each global batch this process reads, of how many.

    One share per process, except where processes hold the same rows of the batch: the
    pipeline stages of `mesh.dcn_stage` (and the context shards of `mesh.dcn_context`)
    each run every row, so the processes of one batch position read the same examples.

    Args:
        mesh: default, the one set by jax.set_mesh; outside one, this process's index and
            the process count.

    Returns:
        (slot, slots): ready batches hold global_batch / slots rows in each process.

    Example:
        ```python
        import paisoar_jax

        slot, slots = paisoar_jax.input_slot()  # (0, 1) in one process
        rows = 64 // slots  # this process's rows of each ready global batch of 64
        ```

    """
    mesh = jax.sharding.get_mesh() if mesh is None else mesh
    if mesh.empty or mesh.shape.get("stage", 1) == mesh.shape.get("context", 1) == 1:
        return jax.process_index(), jax.process_count()
    rows = batch_sharding(mesh).devices_indices_map((batch_shards(mesh),))
    held: dict[int, set[int]] = {}
    for device, index in rows.items():
        held.setdefault(device.process_index, set()).add(index[0].start or 0)
    shares = sorted({tuple(sorted(starts)) for starts in held.values()})
    return shares.index(tuple(sorted(held[jax.process_index()]))), len(shares)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch: leading dimension over (data, fsdp, expert), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a value every device holds whole (step counters, scalars)."""
    return NamedSharding(mesh, PartitionSpec())


def logical_to_sharding(
    logical_spec: PartitionSpec,
    shape: Sequence[int],
    mesh: Mesh,
    rules: dict[str, tuple[str, ...]],
    name: str,
) -> NamedSharding:
    """Maps one parameter's logical axis names to a NamedSharding, checking divisibility."""
    mesh_spec = []
    for dim, (logical, size) in enumerate(zip(tuple(logical_spec), shape, strict=False)):
        if logical is None:
            mesh_spec.append(None)
            continue
        if logical not in rules:
            raise ValueError(f"parameter {name}: logical axis {logical!r} has no sharding rule")
        axes = tuple(axis for axis in rules[logical] if mesh.shape[axis] > 1)
        ways = math.prod(mesh.shape[axis] for axis in axes)
        if size % ways:
            split = " x ".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
            raise UserError(
                f"parameter {name}: dimension {dim} ({logical}, size {size}) is not divisible "
                f"by mesh {split}"
            )
        mesh_spec.append(axes or None)
    return NamedSharding(mesh, PartitionSpec(*mesh_spec))


def tree_shardings(logical_specs, abstract_values, mesh: Mesh, rules) -> object:
    """Shardings for a tree of parameters from their logical specs (same tree structure)."""

    def one(path, spec, value):
        name = ".".join(str(getattr(key, "key", key)) for key in path)
        return logical_to_sharding(spec, value.shape, mesh, rules, name)

    return jax.tree_util.tree_map_with_path(
        one, logical_specs, abstract_values, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


# The mesh axes of the activations' `batch` axis: all of BATCH_AXES, except while an
# enclosing vmap over batch shards (the pipeline's, grad_comm's) has taken some of them.
_BATCH_AXES_LEFT: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "paisoar_jax_batch_axes_left", default=BATCH_AXES
)


# The mesh axis of the activations' `length` axis: context, or None while decoding (one new
# token at a time does not split).
_LENGTH_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "paisoar_jax_length_axis", default="context"
)


@contextlib.contextmanager
def sequence_whole() -> Iterator[None]:
    """While tracing code whose sequences stay whole on every device (cached decoding)."""
    token = _LENGTH_AXIS.set(None)
    try:
        yield
    finally:
        _LENGTH_AXIS.reset(token)


@contextlib.contextmanager
def batch_vmapped(rest: tuple[str, ...] = ()) -> Iterator[None]:
    """While tracing a function vmapped over the batch shards: `batch` maps to `rest`.

    `rest`: the batch axes the vmap leaves (grad_comm's vmap over data leaves fsdp); none
    by default (the pipeline's vmap takes them all: the activations are one shard's rows).
    """
    token = _BATCH_AXES_LEFT.set(rest or None)
    try:
        yield
    finally:
        _BATCH_AXES_LEFT.reset(token)


def in_batch_vmap() -> bool:
    """Whether the code being traced runs inside a vmap over batch shards (batch_vmapped)."""
    return _BATCH_AXES_LEFT.get() != BATCH_AXES


def activation_axes(logical: str) -> tuple[str, ...] | None:
    """The mesh axes an activation's logical axis goes over here (None: whole).

    What `constrain` pins: the batch axes a batch vmap left, the length's while decoding.
    """
    left = _BATCH_AXES_LEFT.get()
    # A mixture's buffers split the batch over the batch axes but expert (models/moe.py).
    within = tuple(axis for axis in left or () if axis != "expert") or None
    rules = {**ACTIVATION_RULES, "batch": left, "batch_within_expert": within}
    rules["length"] = _LENGTH_AXIS.get()
    # Inside batch_vmapped the vmapped batch axes are taken: no rule may name them (so a
    # pipeline's cells hold their experts whole).
    return _free(rules[logical], set(BATCH_AXES) - set(left or ()))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical axis names; a no-op outside a mesh context.

    A None axis stays unsharded.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return x
    spec = PartitionSpec(*(activation_axes(axis) if axis else None for axis in logical_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def _free(entry: str | tuple[str, ...] | None, taken: set[str]) -> tuple[str, ...] | None:
    """A rule's mesh axes without those `taken` by a batch vmap (None when none are left)."""
    axes = (entry,) if isinstance(entry, str) else entry or ()
    return tuple(axis for axis in axes if axis not in taken) or None
