"""The decoder's stack: its blocks run in turn, scanned or unrolled, with their statistics.

`run_blocks` takes the stream (or `PackedRows`, for packed documents) through every block:
one scanned block compiled once (or the pipeline of mesh.stage > 1), or each block unrolled
(`run_one_block`, which the multi-token prediction modules use too). A block whose router
moves a balancing bias writes it back here. Shape suffixes: B batch, T time, D width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.numerics.remat import wrap_block_call
from paisoar_jax.parallel.pipeline import scan_layers


def run_blocks(blocks, x_BxTxD, rotary, remat_policy: str, model_config):
    """(the stream or PackedRows through every block, the MoE layers' router statistics).

    One scanned block, or each in turn; the statistics are stacked over the MoE layers
    ({} for a dense model).
    """
    scanned = model_config.scan_layers
    if scanned:
        graphdef, stacked_state = nnx.split(blocks)
        step = wrap_block_call(functools.partial(_block_step, graphdef, rotary), remat_policy, True)
        # A plain scan, or the pipeline of mesh.stage > 1 (pipeline.py); only a mixture of
        # experts' blocks have outputs to collect.
        if model_config.experts == 0:
            return scan_layers(step, x_BxTxD, stacked_state), {}
        x_BxTxD, statistics = scan_layers(step, x_BxTxD, stacked_state, with_outputs=True)
        if "router_bias" in statistics:  # bias balancing: the stack's next biases
            blocks.moe.router_bias[...] = statistics.pop("router_bias")
        return x_BxTxD, statistics
    per_layer = []
    for block in blocks:
        x_BxTxD, statistics = run_one_block(block, x_BxTxD, rotary=rotary, remat=remat_policy)
        per_layer += [statistics] if statistics else []
    if not per_layer:
        return x_BxTxD, {}
    return x_BxTxD, jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)


def run_one_block(block, x, *, rotary, remat: str):
    """(the stream or PackedRows through one unscanned block, its router statistics).

    Its router's bias, where bias balancing moves it, is written back.
    """
    graphdef, block_state = nnx.split(block)
    step = functools.partial(_block_step, graphdef, rotary)
    x, statistics = wrap_block_call(step, remat, False)(x, block_state)
    if "router_bias" in statistics:
        block.moe.router_bias[...] = statistics.pop("router_bias")
    return x, statistics


def stream_of(x) -> jax.Array:
    """The stream B x T x D that `x` carries: `x` itself, or PackedRows' stream."""
    return x.stream if isinstance(x, PackedRows) else x


def with_stream(x, stream_BxTxD: jax.Array):
    """`x` with another stream: that stream, or PackedRows carrying it with x's documents."""
    return x._replace(stream=stream_BxTxD) if isinstance(x, PackedRows) else stream_BxTxD


class PackedRows(NamedTuple):
    """The stream of packed documents through the blocks, with what attention needs per row.

    One carry, so a pipeline (which splits its input into micro-batches) splits the
    documents' segments and positions with their rows.
    """

    stream: jax.Array  # B x T x D
    segments: jax.Array | None  # B x T int32: each token's document (None: one per row)
    positions: jax.Array  # B x T int32: each token's position in its document


def _block_step(graphdef, rotary, x, block_state):
    """One block as a pure function of its state, shaped for jax.lax.scan (carry, output).

    `x`: the stream, with `rotary` its tables (or None); or PackedRows, with `rotary` the
    function of positions that makes the tables.
    """
    block = nnx.merge(graphdef, block_state)
    # Back to the stream's dtype: a block forced to another policy stays a drop-in.
    if isinstance(x, PackedRows):
        tables = None if rotary is None else rotary(x.positions)
        out_BxTxD, statistics = block(x.stream, tables, x.segments, x.positions)
        return x._replace(stream=out_BxTxD.astype(x.stream.dtype)), statistics
    out_BxTxD, statistics = block(x, rotary)
    return out_BxTxD.astype(x.dtype), statistics
