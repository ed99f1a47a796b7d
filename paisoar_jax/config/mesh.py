"""The device mesh's axes, declared once, and the `mesh` section that sizes them.

`AXES` is the table: each axis's name, what it splits, whether the batch's rows are split
over it, whether it may be -1 (take the devices the others leave), whether a reader is told
of it only when it splits, and whether it has a `dcn_` twin that spans hosts. The mesh
(parallel/sharding.py), the section's checks and every message that lists axes read it, so
a new axis is one row here and one field of `MeshConfig` (tests/config/test_config.py holds the
two together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from paisoar_jax.errors import UserError


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh (a row of `AXES`)."""

    name: str
    splits: str  # what the devices along it hold different parts of
    batch: bool  # the batch's rows are split over it
    fills: bool  # may be -1: the devices the other axes leave
    optional: bool  # named to a reader only when it splits (size > 1)
    dcn: bool  # has a `dcn_<name>` twin: the same split across hosts or slices


# fmt: off
AXES: tuple[MeshAxis, ...] = (
    #        name       splits                        batch  fills  optional dcn
    MeshAxis("data",    "the batch's rows",           True,  True,  False,   True),
    MeshAxis("stage",   "the layer stack (pipeline)", False, False, True,    True),
    MeshAxis("fsdp",    "the rows and the weights",   True,  True,  False,   True),
    # Outside the experts' layers the expert axis is one more data axis.
    MeshAxis("expert",  "a mixture's experts",        True,  False, True,    True),
    MeshAxis("context", "each sequence's tokens",     False, False, True,    True),
    MeshAxis("tensor",  "heads and MLP units",        False, True,  False,   False),
)
# fmt: on
AXIS_NAMES = tuple(axis.name for axis in AXES)
DCN_NAMES = tuple(f"dcn_{axis.name}" for axis in AXES if axis.dcn)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh with axes (data, stage, fsdp, expert, context, tensor); -1 fills the rest."""

    data: int = -1  # pure data parallelism within a host (ici)
    stage: int = 1  # pipeline stages: the layer stack split into this many groups
    fsdp: int = 1  # params sharded over this axis, gathered per layer (FSDP)
    tensor: int = 1  # Megatron tensor parallelism: heads and MLP hidden split
    # Expert parallelism: a mixture's experts split over this axis, the batch too (tokens
    # reach their experts' devices and come back by all-to-all; models/moe.py)
    expert: int = 1
    dcn_expert: int = 1  # expert parallelism across hosts/slices (dcn)
    # Context parallelism: every sequence's tokens split over this axis (long windows; the
    # attention across the split: model.context_attention, parallel/context.py)
    context: int = 1
    dcn_context: int = 1  # context parallelism across hosts/slices (dcn)
    dcn_data: int = 1  # data parallelism across hosts/slices (dcn)
    dcn_stage: int = 1  # pipeline stages across hosts/slices (dcn)
    dcn_fsdp: int = 1  # FSDP across hosts/slices (dcn)
    zero: int = 0  # 0 replicate over data; 1 (=2) shard optimizer state; 3 params too
    # The gradients' dtype on the wire across the data axes (grad_comm.py): fp32 (XLA's own
    # all-reduce), bf16 or int8 (blockwise scaled), summed in fp32 on arrival either way.
    grad_comm: Literal["fp32", "bf16", "int8"] = "fp32"
    grad_comm_block: int = 256  # int8: values per scale (a power of two)
    # Keep each device's rounding residual in the train state and add it to the next step's
    # gradient before it is compressed (a gradient-sized fp32 buffer per device).
    grad_comm_error_feedback: bool = False
    # all: compress over every data shard; dcn: only between hosts (mesh.dcn_data), the
    # exchange inside a host stays fp32
    grad_comm_scope: Literal["all", "dcn"] = "all"
    # GPU: XLA combines collectives of a kind up to this many MiB (its combine thresholds,
    # PAISoar's gradient buckets; gpu_flags.py); 0 keeps XLA's own 30 MiB
    bucket_mb: int = 128

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"mesh.zero must be 0, 1, 2 or 3, got {self.zero}")
        block = self.grad_comm_block
        if block < 1 or block & (block - 1):
            raise UserError(f"mesh.grad_comm_block must be a power of two, got {block}")
        if self.grad_comm == "fp32":
            for key, unset in (("grad_comm_error_feedback", False), ("grad_comm_scope", "all")):
                if getattr(self, key) != unset:
                    raise UserError(f"mesh.{key} is for a compressed exchange: set mesh.grad_comm")
        if self.bucket_mb < 0:
            raise UserError(f"mesh.bucket_mb must be >= 0 (0: XLA's own), got {self.bucket_mb}")
        for axis in AXES:
            size = getattr(self, axis.name)
            if axis.fills and (size == 0 or size < -1):
                raise UserError(f"mesh.{axis.name} must be a positive size or -1, got {size}")
            if not axis.fills and size < 1:
                raise UserError(f"mesh.{axis.name} must be a positive size, got {size}")
        for key in DCN_NAMES:
            if getattr(self, key) < 1:
                raise UserError(
                    f"mesh.{key} must be a positive size, got {getattr(self, key)}: the dcn "
                    "axes span processes, so their sizes are explicit"
                )

    def ici_sizes(self) -> list[int]:
        """Each axis's size within a host, in `AXES` order (-1 where one fills the rest)."""
        return [getattr(self, axis.name) for axis in AXES]

    def dcn_sizes(self) -> list[int]:
        """Each axis's size across hosts, in `AXES` order (1 for an axis without a twin)."""
        return [getattr(self, f"dcn_{axis.name}") if axis.dcn else 1 for axis in AXES]

    def shape(self) -> dict[str, int] | None:
        """Axis -> its size over all hosts (ici x dcn), as the mesh has it; None with a -1."""
        ici, dcn = self.ici_sizes(), self.dcn_sizes()
        if -1 in ici:
            return None  # the rest of the devices: how many, only the run knows
        return {
            axis.name: inside * across for axis, inside, across in zip(AXES, ici, dcn, strict=True)
        }

    def hosts(self) -> int:
        """The processes the dcn axes span: the product of their sizes."""
        return math.prod(self.dcn_sizes())

    @property
    def experts(self) -> int:
        """Expert-parallel shards over all hosts: expert x dcn_expert."""
        return self.expert * self.dcn_expert

    @property
    def contexts(self) -> int:
        """Context-parallel shards of each sequence over all hosts: context x dcn_context."""
        return self.context * self.dcn_context

    @property
    def stages(self) -> int:
        """Pipeline stages over all hosts: stage x dcn_stage."""
        return self.stage * self.dcn_stage

    def describe_stages(self) -> str:
        """The stage settings as a user typed them: `mesh.stage=4` or with dcn_stage."""
        if self.dcn_stage == 1:
            return f"mesh.stage={self.stage}"
        return f"mesh.stage={self.stage} x mesh.dcn_stage={self.dcn_stage}"

    def describe(self) -> str:
        """The sizes as `data=2,fsdp=2,tensor=2` (optional axes and dcn twins only when set)."""
        parts = [
            f"{axis.name}={getattr(self, axis.name)}"
            for axis in AXES
            if not axis.optional or getattr(self, axis.name) != 1
        ]
        parts += [f"{key}={getattr(self, key)}" for key in DCN_NAMES if getattr(self, key) != 1]
        return ",".join(parts)
