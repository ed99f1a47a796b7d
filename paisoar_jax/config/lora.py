"""The `lora` section: LoRA fine-tuning's settings (paisoar_jax/engine/lora.py does the work)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from paisoar_jax.config.checks import check_regex
from paisoar_jax.errors import UserError


@dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning (paisoar_jax/engine/lora.py): low-rank adapters trained, the model frozen.

    `rank` 0 (the default) trains every parameter. With a rank, each projection whose
    parameter path a `targets` regex is found in (re.search on dotted paths such as
    `blocks.q_kernel`) gets y += (alpha / rank) x A B, A (in x rank) and B (rank x out) in
    fp32 with B starting at zero; every other parameter is frozen: no gradient, no optimizer
    state, stored in the compute dtype.
    """

    rank: int = 0  # the adapters' rank r; 0 trains every parameter (no LoRA)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on a projection's input to its adapter, in training only
    # regexes of the projections to adapt (`q_kernel|v_kernel`), or PEFT's module names on a
    # zoo decoder (`q_proj`, `c_attn`, `all-linear`); empty: the zoo decoder's attention and
    # MLP projections (a model of your own names its nnx.Linear kernels)
    targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.rank < 0:
            raise UserError(f"lora.rank must be >= 1 (0: no LoRA), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise UserError(f"lora.alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        for pattern in self.targets:
            check_regex(pattern, "lora.targets")
        if not self.rank:
            unused = [key for key in ("targets", "alpha", "dropout") if self._changed(key)]
            if unused:
                raise UserError(
                    f"lora.{unused[0]} is set, but lora.rank=0 trains no adapters: set "
                    f"lora.rank (8 or 16 are common) to train adapters, or leave lora.{unused[0]} "
                    f"at its default to train every parameter"
                )

    def _changed(self, key: str) -> bool:
        """Whether `key` differs from its default."""
        return getattr(self, key) != getattr(LoraConfig, key)

    @property
    def enabled(self) -> bool:
        """Whether this run trains adapters (and freezes the rest)."""
        return self.rank > 0
