"""Compressed gradient exchange: bf16 or int8 on the wire, summed in fp32 on arrival.

With `mesh.grad_comm=fp32` (the default) XLA reduces the gradients over the data axis
itself, an fp32 all-reduce (or reduce-scatter under ZeRO). On a slow link between hosts
that exchange is the step; `bf16` halves its bytes and `int8` (a float32 scale per block
of `mesh.grad_comm_block` values) about quarters them. Casting before XLA's all-reduce
would also sum in the low precision; here the sum is fp32:

1. Each data shard computes its own gradient (step.py vmaps the loss over the data
   shards), so the train step holds it as a [P, ...] array split over `data`. The step's
   gradient and loss are then the means over the shards, which equal the whole batch's
   when every row weighs the same (a loss that weighs rows unequally, by a mask, gets the
   mean of the shards' means). A model whose forward pass updates state (BatchNorm) is
   refused: each shard would update it on its own.
2. Inside one `jax.shard_map` each device lays its gradients out as rows, row p for data
   shard p, every leaf in one buffer (so one collective per step, not one per parameter):
   a leaf the optimizer state splits over data (ZeRO >= 1) is cut along that dimension,
   any other leaf is flattened and cut evenly.
3. The rows are compressed and sent with one all-to-all; each device decompresses what it
   receives and sums it in fp32: a reduce-scatter with fp32 accumulation. A ZeRO >= 1 leaf
   is now in the optimizer's layout; the others are compressed again and all-gathered.

bf16 travels as its 16 bits in uint16 (XLA CPU would widen a bf16 collective to f32);
int8 values and their scales travel in one int8 buffer. A non-finite gradient makes its
block's scale non-finite, so an fp16 overflow still reaches the loss scaler, which sees the
fp32 sum and skips the step for every device at once.

`mesh.grad_comm_scope=dcn` compresses only between hosts: the rows are first
reduce-scattered in fp32 inside each host (mesh.data devices), the compressed all-to-all
and all-gather then run between the hosts (mesh.dcn_data) and the in-host all-gather is
fp32 again. The data axis of a hybrid mesh is host-major (device h x I + i is device i of
host h), which the replica groups below rely on.

Error feedback (`mesh.grad_comm_error_feedback=true`) keeps what rounding took off each
device's rows, and off the piece it all-gathers, in `TrainState.comm["residual"]`, and adds
it back before the next step is compressed. It is stored unscaled (fp16 loss scaling
changes the scale between steps), checkpointed with the state, and kept as it was on a
step the loss scaler skips.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paisoar_jax import output
from paisoar_jax.config import MeshConfig
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How one gradient leaf enters the buffer: its local shape and its rows."""

    local_shape: tuple[int, ...]  # one device's block of one shard's gradient
    scatter_dim: int | None  # split along this dimension (ZeRO >= 1), else flattened
    width: int  # values per row
    in_spec: PartitionSpec  # the [P, ...] per-shard gradient
    out_spec: PartitionSpec  # the reduced gradient


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The compressed exchange of one run: its settings and the buffer's layout."""

    dtype: str  # "bf16" or "int8"
    block: int  # int8: values per scale
    error_feedback: bool
    shards: int  # P: data shards (mesh data x dcn_data)
    hosts: int  # H: groups the compressed exchange runs between (P when scope is all)
    leaves: tuple[_Leaf, ...]

    @property
    def scattered(self) -> int:
        """Values per row of the leaves cut along a dimension, padded to a block."""
        widths = (leaf.width for leaf in self.leaves if leaf.scatter_dim is not None)
        return _round_up(sum(widths), self.block)

    @property
    def gathered(self) -> int:
        """Values per row of the flattened leaves, padded to a block."""
        widths = (leaf.width for leaf in self.leaves if leaf.scatter_dim is None)
        return _round_up(sum(widths), self.block)

    @property
    def in_host(self) -> int:
        """Devices per host group that exchange in fp32 first (1: none)."""
        return self.shards // self.hosts

    @property
    def row(self) -> int:
        """Values of one row of the buffer."""
        return self.scattered + self.gathered

    @property
    def residual_width(self) -> int:
        """Values of one device's error-feedback residual: its rows and its gathered piece."""
        return self.hosts * self.row + self.gathered


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(axes_per_dim) -> PartitionSpec:
    return PartitionSpec(*(axes or None for axes in axes_per_dim))


