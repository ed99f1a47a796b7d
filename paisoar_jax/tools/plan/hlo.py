"""Collectives read from a compiled program's HLO text (`compiled.as_text()`).

`collectives(hlo_text)` lists every collective instruction with the bytes it moves per device
each time it runs, the size of its replica group and how many times it runs per step.

What counts, and how:

- Kinds: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute. An async
  pair (`all-gather-start` / `all-gather-done`, ...) counts once, at the `-done`, whose result
  is the collective's output; its replica group is read from the `-start`. A collective
  wrapped by `async-start` (how XLA GPU runs reduce-scatter and all-to-all) is counted inside
  the wrapped computation, once.
- Bytes are the payload the way NCCL (and nccl-tests' "size") counts it: all-reduce its
  buffer, all-gather its output, reduce-scatter its input (output x group size), all-to-all
  its buffer, collective-permute what it sends. A tuple result (XLA's combiner merges many
  collectives into one) counts every element.
- Runs per step: 1 in the entry computation; inside a while loop body, times the loop's trip
  count (the `known_trip_count` XLA writes into the while's backend_config; failing that, the
  one integer constant of the loop condition, which assumes the induction variable counts up
  by 1 from 0, as lax.scan and fori_loop do). Loops nest: a scan over layers inside a
  gradient-accumulation scan multiplies both trip counts. Both branches of a conditional
  count (an upper bound). A loop whose trip count cannot be found counts once and is named
  in `unknown_trip_counts`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of each HLO element type; sub-byte types round up per array below.
ELEMENT_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
ARRAY_SHAPE = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_INTEGER_CONSTANT = re.compile(r"=\s*[su]\d+\[\]\s+constant\((-?\d+)\)")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[^}]*\})")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
# A mesh spelling may name its device order between the mesh and the axes:
# mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\([^)]*\)(?:\([^)]*\))?\)?)?\s*\{([^}]*)\}"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: payload bytes per device per run, group size, runs/step."""

    kind: str  # one of KINDS
    bytes: int  # per device, per run, counted the NCCL way (see the module docstring)
    group_size: int  # devices in each replica group (the n of the ring cost formulas)
    count: int  # runs per step: the product of the trip counts of the enclosing loops
    name: str  # the HLO instruction name
    computation: str  # the HLO computation that holds it
    dtype: str = ""  # the element type it moves (`f32`, `s8`; `mixed` for a mixed tuple)


