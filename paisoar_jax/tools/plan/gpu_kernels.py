"""What the GPU compiler made of a step: its attention and matmul kernels, its async collectives.

Read from the post-optimisation HLO of a step compiled for a GPU (`plan --target`, or on a
GPU), per instruction of the program (a scanned stack of layers counts its body once):

- attention: cuDNN's fused attention is a custom call `__cudnn$fmha...` (forward and
  backward); without one, attention is XLA's own dots and softmax.
- matmuls: each gemm kernel with its backend (triton: a gemm fusion XLA generates; cublas:
  a `__cublas$...` call; cudnn: a cuDNN fusion; cudnn-conv: a cuDNN convolution) and its
  operand element types; an fp32 x fp32 one is named (its JAX op) because a 16-bit policy
  should have none in its layers.
- collectives: each async pair (`-start` ... `-done`) and whether the scheduler put compute
  (a fusion or a custom call) between its start and its done, i.e. whether it overlaps.
"""

from __future__ import annotations

import collections
import re
from typing import Any

from paisoar_jax.tools.plan import hlo

_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_ELEMENT_TYPE = re.compile(r"\b([a-z]\w*)\[")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
COMPUTE = ("fusion", "custom-call")


def operand_names(instruction) -> list[str]:
    """The names of an instruction's operands: those inside its parentheses alone.

    The text after them holds other names (calls=%..., control-predecessors={%...}) that
    are not read: a scalar loop counter's add after a layer's 40 stacked writes was charged
    all of them.
    """
    depth = 0
    for position, character in enumerate(instruction.operands):
        depth += (character == "(") - (character == ")")
        if depth < 0:
            return _OPERAND.findall(instruction.operands[:position])
    return _OPERAND.findall(instruction.operands)


def _element_type(shape: str) -> str:
    found = _ELEMENT_TYPE.search(shape)
    return found.group(1) if found else "?"


def _gemm_backend(instruction) -> str | None:
    """triton, cublas or cudnn for a gemm kernel; None for any other instruction."""
    if instruction.opcode == "custom-call":
        target = _TARGET.search(instruction.line)
        name = target.group(1) if target else ""
        if name.startswith("__cublas"):
            return "cublas"
        if name.startswith("__cudnn$conv"):
            return "cudnn-conv"
        if "ragged_dot" in instruction.line:  # a grouped-matmul kernel (tokamax's Pallas)
            return "grouped"
        return None
    if instruction.opcode == "fusion":
        kind = _KIND.search(instruction.line)
        kind_name = kind.group(1) if kind else ""
        if "gemm" in kind_name:
            return "triton"
        if kind_name.startswith("__cudnn"):
            return "cudnn"
    return None


def _dot_operand_types(instruction, computations, shapes) -> tuple[str, ...]:
    """The element types of a gemm's operands: of the dot inside a fusion, or the call's."""
    called = _CALLS.search(instruction.line)
    if called and called.group(1) in computations:
        body = computations[called.group(1)]
        inner = {item.name: item.shape for item in body}
        for item in body:
            if item.opcode in ("dot", "scaled-dot"):
                names = operand_names(item)[:2]
                return tuple(_element_type(inner.get(name, "")) for name in names)
    names = operand_names(instruction)[:2]
    return tuple(_element_type(shapes.get(name, "")) for name in names)


def kernels(hlo_text: str) -> dict[str, Any]:
    """{"attention", "matmuls", "fp32_matmuls", "collectives"}: see the module docstring."""
    computations, _ = hlo.parse(hlo_text)
    attention = collections.Counter()
    matmuls = collections.Counter()
    fp32_matmuls: list[str] = []
    collectives = []
    for instructions in computations.values():
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        started: dict[str, int] = {}
        for position, instruction in enumerate(instructions):
            target = (
                _TARGET.search(instruction.line) if instruction.opcode == "custom-call" else None
            )
            if target and target.group(1).startswith("__cudnn$fmha"):
                backward = "Backward" in target.group(1)
                attention["cudnn_backward" if backward else "cudnn_forward"] += 1
            backend = _gemm_backend(instruction)
            if backend is not None:
                types = _dot_operand_types(instruction, computations, shapes)
                matmuls[(backend, " x ".join(types))] += 1
                if types and all(element == "f32" for element in types):
                    op_name = _OP_NAME.search(instruction.line)
                    fp32_matmuls.append(op_name.group(1) if op_name else instruction.name)
            if instruction.opcode.endswith("-start") and instruction.opcode != "async-start":
                started[instruction.name] = position
            elif instruction.opcode.endswith("-done") and instruction.opcode != "async-done":
                names = operand_names(instruction)[:1]
                if names and names[0] in started:
                    between = instructions[started[names[0]] + 1 : position]
                    collectives.append(
                        {
                            "kind": instruction.opcode.removesuffix("-done"),
                            "name": names[0],
                            "dtype": _element_type(instruction.shape),
                            "bytes": hlo.shape_bytes(instruction.shape),
                            "overlapped": any(item.opcode in COMPUTE for item in between),
                        }
                    )
    return {
        "attention": "cudnn" if attention else "xla",
        "attention_kernels": dict(attention),
        "matmuls": [
            {"backend": backend, "operands": operands, "count": count}
            for (backend, operands), count in sorted(matmuls.items())
        ],
        "fp32_matmuls": sorted(set(fp32_matmuls)),
        "collectives": collectives,
    }


