"""A Hugging Face directory's tensors as an import reads them: one at a time, as float32.

`SafetensorsReader` finds each tensor in model.safetensors or the shards of an index, reads
it memory-mapped when asked for (bf16 and fp16 widened), and checks shapes from the files'
headers without reading. A tensor stored in MXFP4 (GPT-OSS's published experts) is found by
its own name and decoded as it is read: OCP's microscaling format, each block of 32 values
along a row sharing one scale, a power of two stored as a biased exponent byte (e8m0:
2^(byte - 127)), each value a 4-bit float (e2m1: one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}),
two to a byte, the even-indexed one in the low nibble. The checkpoint keeps a tensor W as
W_blocks (..., rows, blocks, 16 bytes) and W_scales (..., rows, blocks), its rows the out
features; decoded, they are transposed to the (in, out) layout of the bf16 checkpoints.
Exact: every decoded value is a float32 (and a bf16). No transformers, no GPU kernel.
"""

from __future__ import annotations

import pathlib

import numpy as np
from safetensors import safe_open

from paisoar_jax.errors import UserError
from paisoar_jax.runtime.user_files import read_json, safetensors_errors

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCKS, SCALES = "_blocks", "_scales"


def decoded(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor (..., in, out) of its MXFP4 blocks and scales."""
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    rows = values.reshape(*blocks.shape[:-2], -1)  # (..., out, in)
    return np.ascontiguousarray(np.swapaxes(rows, -1, -2))


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `decoded` gives for blocks of this shape."""
    *lead, rows, groups, width = blocks_shape
    return (*lead, groups * width * 2, rows)


class SafetensorsReader:
    """The tensors of an HF directory, each read memory-mapped when asked for."""

    def __init__(self, directory: pathlib.Path):
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{index} has no weight_map object: not a safetensors index")
            self.files = {name: directory / file for name, file in weight_map.items()}
            for path in sorted(set(self.files.values())):  # each shard's header, read now
                with safetensors_errors(path), safe_open(path, framework="numpy"):
                    pass
        else:
            self.files = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safetensors_errors(path), safe_open(path, framework="numpy") as handle:
                    self.files |= {name: path for name in handle.keys()}  # noqa: SIM118
        if not self.files:
            raise UserError(f"{directory} holds no *.safetensors weights")

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 (bf16 and fp16 widened, MXFP4 decoded), in host memory."""
        import jax

        if self._quantized(name):
            blocks, scales = (self._raw(name + suffix) for suffix in (BLOCKS, SCALES))
            return decoded(blocks, scales)
        # flax, for bf16 (numpy has none); on the host CPU, not an accelerator.
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            path = self.files[name]
            with safetensors_errors(path), safe_open(path, framework="flax") as handle:
                return np.asarray(handle.get_tensor(name), dtype=np.float32)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header (nothing is read)."""
        if self._quantized(name):
            return decoded_shape(self.shape(name + BLOCKS))
        path = self.files[name]
        with safetensors_errors(path), safe_open(path, framework="numpy") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def name_of(self, name: str) -> str | None:
        """The stored name of `name`: GPT-2's without `transformer.` where saved that way.

        A tensor stored in MXFP4 (name_blocks and name_scales) is found by its own name.
        """
        if name in self.files or self._quantized(name):
            return name
        bare = name.removeprefix("transformer.")
        return bare if bare in self.files else None

    def _quantized(self, name: str) -> bool:
        """Whether `name` is stored in MXFP4, as its blocks and scales (GPT-OSS's experts)."""
        return name not in self.files and all(
            name + suffix in self.files for suffix in (BLOCKS, SCALES)
        )

    def _raw(self, name: str) -> np.ndarray:
        """One tensor as stored (MXFP4's bytes)."""
        path = self.files[name]
        with safetensors_errors(path), safe_open(path, framework="numpy") as handle:
            return handle.get_tensor(name)
