"""The `optim` section: the optimizer, its learning-rate schedule, clipping and decay.

engine/optim.py builds the optax chain from it (engine/muon.py Muon's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paisoar_jax.config.checks import check_at_least, check_finite_non_negative
from paisoar_jax.errors import UserError


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule, clipping and weight decay."""

    # the optax optimizer; muon: the hidden matrices by Muon (optax.contrib.muon, their axes
    # from the parameters' logical names), embeddings, head, norms and biases by AdamW
    name: Literal["adamw", "sgd", "lamb", "lars", "muon"] = "adamw"
    lr: float = 3e-3  # the peak learning rate, reached after warmup_steps
    # the learning rate after warm-up: cosine or linear decay to lr x final_lr_fraction at
    # train.steps, or constant
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 30  # steps of linear warm-up from 0 to lr
    final_lr_fraction: float = 0.1  # cosine/linear decay ends at lr * this
    # Global-norm clipping; 0 disables. Unset: 1.0 around the config's optimizer, none around
    # an optimizer given to fit (it runs as given; set this to clip it too).
    clip_norm: float | None = None
    # adamw, lamb: decoupled; sgd: L2 on the gradient; lars: before the trust ratio; never
    # norms, biases
    weight_decay: float = 0.1
    b1: float = 0.9  # adamw, lamb: decay of the first-moment (mean) estimate
    b2: float = 0.95  # adamw, lamb: decay of the second-moment (variance) estimate
    eps: float = 1e-8  # adamw, lamb: added to the root of the second moment
    momentum: float = 0.9  # sgd and lars
    nesterov: bool = False  # sgd and lars
    trust_coefficient: float = 0.001  # lars: the layer-wise trust ratio's coefficient
    muon_momentum: float = 0.95  # muon: the momentum its matrices' steps orthogonalise
    # muon: its matrices' updates scaled to this RMS x sqrt(max(rows, columns)) (Moonlight's
    # 0.2 matches AdamW's update size, so one optim.lr serves both halves); 0: optax's
    # shape scaling, which wants Muon's own larger lr
    muon_consistent_rms: float = 0.2
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # rescale lr for the global batch
    base_batch: int = 0  # the global batch `lr` was tuned for (needed when lr_scaling != none)

    def clipping(self, own_optimizer: bool) -> float:
        """The clip norm of the run (0: none), with or without an optimizer given to fit."""
        if self.clip_norm is not None:
            return self.clip_norm
        return 0.0 if own_optimizer else 1.0

    def __post_init__(self):
        if self.lr_scaling != "none" and self.base_batch < 1:
            raise UserError(f"optim.lr_scaling={self.lr_scaling} needs optim.base_batch >= 1")
        if not self.lr > 0:
            raise UserError(f"optim.lr must be > 0, got {self.lr}")
        check_at_least("optim", self, {"warmup_steps": 0})
        numbers = ("clip_norm", "weight_decay", "final_lr_fraction", "lr", "muon_consistent_rms")
        check_finite_non_negative("optim", self, numbers)
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
