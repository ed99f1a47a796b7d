"""Named activation-checkpointing (remat) policies, applied per transformer block.

none           keep every activation: fastest, most memory
full           keep only the block input, recompute the rest in the backward pass
dots           keep matmul outputs, recompute the cheap elementwise ops
dots_no_batch  keep only matmuls without a batch dimension (weights x activations)
minimal        keep the attention output and the MLP input of each block (tagged with
               checkpoint_name in the model), recompute the rest
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
}


def remat_block(block_call: Callable, policy_name: str, scanned: bool) -> Callable:
    """Wraps a block's forward function in jax.checkpoint with the named policy."""
    if policy_name == "none":
        return block_call
    # Under scan the loop already stops XLA from merging the recomputation back into the
    # forward pass, so the CSE barrier (which slows things down) is only needed unrolled.
    return jax.checkpoint(block_call, policy=POLICIES[policy_name], prevent_cse=not scanned)