def summary_lines(found: dict[str, Any]) -> list[str]:
    """The kernels as a few lines for plan's table."""
    kernels_of = found["attention_kernels"]
    lines = [
        "kernels (in the GPU program; a scanned stack counts once)",
        f"  attention        {found['attention']}"
        + (
            f" ({', '.join(f'{k} x{n}' for k, n in sorted(kernels_of.items()))})"
            if kernels_of
            else ""
        ),
    ]
    for row in found["matmuls"]:
        lines.append(f"  gemm {row['backend']:<11} {row['operands']:<16} x{row['count']}")
    overlapped = sum(row["overlapped"] for row in found["collectives"])
    lines.append(
        f"  async collectives {len(found['collectives'])}, {overlapped} with compute between "
        f"start and done"
    )
    for name in found["fp32_matmuls"][:5]:
        lines.append(f"  fp32 gemm: {name}")
    return lines


_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([^}]*)\}")
_DIMS = re.compile(r"\[([^\]]*)\]")


def _dims(shape: str) -> list[int]:
    found = _DIMS.search(shape)
    return [int(d.lstrip("<=")) for d in found.group(1).split(",") if d.strip()] if found else []


def _gemm_flops(instruction, computations, shapes) -> float:
    """2 x output elements x contracted size of a gemm kernel (cuBLAS call or gemm fusion)."""
    if _gemm_backend(instruction) == "grouped":
        return _grouped_flops(instruction, shapes)
    lhs_shape, contracting = "", []
    if instruction.opcode == "custom-call":
        names = operand_names(instruction)
        lhs_shape = shapes.get(names[0], "") if names else ""
        if found := _CONTRACTING.search(instruction.line):
            contracting = [int(d.strip().strip('"')) for d in found.group(1).split(",") if d]
    else:
        called = _CALLS.search(instruction.line)
        body = computations.get(called.group(1), []) if called else []
        inner = {item.name: item.shape for item in body}
        for item in body:
            if item.opcode == "dot" and (found := _DOT_CONTRACTING.search(item.line)):
                lhs_shape = inner.get(operand_names(item)[0], "")
                contracting = [int(d) for d in found.group(1).split(",") if d.strip()]
    lhs = _dims(lhs_shape)
    size = 1
    for dim in contracting:
        size *= lhs[dim] if dim < len(lhs) else 1
    output = 1
    for dim in _dims(instruction.shape):
        output *= dim
    return 2.0 * output * size


def _grouped_flops(instruction, shapes) -> float:
    """2 x rows x in x out of a grouped matmul over all its rows (M x K by G x K x N).

    Its product and its input's gradient are M x N (x M x K first); its weights' gradient
    is G x K x N (each row adds to its group's). Rows past the groups count too: an upper
    bound where a device holds rows of other devices' experts (models/dropless.py).
    """
    names = operand_names(instruction)
    lhs = _dims(shapes.get(names[0], "")) if names else []
    out = _dims(instruction.shape)
    if not lhs or not out:
        return 0.0
    elements = 1
    for dim in out:
        elements *= dim
    if len(out) == 3:  # the weights' gradient: every row once, K x N each
        return 2.0 * elements / out[0] * lhs[0]
    return 2.0 * elements * lhs[-1]


def _touched_bytes(shape_text: str, runs: int) -> float:
    """Bytes of a kernel's operand or result that one run touches.

    Inside a loop over layers, an array stacked over them (leading dimension the loop's
    runs) is read or written one layer's slice at a time (dynamic-slice, in-place
    dynamic-update-slice): 1 / runs of it.
    """
    total = 0.0
    for element_type, dims in hlo.ARRAY_SHAPE.findall(shape_text):
        bits = hlo.ELEMENT_BITS.get(element_type)
        sizes = [int(size.lstrip("<=")) for size in dims.split(",") if size.strip()]
        if bits is None:
            continue
        count = 1
        for size in sizes:
            count *= size
        stacked = runs > 1 and sizes and sizes[0] == runs
        total += count * bits / 8 / (runs if stacked else 1)
    return total


_PARAMETER = re.compile(r"parameter\((\d+)\)")
SLICING = ("dynamic-slice", "slice", "gather")  # read a part of their first operand