@dataclasses.dataclass
class Instruction:
    """One HLO instruction of a computation, its text split into its parts."""

    name: str
    shape: str  # the result shape text
    opcode: str
    operands: str  # the text after the opcode's opening parenthesis
    line: str


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape, summed over the arrays of a (nested) tuple."""
    total = 0
    for element_type, dims in ARRAY_SHAPE.findall(shape_text):
        if element_type not in ELEMENT_BITS:
            continue  # token[] and the like carry no data
        sizes = [int(size.lstrip("<=")) for size in dims.split(",") if size.strip()]
        total += math.ceil(math.prod(sizes) * ELEMENT_BITS[element_type] / 8)
    return total


def group_size(line: str, device_count: int) -> int:
    """Devices per replica group of a collective, from any of XLA's three spellings.

    `{{0,1},{2,3}}` lists them; `[2,4]<=[8]` is (groups, size) over an iota; `mesh['a'=4,
    'b'=2] {'b'}` names the mesh axes the group spans (`'a':(2)2` is a size-2 sub-axis),
    with or without a `device_ids=(...)` order between.
    An empty list means every device.
    """
    if match := _MESH_GROUPS.search(line):
        axis_sizes = dict(re.findall(r"'([^']+)'=(\d+)", match.group(1)))
        size = 1
        for axis, sub_axis in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", match.group(2)):
            size *= int(sub_axis) if sub_axis else int(axis_sizes[axis])
        return size
    if match := _IOTA_GROUPS.search(line):
        return int(match.group(2))
    if match := _EXPLICIT_GROUPS.search(line):
        return len([device for device in match.group(1).strip("{}").split(",") if device])
    return device_count


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The instructions of each computation, and the entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and not line.startswith("HloModule"):
            if header := _COMPUTATION.match(line):  # `[ENTRY] %name (params) -> shape {`
                current = header.group(2)
                computations[current] = []
                entry = current if header.group(1) else entry
                continue
        if line.strip() == "}":
            current = None
        elif current is not None and (match := _INSTRUCTION.match(line)):
            name, shape, opcode, operands = match.groups()
            computations[current].append(Instruction(name, shape, opcode, operands, line))
    return computations, entry


def _trip_count(instruction: Instruction, computations: dict[str, list[Instruction]]):
    """A while loop's trip count, or None when neither XLA nor the condition says."""
    if match := _TRIP_COUNT.search(instruction.line):
        return int(match.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", instruction.line)
    constants = {
        int(value)
        for inner in computations.get(condition.group(1) if condition else "", [])
        for value in _INTEGER_CONSTANT.findall(inner.line)
    }
    return constants.pop() if len(constants) == 1 else None


def runs_per_step(computations, entry: str) -> tuple[dict[str, int], list[str]]:
    """How many times each computation runs per call of the entry, and loops with no count."""
    callers: dict[str, list[tuple[str, int]]] = {name: [] for name in computations}
    unknown = []
    for caller, instructions in computations.items():
        for instruction in instructions:
            if instruction.opcode in ("async-done", "async-update"):
                continue  # the async-start already called the wrapped computation
            trips = 1
            if instruction.opcode == "while":
                trips = _trip_count(instruction, computations)
                if trips is None:
                    unknown.append(instruction.name)
                    trips = 1
            called = [name for _, name in _CALLED.findall(instruction.line)]
            for branches in _BRANCHES.findall(instruction.line):
                called += [name.strip().lstrip("%") for name in branches.split(",")]
            for callee in called:
                if callee in callers:
                    callers[callee].append((caller, trips))

    @functools.cache
    def runs(name: str) -> int:
        if name == entry:
            return 1
        return sum(runs(caller) * trips for caller, trips in callers[name])

    return {name: runs(name) for name in computations}, unknown


def analyze(hlo_text: str, device_count: int = 1) -> tuple[list[Collective], list[str]]:
    """The collectives of an HLO module, and the while loops whose trip count is unknown.

    `device_count` is the group size of a collective with an empty replica-group list.
    """
    computations, entry = parse(hlo_text)
    runs, unknown = runs_per_step(computations, entry)
    found = []
    for computation, instructions in computations.items():
        by_name = {instruction.name: instruction for instruction in instructions}
        for instruction in instructions:
            kind = instruction.opcode.removesuffix("-done")
            if kind not in KINDS or instruction.opcode.endswith("-start") or not runs[computation]:
                continue
            attributes = instruction.line
            if instruction.opcode.endswith("-done"):
                start = re.match(r"\s*%?([\w.\-]+)", instruction.operands)
                started = by_name.get(start.group(1)) if start else None
                attributes = started.line if started else attributes
            size = group_size(attributes, device_count)
            payload = shape_bytes(instruction.shape)
            if kind == "reduce-scatter":
                payload *= size  # NCCL counts the input; the result is one device's shard
            types = {kind for kind, _ in ARRAY_SHAPE.findall(instruction.shape)}
            dtype = types.pop() if len(types) == 1 else "mixed"
            found.append(
                Collective(
                    kind, payload, size, runs[computation], instruction.name, computation, dtype
                )
            )
    return found, unknown


def collectives(hlo_text: str, device_count: int = 1) -> list[Collective]:
    """The collectives of an HLO module with bytes, group size and runs per step."""
    return analyze(hlo_text, device_count)[0]


def ring_factor(kind: str, group: int) -> float:
    """Bytes on the busiest link per payload byte, for NCCL's ring algorithms.

    all-reduce 2(n-1)/n (a reduce-scatter then an all-gather); all-gather, reduce-scatter
    and all-to-all (n-1)/n; collective-permute 1 (each device sends its buffer once).
    """
    if group <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (group - 1) / group
    if kind == "collective-permute":
        return 1.0
    return (group - 1) / group


def totals_by_kind(found: list[Collective], gb_per_s: float = 0.0) -> dict[str, dict]:
    """Runs and bytes per step of each kind (every kind, zero when absent).

    With a link bandwidth (GB/s per direction) also the seconds the ring algorithms need:
    bytes x ring_factor / bandwidth, summed over the collectives of the kind.
    """
    totals: dict[str, dict] = {kind: {"count": 0, "bytes": 0} for kind in KINDS}
    for collective in found:
        totals[collective.kind]["count"] += collective.count
        totals[collective.kind]["bytes"] += collective.count * collective.bytes
        if gb_per_s:
            factor = ring_factor(collective.kind, collective.group_size)
            seconds = collective.count * collective.bytes * factor / (gb_per_s * 1e9)
            totals[collective.kind]["seconds"] = totals[collective.kind].get("seconds", 0) + seconds
    return totals