def _leaf(shape, param_sharding, gradient_sharding, mesh: Mesh, shards: int) -> _Leaf:
    """A leaf's place in the buffer, from its param and gradient (ZeRO) shardings."""

    def per_dim(named):
        spec = tuple(named.spec) + (None,) * (len(shape) - len(named.spec))
        return [_axes(entry) for entry in spec]

    base = [tuple(axis for axis in axes if axis != DATA_AXIS) for axes in per_dim(param_sharding)]
    local_shape = tuple(NamedSharding(mesh, _spec(base)).shard_shape(tuple(shape)))
    split = [d for d, axes in enumerate(per_dim(gradient_sharding)) if DATA_AXIS in axes]
    scatter_dim = split[0] if split else None
    out = list(base)
    if scatter_dim is not None:
        out[scatter_dim] = (*base[scatter_dim], DATA_AXIS)
        width = math.prod(local_shape) // shards
    else:
        width = -(-math.prod(local_shape) // shards)
    in_spec = PartitionSpec(DATA_AXIS, *_spec(base))
    return _Leaf(local_shape, scatter_dim, width, in_spec, _spec(out))


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def plan(settings: MeshConfig, mesh: Mesh, abstract_params, param_shardings, gradient_shardings):
    """The run's Exchange, or None for XLA's fp32 exchange (a warning where it is moot).

    `settings`: the mesh section (mesh.grad_comm, its scope and dcn_data).
    """
    if settings.grad_comm == "fp32":
        return None
    shards = mesh.shape[DATA_AXIS]
    hosts = settings.dcn_data if settings.grad_comm_scope == "dcn" else shards
    if shards == 1 or hosts == 1:
        where = "data shard" if shards == 1 else "host (mesh.dcn_data=1)"
        output.warning(
            f"mesh.grad_comm={settings.grad_comm} has nothing to compress: the mesh has one "
            f"{where}; gradients are exchanged in fp32"
        )
        return None
    if hosts < shards:
        _check_host_major(mesh, hosts)
    leaves = tuple(
        _leaf(value.shape, param, gradient, mesh, shards)
        for value, param, gradient in zip(
            jax.tree.leaves(abstract_params),
            jax.tree.leaves(param_shardings),
            jax.tree.leaves(gradient_shardings),
            strict=True,
        )
    )
    return Exchange(
        dtype=settings.grad_comm,
        block=settings.grad_comm_block if settings.grad_comm == "int8" else 1,
        error_feedback=settings.grad_comm_error_feedback,
        shards=shards,
        hosts=hosts,
        leaves=leaves,
    )


def _check_host_major(mesh: Mesh, hosts: int) -> None:
    """Scope dcn's in-host groups (`_groups`) must be the devices of one process each."""
    data = mesh.axis_names.index(DATA_AXIS)
    processes = np.vectorize(lambda device: device.process_index)(mesh.devices)
    per_position = np.moveaxis(processes, data, 0).reshape(mesh.shape[DATA_AXIS], -1)
    for group in np.split(per_position, hosts):
        if len(set(group.reshape(-1).tolist())) != len(set(group[0].tolist())):
            raise UserError(
                "mesh.grad_comm_scope=dcn needs each host's devices together on the data "
                "axis, and this mesh interleaves them: use mesh.grad_comm_scope=all"
            )


def residual_sharding(mesh: Mesh) -> NamedSharding:
    """The residual's layout: one row per device, [devices, residual_width]."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def initial_comm_state(exchange: Exchange | None, mesh: Mesh) -> dict:
    """TrainState.comm at step 0: the zero residual with error feedback, else empty."""
    if exchange is None or not exchange.error_feedback:
        return {}
    return {"residual": jnp.zeros((mesh.size, exchange.residual_width), jnp.float32)}


def comm_state_shardings(exchange: Exchange | None, mesh: Mesh) -> dict:
    """The shardings of `initial_comm_state`."""
    if exchange is None or not exchange.error_feedback:
        return {}
    return {"residual": residual_sharding(mesh)}


def _encode(rows: jax.Array, exchange: Exchange) -> jax.Array:
    """fp32 [R, K] -> what goes on the wire: uint16 bf16 bits, or int8 values and scales."""
    if exchange.dtype == "bf16":
        return jax.lax.bitcast_convert_type(rows.astype(jnp.bfloat16), jnp.uint16)
    count, width = rows.shape
    blocks = rows.reshape(count, width // exchange.block, exchange.block)
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127.0
    # A zero block divides by 1; a non-finite one keeps its inf/nan scale, so the decoded
    # block is non-finite too and the loss scaler sees the overflow.
    divisor = jnp.where(scale == 0, 1.0, scale)
    values = jnp.clip(jnp.round(blocks / divisor), -127, 127).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.int8)  # [R, K / block, 4]
    return jnp.concatenate([values.reshape(count, width), scale_bytes.reshape(count, -1)], axis=1)


def _decode(wire: jax.Array, exchange: Exchange, width: int) -> jax.Array:
    """The inverse of `_encode`, in fp32: [R, K]."""
    if exchange.dtype == "bf16":  # bf16 is the high half of an fp32: shift it back there
        high = jnp.left_shift(wire.astype(jnp.uint32), jnp.uint32(16))
        return jax.lax.bitcast_convert_type(high, jnp.float32)
    count = wire.shape[0]
    values = wire[:, :width].reshape(count, width // exchange.block, exchange.block)
    scale_bytes = wire[:, width:].reshape(count, width // exchange.block, 4)
    scale = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
    return (values.astype(jnp.float32) * scale[..., None]).reshape(count, width)


def _compress(rows, residual, scale, exchange: Exchange):
    """(wire, new residual): rows plus the carried residual, compressed; what rounding took."""
    if residual is not None:
        rows = rows + residual * scale
    wire = _encode(rows, exchange)
    if residual is None:
        return wire, None
    return wire, (rows - _decode(wire, exchange, rows.shape[1])) / scale


def _groups(exchange: Exchange):
    """(in-host groups, between-host groups) of data-axis indices; None: the whole axis."""
    if exchange.in_host == 1:
        return None, None
    per_host = exchange.in_host
    in_host = [[h * per_host + i for i in range(per_host)] for h in range(exchange.hosts)]
    between = [[h * per_host + i for h in range(exchange.hosts)] for i in range(per_host)]
    return in_host, between


def _rows(gradient: jax.Array, leaf: _Leaf, shards: int) -> jax.Array:
    """One device's block of a shard's gradient as [P, width] rows, row p for shard p."""
    if leaf.scatter_dim is not None:
        return jnp.moveaxis(gradient, leaf.scatter_dim, 0).reshape(shards, leaf.width)
    flat = gradient.reshape(-1)
    return jnp.pad(flat, (0, shards * leaf.width - flat.size)).reshape(shards, leaf.width)


def _from_scattered(piece: jax.Array, leaf: _Leaf, shards: int) -> jax.Array:
    """The device's reduced piece of a leaf cut along a dimension, in the leaf's layout."""
    moved = list(leaf.local_shape)
    moved.insert(0, moved.pop(leaf.scatter_dim))
    moved[0] //= shards
    return jnp.moveaxis(piece.reshape(moved), 0, leaf.scatter_dim)


def _from_gathered(rows: jax.Array, leaf: _Leaf) -> jax.Array:
    """A flattened leaf's reduced [P, width] rows back in its local shape."""
    return rows.reshape(-1)[: math.prod(leaf.local_shape)].reshape(leaf.local_shape)


def _pad_columns(rows: jax.Array, width: int) -> jax.Array:
    return jnp.pad(rows, ((0, 0), (0, width - rows.shape[1])))


def _split_indices(exchange: Exchange) -> tuple[list[int], list[int]]:
    """(leaves cut along a dimension, flattened leaves): their order in the buffer."""
    scattered = [i for i, leaf in enumerate(exchange.leaves) if leaf.scatter_dim is not None]
    flattened = [i for i, leaf in enumerate(exchange.leaves) if leaf.scatter_dim is None]
    return scattered, flattened


def _buffer(exchange: Exchange, gradients) -> jax.Array:
    """[P, K] fp32: the cut leaves' rows, then the flattened ones', each part padded."""
    shards = exchange.shards

    def section(indices, width):
        parts = [
            _rows(gradients[i][0].astype(jnp.float32), exchange.leaves[i], shards) for i in indices
        ]
        joined = jnp.concatenate(parts, axis=1) if parts else jnp.zeros((shards, 0), jnp.float32)
        return _pad_columns(joined, width)

    scattered, flattened = _split_indices(exchange)
    return jnp.concatenate(
        [section(scattered, exchange.scattered), section(flattened, exchange.gathered)], axis=1
    )


def _as_wire(values: jax.Array, exchange: Exchange) -> jax.Array:
    """fp32 [R, S] as the wire dtype's words, bit for bit (they ride with the gradients)."""
    wire_type = jnp.uint16 if exchange.dtype == "bf16" else jnp.int8
    words = jax.lax.bitcast_convert_type(values, wire_type)  # [R, S, 4 / word bytes]
    return words.reshape(values.shape[0], -1)


def _from_wire(words: jax.Array, count: int) -> jax.Array:
    """The inverse of `_as_wire`: [R, S] fp32."""
    return jax.lax.bitcast_convert_type(words.reshape(words.shape[0], count, -1), jnp.float32)


def _sum_rows(rows: jax.Array) -> jax.Array:
    """rows[0] + rows[1] + ...: in that order on every device, as one fused loop.

    XLA CPU's reduce over the leading axis ran ten times slower than these adds.
    """
    return functools.reduce(jnp.add, [rows[i] for i in range(rows.shape[0])])


def _reduce_scatter(buffer, stats, worker, scale, exchange: Exchange):
    """(the device's piece of the fp32 mean [K], the stats' sum [S], new worker residual).

    Row p of the buffer goes to data shard p. The stats (each shard's loss and metrics)
    ride along in fp32 bits, so their sum needs no collective of its own: one that no data
    depends on could run before the exchange on some devices and after it on others, and
    XLA CPU, whose collectives each block a thread of one pool until every device joins,
    can then deadlock.
    """
    in_host, between = _groups(exchange)
    if in_host is not None:  # scope dcn: first an fp32 reduce-scatter inside each host
        rows = jnp.concatenate(
            [buffer, jnp.broadcast_to(stats, (buffer.shape[0], stats.shape[1]))], 1
        )
        per_host = rows.reshape(exchange.hosts, exchange.in_host, rows.shape[1])
        rows = jax.lax.psum_scatter(
            per_host.swapaxes(0, 1),
            DATA_AXIS,
            scatter_dimension=0,
            axis_index_groups=in_host,
            tiled=True,
        ).reshape(exchange.hosts, rows.shape[1])
        buffer, stats = rows[:, : exchange.row], rows[:1, exchange.row :]  # the host's sums
    wire, worker = _compress(buffer, worker, scale, exchange)
    riding = _as_wire(stats, exchange)
    riding = jnp.broadcast_to(riding, (exchange.hosts, riding.shape[1]))
    wire = jnp.concatenate([wire, riding], axis=1)
    received = jax.lax.all_to_all(wire, DATA_AXIS, 0, 0, axis_index_groups=between, tiled=True)
    payload, riding = received[:, : -riding.shape[1]], received[:, -riding.shape[1] :]
    summed = _sum_rows(_decode(payload, exchange, exchange.row))  # the fp32 sum
    stats_sum = _sum_rows(_from_wire(riding, stats.shape[1]))
    return summed / exchange.shards, stats_sum, worker


def _all_gather(mine, server, scale, exchange: Exchange):
    """(every device's piece [P, G], new server residual), compressed between the hosts."""
    in_host, between = _groups(exchange)
    wire, server = _compress(mine[None], server, scale, exchange)
    gathered = jax.lax.all_gather(wire, DATA_AXIS, axis_index_groups=between, tiled=True)
    rows = _decode(gathered, exchange, exchange.gathered)  # [H, G]
    if in_host is not None:  # back inside each host, in fp32
        rows = jax.lax.all_gather(rows, DATA_AXIS, axis_index_groups=in_host, tiled=False)
        rows = rows.swapaxes(0, 1).reshape(exchange.shards, exchange.gathered)
    return rows, server


def _local_exchange(exchange: Exchange, scale, residual, stats, *gradients):
    """One device's side of the exchange (inside shard_map): gradients [1, ...] each.

    Returns (mean gradients, new residual [1, residual_width or 0], mean stats [S]).
    """
    hosts, leaves = exchange.hosts, exchange.leaves
    worker = server = None
    if exchange.error_feedback:  # [1, residual_width]: the worker's rows, then its piece's
        worker = residual[0, : hosts * exchange.row].reshape(hosts, exchange.row)
        server = residual[0, hosts * exchange.row :][None, : exchange.gathered]
    piece, stats_sum, worker = _reduce_scatter(
        _buffer(exchange, gradients), stats, worker, scale, exchange
    )
    scattered, flattened = _split_indices(exchange)
    reduced = {}
    offset = 0
    for i in scattered:
        width = leaves[i].width
        reduced[i] = _from_scattered(piece[offset : offset + width], leaves[i], exchange.shards)
        offset += width
    if flattened:
        rows, server = _all_gather(piece[exchange.scattered :], server, scale, exchange)
        offset = 0
        for i in flattened:
            width = leaves[i].width
            reduced[i] = _from_gathered(rows[:, offset : offset + width], leaves[i])
            offset += width
    means = [reduced[i].astype(gradients[i].dtype) for i in range(len(leaves))]
    if not exchange.error_feedback:
        return means, residual, stats_sum / exchange.shards
    kept = [worker.reshape(-1)] + ([server.reshape(-1)] if flattened else [])
    kept = jnp.concatenate(kept)
    kept = jnp.pad(kept, (0, exchange.residual_width - kept.size))[None]
    return means, kept, stats_sum / exchange.shards


def exchange_gradients(
    shard_gradients, shard_stats, comm_state: dict, scale, exchange: Exchange, mesh: Mesh
):
    """(mean gradient, mean stats, new comm state) from per-shard values split over data.

    `shard_gradients`: a tree of [P, ...] arrays; `shard_stats`: [P, S] fp32, each shard's
    loss and metrics, averaged exactly (in fp32) along the way. The mean gradient is fp32,
    in each leaf's gradient layout (split over data where ZeRO splits the optimizer state);
    `scale` is the loss scale the gradients carry (1 without fp16).
    """
    leaves, treedef = jax.tree.flatten(shard_gradients)
    residual = comm_state.get("residual")
    if residual is None:  # no error feedback: an empty row per device
        residual = jnp.zeros((mesh.size, 0), jnp.float32)
    rows = residual_sharding(mesh).spec
    in_specs = (
        PartitionSpec(),
        rows,
        PartitionSpec(DATA_AXIS),
        *(leaf.in_spec for leaf in exchange.leaves),
    )
    out_specs = ([leaf.out_spec for leaf in exchange.leaves], rows, PartitionSpec())
    gradients, residual, stats = jax.shard_map(
        functools.partial(_local_exchange, exchange),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )(jnp.asarray(scale, jnp.float32), residual, shard_stats.astype(jnp.float32), *leaves)
    state = {"residual": residual} if exchange.error_feedback else {}
    return treedef.unflatten(gradients), stats, state


def check_model_state(exchange: Exchange | None, abstract_model_state) -> None:
    """Refuses a model whose forward pass updates state: each data shard would on its own."""
    if exchange is not None and jax.tree.leaves(abstract_model_state):
        raise UserError(
            f"mesh.grad_comm={exchange.dtype} runs each data shard's forward pass on its own, "
            "and this model keeps state its forward pass updates (BatchNorm statistics): use "
            "mesh.grad_comm=fp32"
        )


def shard_batch(batch, shards: int):
    """[B, ...] -> [P, B / P, ...]: data shard p's rows (the contiguous block it holds)."""

    def split(array):
        per_shard = array.reshape(shards, array.shape[0] // shards, *array.shape[1:])
        return jax.lax.with_sharding_constraint(
            per_shard, PartitionSpec(DATA_AXIS, sharding.BATCH_AXES[1:])
        )

    return jax.tree.map(split, batch)
