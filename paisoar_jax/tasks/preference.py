"""Preference optimisation (train.objective=dpo): DPO, IPO, hinge; reference-free ORPO, SimPO.

A row of the batch holds preference pairs (data/preferences.py): tokens (B, 2, T + 1),
side 0 the prompt with its chosen response, side 1 with its rejected one. Both sides run
through the model in one forward (2B rows), each response's log-probability is the sum
of its learned targets' (`pair_log_probs`), and the loss compares them (config/preference.py
says each loss type's formula):

    pi_c, pi_r      the policy's log-probabilities of the chosen and rejected responses
    ref_c, ref_r    the reference model's (batch["reference"], scored before the first
                    step by tasks/reference.py)
    reward          beta x (pi - ref): DPO's implicit reward of a response

The loss is the mean over the batch's pairs (`loss_weight` counts them, so micro-batches
and data shards weigh in by their pairs); its metrics carry TRL's names: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected. For
ORPO and SimPO the rewards are beta x the mean log-probability per token, as TRL's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paisoar_jax.config import DpoConfig
from paisoar_jax.data.preferences import PreferenceWindows
from paisoar_jax.engine.evaluation import EvalSet, HarnessTasks
from paisoar_jax.errors import UserError
from paisoar_jax.models import moe
from paisoar_jax.parallel.context import balanced_order
from paisoar_jax.parallel.sharding import context_shards
from paisoar_jax.tasks.builtin import LanguageModelling, TaskSections, token_losses

METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
SIDES = ("tokens", "loss_mask", "pair", "segments", "positions")  # (B, 2, ...) per side


class PreferenceOptimisation(LanguageModelling):
    """A zoo decoder taught to prefer each chosen response over its rejected one."""

    unit_of_data = "rows of preference pairs"
    reports_perplexity = False  # eval_loss is the preference loss, not a per-token one
    reads_pairs = True

    def __init__(self, sections: TaskSections, model_class: type, settings: DpoConfig):
        super().__init__(sections, model_class)
        self.settings = settings
        self.metric_names = METRIC_NAMES + self.metric_names  # (the router's, with experts)
        self.pairs_per_row = 1  # the most pairs a row holds; set by open_sources

    @property
    def needs_reference(self) -> bool:
        """Whether batches carry the reference model's log-probabilities."""
        return self.settings.needs_reference

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The train and eval rows of pairs: each source must be a preference dataset."""
        train, eval_sets = super().open_sources()
        row_sets = [one for one in eval_sets if not isinstance(one.source, HarnessTasks)]
        for name, source in (("data.source", train), *_named(row_sets)):
            if not isinstance(source, PreferenceWindows):
                raise UserError(
                    f"train.objective=dpo reads preference pairs, and {name} holds none: "
                    f"convert them with `python -m paisoar_jax.convert text --format "
                    f"preference`"
                )
        sources = [train, *(eval_set.source for eval_set in row_sets)]
        self.pairs_per_row = max(source.pairs_per_row for source in sources)
        return train, eval_sets

    def batch_shape(self, global_batch: int) -> dict:
        """Two sides of T + 1 tokens a row, their masks and pairs (and the reference's)."""
        T, B = self.model_config.seq_len, global_batch
        shape = {
            "tokens": jax.ShapeDtypeStruct((B, 2, T + 1), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((B, 2, T), bool),
            "pair": jax.ShapeDtypeStruct((B, 2, T), jnp.int32),
        }
        if self.data.packing == "documents":
            for name in ("segments", "positions"):
                shape[name] = jax.ShapeDtypeStruct((B, 2, T), jnp.int32)
        if self.needs_reference:
            shape["reference"] = jax.ShapeDtypeStruct((B, 2, self.pairs_per_row), jnp.float32)
        return shape

    def units_per_example(self) -> int:
        """Tokens per row: both sides."""
        return 2 * self.model_config.seq_len

    def pair_log_probs(self, model, batch) -> tuple[jax.Array, jax.Array, dict]:
        """(B, 2, P) summed log-probs and learned-target counts of each pair's responses.

        Also the router's statistics (a mixture of experts), for its auxiliary loss.
        """
        flat = {name: _flatten(batch[name]) for name in SIDES if name in batch}
        losses_NxT, learned_NxT, statistics, _ = token_losses(model, flat)
        pair_NxT = flat["pair"]
        shards = context_shards()
        if shards > 1 and model.config.context_balance:  # token_losses' order (balanced)
            pair_NxT = pair_NxT[:, balanced_order(pair_NxT.shape[1], shards)]
        slots_NxTxP = jax.nn.one_hot(pair_NxT, self.pairs_per_row, dtype=jnp.float32)
        slots_NxTxP = slots_NxTxP * learned_NxT[:, :, None]
        log_probs_NxP = jnp.einsum("nt,ntp->np", -losses_NxT, slots_NxTxP)
        counts_NxP = slots_NxTxP.sum(axis=1)
        B = batch["tokens"].shape[0]
        return log_probs_NxP.reshape(B, 2, -1), counts_NxP.reshape(B, 2, -1), statistics

    def pair_losses(self, batch, log_probs_Bx2xP, counts_Bx2xP) -> dict[str, jax.Array]:
        """Each pair's loss and metric terms, (B, P) each, and "valid": the pairs that exist."""
        settings, beta = self.settings, self.settings.beta
        valid_BxP = (counts_Bx2xP > 0).all(axis=1).astype(jnp.float32)
        lengths_Bx2xP = jnp.maximum(counts_Bx2xP, 1)
        chosen, rejected = log_probs_Bx2xP[:, 0], log_probs_Bx2xP[:, 1]
        if settings.needs_reference:
            ratios_Bx2xP = log_probs_Bx2xP - batch["reference"]
            rewards_Bx2xP = beta * ratios_Bx2xP
            margin_BxP = rewards_Bx2xP[:, 0] - rewards_Bx2xP[:, 1]
            if settings.loss_type == "sigmoid":
                losses_BxP = _smoothed_sigmoid_loss(margin_BxP, settings.label_smoothing)
            elif settings.loss_type == "ipo":  # per-token ratios, as TRL (the IPO authors')
                per_token_Bx2xP = ratios_Bx2xP / lengths_Bx2xP
                difference_BxP = per_token_Bx2xP[:, 0] - per_token_Bx2xP[:, 1]
                losses_BxP = (difference_BxP - 1 / (2 * beta)) ** 2
            else:  # hinge
                losses_BxP = jax.nn.relu(1 - margin_BxP)
        else:
            means_Bx2xP = log_probs_Bx2xP / lengths_Bx2xP
            chosen, rejected = means_Bx2xP[:, 0], means_Bx2xP[:, 1]
            rewards_Bx2xP = beta * means_Bx2xP
            if settings.loss_type == "simpo":
                logits_BxP = chosen - rejected - settings.simpo_gamma / beta
                losses_BxP = _smoothed_sigmoid_loss(beta * logits_BxP, settings.label_smoothing)
            else:  # orpo: the chosen response's cross-entropy plus the odds-ratio term
                log_odds_BxP = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
                losses_BxP = -chosen - beta * jax.nn.log_sigmoid(log_odds_BxP)
        margin_BxP = rewards_Bx2xP[:, 0] - rewards_Bx2xP[:, 1]
        return {
            "loss": losses_BxP,
            "rewards/chosen": rewards_Bx2xP[:, 0],
            "rewards/rejected": rewards_Bx2xP[:, 1],
            "rewards/accuracies": (margin_BxP > 0).astype(jnp.float32),
            "rewards/margins": margin_BxP,
            "logps/chosen": chosen,
            "logps/rejected": rejected,
            "valid": valid_BxP,
        }

    def loss(self, model, batch, key: jax.Array) -> tuple[jax.Array, dict]:
        """The mean preference loss over the batch's pairs, and TRL's metrics (their means)."""
        del key  # no randomness (no dropout)
        log_probs, counts, statistics = self.pair_log_probs(model, batch)
        terms = self.pair_losses(batch, log_probs, counts)
        valid_BxP = terms.pop("valid")
        pairs = jnp.maximum(valid_BxP.sum(), 1)
        means = {name: jnp.sum(values * valid_BxP) / pairs for name, values in terms.items()}
        loss = means.pop("loss")
        if not statistics:
            return loss, means
        router_loss = moe.auxiliary_loss(statistics, self.model_config)
        return loss + router_loss, means | moe.metrics_of(statistics, self.model_config)

    def loss_weight(self, batch) -> jax.Array:
        """The pairs of the batch: the loss is a mean over them."""
        counts = jax.nn.one_hot(batch["pair"], self.pairs_per_row) * batch["loss_mask"][..., None]
        return (counts.sum(axis=2) > 0).all(axis=1).sum(dtype=jnp.float32)

    def eval_rows(self, model, batch) -> dict[str, jax.Array]:
        """Per row: the mean loss and metrics of its pairs, weighed by its pair count."""
        log_probs, counts, _ = self.pair_log_probs(model, batch)
        terms = self.pair_losses(batch, log_probs, counts)
        valid_BxP = terms.pop("valid")
        pairs_B = valid_BxP.sum(axis=1)
        rows = {
            name: jnp.sum(values * valid_BxP, axis=1) / jnp.maximum(pairs_B, 1)
            for name, values in terms.items()
        }
        return rows | {"weight": pairs_B}

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""
        return super().signature() | {"objective": "dpo"}

    def closing_sample(self, layout, state, mesh) -> None:
        """No sample: `python -m paisoar_jax.generate RUN` shows what the policy writes."""
        return None


def _named(eval_sets: tuple[EvalSet, ...]) -> list[tuple[str, Any]]:
    """(the key that names it, source) of each eval set."""
    return [
        (f"data.eval_sets[{s.name}]" if s.name else "the eval split", s.source) for s in eval_sets
    ]


def _flatten(x_Bx2xT: jax.Array) -> jax.Array:
    """(B, 2, ...) -> (2B, ...): both sides of every row in one batch of sequences."""
    return x_Bx2xT.reshape(-1, *x_Bx2xT.shape[2:])


def _smoothed_sigmoid_loss(margin: jax.Array, smoothing: float) -> jax.Array:
    """-log sigmoid(margin), with the share `smoothing` of the pair taken as reversed."""
    return -(1 - smoothing) * jax.nn.log_sigmoid(margin) - smoothing * jax.nn.log_sigmoid(-margin)


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate near 0."""
    return jnp.log(-jnp.expm1(jnp.minimum(x, -1e-7)))
