"""Named activation-checkpointing (remat) policies, applied per transformer block.

Each policy says which of a block's intermediate values the backward pass finds saved; the
rest it recomputes from the block's input (which is always kept, by the scan over layers).

none           keep every activation. Fastest; use it whenever the batch fits.
full           keep only the block input, recompute the whole block in the backward pass
               (about one extra forward: ~33% more FLOPs). Least memory; use it for the
               largest models or batches, or when an OOM names activations.
dots           keep matmul outputs, recompute the cheap elementwise ops (norms, GELU,
               softmax). Most of `none`'s speed for much less memory: the first thing to try
               when `none` does not fit.
dots_no_batch  keep only matmuls without a batch dimension (weights x activations, not the
               attention scores): between dots and full.
minimal        keep the attention output and the MLP hidden activation of each block
               (tagged with checkpoint_name in the model), recompute the rest: close to
               full's memory at a smaller recompute cost.
offload_dots_no_batch   like dots_no_batch, but the saved values move to pinned host
               memory during the forward and come back for the backward: device memory
               of full, compute of dots_no_batch, paid in host-device bandwidth.
offload_minimal         like minimal, with the kept values offloaded to pinned host memory.

Measured figures (compiled temporary memory, step time) are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# checkpoint_name tags the model puts on the values the `minimal` policy keeps.
SAVED_NAMES = ("attention_out", "mlp_hidden")

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
    "offload_dots_no_batch": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
    "offload_minimal": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=SAVED_NAMES,
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def remat_block(block_call: Callable, policy_name: str, scanned: bool) -> Callable:
    """Wraps a block's forward function in jax.checkpoint with the named policy."""
    if policy_name == "none":
        return block_call
    # Under scan the loop already stops XLA from merging the recomputation back into the
    # forward pass, so the CSE barrier (which slows things down) is only needed unrolled.
    return jax.checkpoint(block_call, policy=POLICIES[policy_name], prevent_cse=not scanned)