def _kernel_bytes(instruction, computations, shapes, runs: int) -> float:
    """Bytes one run of a non-gemm kernel reads and writes.

    Its result and operands whole, but what the fusion's body says is less: an operand the
    body only slices (a layer's row of a stacked buffer, one element of it) is charged the
    slices it reads; one the body updates in place (a dynamic-update-slice at its root) is
    charged nothing and the result the update it writes. Otherwise `_touched_bytes`.
    """
    operands = operand_names(instruction)
    charged: dict[int, float] = {}
    written = None
    called = _CALLS.search(instruction.line) if instruction.opcode == "fusion" else None
    body = computations.get(called.group(1), []) if called else []
    if body:
        inner = {item.name: item for item in body}
        users: dict[str, list[tuple[Any, int]]] = collections.defaultdict(list)
        for item in body:
            for position, used in enumerate(operand_names(item)):
                users[used].append((item, position))
        root = next((item for item in body if item.line.lstrip().startswith("ROOT")), None)
        for item in body:
            index = _PARAMETER.search(item.line) if item.opcode == "parameter" else None
            if index is None:
                continue
            sliced = _sliced_bytes(item.name, users)
            if sliced is not None:
                charged[int(index.group(1))] = sliced
            elif (
                root is not None
                and root.opcode == "dynamic-update-slice"
                and users[item.name] == [(root, 0)]
            ):
                charged[int(index.group(1))] = 0.0  # updated where it lies
                update = operand_names(root)[1]
                written = hlo.shape_bytes(inner[update].shape) if update in inner else None
    total = written if written is not None else _touched_bytes(instruction.shape, runs)
    for index, operand in enumerate(operands):
        if index in charged:
            total += charged[index]
        else:
            total += _touched_bytes(shapes.get(operand, ""), runs)
    return total


def _sliced_bytes(name: str, users) -> float | None:
    """The bytes the slices of value `name` read (None unless slices are all that use it).

    Through bitcasts: a slice of a reshaped view reads as much.
    """
    uses = users.get(name, [])
    if not uses:
        return None
    total = 0.0
    for item, position in uses:
        if item.opcode in SLICING and position == 0:
            total += hlo.shape_bytes(item.shape)
        elif item.opcode == "bitcast" and (inner := _sliced_bytes(item.name, users)) is not None:
            total += inner
        else:
            return None
    return total


def priced_kernels(hlo_text: str) -> list[dict[str, Any]]:
    """Each kernel of the program once, as a dict (see below).

    Its keys: "name", "op", "shape", "computation", "runs", "kind", "amount".

    kind "gemm" (amount: FLOPs of one run), "bytes" (a non-gemm kernel: bytes one run reads
    and writes, `_kernel_bytes`), "convolution" or "attention" (cuDNN's: priced by the
    caller). "op" is the JAX op it computes (its op_name), "shape" its result's. A scanned
    stack's kernels appear once, with their runs per step.
    """
    computations, entry = hlo.parse(hlo_text)
    runs, _ = hlo.runs_per_step(computations, entry)
    # The bodies of fusions and custom calls are inside their kernel, not kernels of their own.
    inside = {
        called
        for instructions in computations.values()
        for item in instructions
        if item.opcode in COMPUTE
        for called in _CALLS.findall(item.line)
    }
    found = []
    for name, instructions in computations.items():
        if name in inside:
            continue
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        for instruction in instructions:
            if instruction.opcode not in COMPUTE or runs[name] == 0:
                continue
            target = _TARGET.search(instruction.line)
            backend = _gemm_backend(instruction)
            if target and target.group(1).startswith("__cudnn$fmha"):
                kind, amount = "attention", 0.0
            elif backend == "cudnn-conv":
                kind, amount = "convolution", 0.0
            elif backend is not None:
                kind, amount = "gemm", _gemm_flops(instruction, computations, shapes)
            else:
                kind = "bytes"
                amount = _kernel_bytes(instruction, computations, shapes, runs[name])
            op_name = _OP_NAME.search(instruction.line)
            found.append(
                {
                    "name": instruction.name,
                    "op": op_name.group(1) if op_name else "",
                    "shape": instruction.shape,
                    "computation": name,
                    "runs": runs[name],
                    "kind": kind,
                    "amount": amount,
                }
            )
    return found


def roofline_seconds(hlo_text: str, peak_flops: float, bandwidth: float) -> dict[str, float]:
    """{"gemm_s", "gemm_flops", "convolutions", "memory_bound_s"}: the kernels on a roofline.

    Gemms by their FLOPs at `peak_flops` (FLOP/s), every other kernel by the bytes it reads
    and writes at `bandwidth` (bytes/s), each x its runs per step. cuDNN attention,
    convolutions (counted, not priced) and collectives are the caller's to add. An estimate
    from the program's shapes: no kernel ran.
    """
    kernels_of = priced_kernels(hlo_text)
    total = lambda kind: sum(k["amount"] * k["runs"] for k in kernels_of if k["kind"] == kind)
    gemm_flops = total("gemm")
    return {
        "gemm_s": gemm_flops / peak_flops,
        "gemm_flops": gemm_flops,
        "convolutions": sum(k["runs"] for k in kernels_of if k["kind"] == "convolution"),
        "memory_bound_s": total("bytes") / bandwidth,
    }
