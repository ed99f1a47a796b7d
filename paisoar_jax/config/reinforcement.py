"""The `grpo` section: group relative policy optimisation (tasks/policy.py does the work).

Read when train.objective=grpo: each step, every prompt of the batch is answered
`generations` times by the policy as it is, the user's reward functions score the answers,
and the policy is moved towards the answers that scored above their group's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from paisoar_jax.errors import UserError


@dataclass(frozen=True)
class GrpoConfig:
    """GRPO (train.objective=grpo): rewards, groups, the clipped objective and its KL term.

    Each answer's advantage is its reward minus its group's mean (over the group's standard
    deviation with scale_rewards). The loss per answer token is -min(ratio x A, clip(ratio,
    1 - epsilon, 1 + epsilon_high) x A) + beta x KL(policy || reference) (the k3
    estimator), summed over answer tokens and divided as loss_type says: dapo by the
    batch's answer tokens, grpo by each answer's tokens then the answers, dr_grpo by the
    answers x max_new. With iterations > 1 each generation's answers are learned from for
    that many steps, the ratio taken to the log-probabilities of the policy that drew them.
    """

    generations: int = 8  # answers per prompt (the group); train.global_batch counts answers
    max_new: int = 32  # the most tokens an answer has
    temperature: float = 1.0  # sampling temperature of the answers
    top_p: float = 1.0  # sampling's nucleus
    # texts that end an answer where they first appear (kept in it, as TRL's generation
    # keeps them); the end-of-sequence token always ends one
    stop: tuple[str, ...] = ()
    # reward functions, "module:function" (importable from the working directory): each is
    # called as f(prompts, completions, **the prompt records' other fields) -> [float]
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()  # one per reward function; empty: 1 each
    scale_rewards: bool = True  # divide each advantage by its group's standard deviation
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"  # how the token losses are averaged
    epsilon: float = 0.2  # the ratio's clip below 1
    epsilon_high: float = 0.0  # the ratio's clip above 1 (0: epsilon; DAPO's clip-higher)
    # the KL penalty to the reference (the weights of checkpoint.init_from); 0: none
    beta: float = 0.0
    # optimisation steps on each generation's answers (TRL's num_iterations): the prompts
    # are read and answered every `iterations` steps; from the second step on, the ratio
    # is to the policy that drew the answers (scored when drawn) and the clip holds it
    iterations: int = 1

    def __post_init__(self):
        if self.generations < 2:
            raise UserError(
                f"grpo.generations must be at least 2 (a group needs answers to compare), got "
                f"{self.generations}"
            )
        if self.iterations < 1:
            raise UserError(f"grpo.iterations must be at least 1, got {self.iterations}")
        if self.max_new < 1:
            raise UserError(f"grpo.max_new must be at least 1, got {self.max_new}")
        for key in ("temperature", "epsilon", "epsilon_high", "beta"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"grpo.{key} must be a number >= 0, got {value}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise UserError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                f"{len(self.rewards)} grpo.rewards: give one each, or none"
            )
        for name in self.rewards:
            if name.count(":") != 1 or not all(name.split(":")):
                raise UserError(f"grpo.rewards: {name!r} is not module:function")
