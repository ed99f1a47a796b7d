"""The `dpo` section: preference optimisation's settings (tasks/preference.py does the work).

Read when train.objective=dpo: a dataset of preference pairs (`convert text --format
preference`) trains the policy to prefer each chosen response over its rejected one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from paisoar_jax.config.models import LanguageModelConfig
from paisoar_jax.errors import UserError

# The loss types that need no reference model: they score the policy's own mean log-probs.
REFERENCE_FREE = ("orpo", "simpo")


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation and its cousins (train.objective=dpo).

    With r = beta x (log pi(y|x) - log ref(y|x)) each response's implicit reward, `sigmoid`
    (DPO) minimises -log sigmoid(r_chosen - r_rejected); `ipo` the squared distance of the
    per-token log-ratio margin from 1 / (2 beta); `hinge` max(0, 1 - margin). `orpo` and
    `simpo` need no reference: ORPO adds beta x the log odds ratio's -log sigmoid to the
    chosen response's mean cross-entropy, SimPO is the sigmoid loss on mean log-probs with a
    target margin simpo_gamma. The reference is the model as the run starts (an import, or a
    LoRA run's base), scored once over the train set before the first step.
    """

    # DPO's beta (IPO's tau, ORPO's lambda): how far the policy may move from the reference
    beta: float = 0.1
    # sigmoid (DPO), ipo, hinge; reference-free: orpo, simpo
    loss_type: Literal["sigmoid", "ipo", "hinge", "orpo", "simpo"] = "sigmoid"
    # sigmoid and simpo: the probability that a pair's preference is flipped (conservative
    # DPO): the loss becomes (1 - e) x the loss + e x the loss of the pair reversed
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # simpo: the target margin of the mean log-probs, over beta

    def __post_init__(self):
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise UserError(f"dpo.beta must be a positive number, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(
                f"dpo.label_smoothing must be in [0, 0.5) (the chance a label is flipped), got "
                f"{self.label_smoothing}"
            )
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise UserError(
                f"dpo.label_smoothing is for dpo.loss_type=sigmoid or simpo, not {self.loss_type}"
            )
        if not math.isfinite(self.simpo_gamma):
            raise UserError(f"dpo.simpo_gamma must be a number, got {self.simpo_gamma}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model's log-probs."""
        return self.loss_type not in REFERENCE_FREE


def check_objective(config) -> None:
    """train.objective and the harness evals against the model, the data, the dpo section.

    `config`: a Config (its cross-section checks call this).
    """
    if config.train.harness_every and (
        not isinstance(config.model, LanguageModelConfig) or config.mesh.stages > 1
    ):
        raise UserError(
            "train.harness_every evaluates the zoo's decoders (gpt, llama and their imports) "
            "on meshes without pipeline stages (generation runs the stack whole)"
        )
    for section, objective in (("dpo", "dpo"), ("grpo", "grpo")):
        settings = getattr(config, section)
        changed = [
            field.name
            for field in dataclasses.fields(settings)
            if getattr(settings, field.name) != field.default
        ]
        if changed and config.train.objective != objective:
            raise UserError(
                f"{section}.{changed[0]} is set, but train.objective="
                f"{config.train.objective} reads no {section} section: set "
                f"train.objective={objective}"
            )
    if config.train.objective == "next_token":
        return
    if not isinstance(config.model, LanguageModelConfig):
        raise UserError(
            f"train.objective={config.train.objective} trains the zoo's decoders (gpt, llama "
            f"and their imports); model.name={config.model.name} is not one"
        )
    if config.train.objective == "grpo":
        source = config.data.source
        if not (source.endswith(".jsonl") or source.startswith("hf:")) or config.data.mixture:
            raise UserError(
                f"train.objective=grpo reads prompts from a JSON Lines file (data.source="
                f"prompts.jsonl) or a datasets dataset saved to disk (data.source=hf:DIR, its "
                f"data.hf_split), records with a prompt field; not {source}"
            )
        if not config.grpo.rewards:
            raise UserError("train.objective=grpo needs grpo.rewards=[module:function, ...]")
        if config.mesh.stages > 1 or config.mesh.contexts > 1:
            raise UserError(
                "train.objective=grpo generates with the stack whole and sequences unsplit: "
                "mesh.stage and mesh.context must be 1"
            )
        evals = config.train.harness_every or config.data.eval_sets or config.data.eval_source
        if evals:
            raise UserError(
                "train.objective=grpo measures each step by its rewards: it reads no eval sets "
                "(data.eval_source, data.eval_sets, train.harness_every)"
            )
        return
    if not config.data.source.startswith(("arrayrecord:", "hf:")) or config.data.mixture:
        raise UserError(
            f"train.objective={config.train.objective} reads a preference dataset: convert "
            f"your pairs with `python -m paisoar_jax.convert text --format preference` and "
            f"set data.source=arrayrecord:DIR (data.source={config.data.source})"
        )
