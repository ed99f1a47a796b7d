"""MXFP4 weights (GPT-OSS's published experts), decoded to float32 as an import reads them.

OCP's microscaling format: each block of 32 values along a row shares one scale, a power of
two stored as a biased exponent byte (e8m0: 2^(byte - 127)); each value is a 4-bit float
(e2m1: one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two to a byte, the even-indexed one in the
low nibble. A checkpoint keeps a tensor W as W_blocks (..., rows, blocks, 16 bytes) and
W_scales (..., rows, blocks), its rows the out features; decoded, they are transposed to
the (in, out) layout of the bf16 checkpoints. Exact: every decoded value is a float32 (and
a bf16). The library reads the bytes itself: no transformers, no GPU kernel.
"""

from __future__ import annotations

import numpy as np

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
