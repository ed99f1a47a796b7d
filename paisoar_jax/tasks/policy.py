"""Group relative policy optimisation (train.objective=grpo): answers, rewards, the update.

The step's input is a batch of prompts (a JSON Lines file: {"prompt": text or messages,
...}); before the step, `rollout` turns it into the rows the step learns from:

    1. each prompt is answered grpo.generations times by the policy as it is (the run's
       live weights, the key/value cache, temperature and top-p), drawn with a key of
       (train.seed, step): a resumed run draws what the uninterrupted one drew;
    2. each reward function scores the answers' text, f(prompts, completions, **the
       records' other fields); their weighted sum is an answer's reward;
    3. advantage = reward - its group's mean (over the group's standard deviation with
       grpo.scale_rewards);
    4. a row: prompt + answer tokens (the answer's targets learned), its advantage, the
       reference's log-probs (grpo.beta > 0: the weights of checkpoint.init_from), and the
       host's figures (rewards per function, length, generation time) for the metrics.

The loss per answer token is the clipped surrogate -min(r A, clip(r, 1 - e, 1 + e_high) A)
with r the probability ratio to the policy that drew the answer, plus beta x the k3 estimate
of KL(policy || reference); config/reinforcement.py says how loss_type averages it. With
grpo.iterations=1 r is 1 in value, its gradient that of the log-probability. With more, a
generation's rows are held and learned from for that many steps (no prompts are read in
between), r taken to their log-probs under the policy that drew them, scored when drawn; a
checkpoint saved in between keeps the held rows, so a resumed run learns from what the
uninterrupted one did. Metrics carry TRL's names: reward, reward_std,
rewards/<function>/mean, kl, clip_ratio/region_mean, completions/mean_length, and
generation_s (seconds generating, beside step_time_s; 0 on a step of held rows).
"""

from __future__ import annotations

import base64
import importlib
import io
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paisoar_jax.config import GrpoConfig
from paisoar_jax.data import hf_datasets
from paisoar_jax.data.conversations import json_rows
from paisoar_jax.data.pipeline import batch_dataset
from paisoar_jax.engine.evaluation import EvalSet
from paisoar_jax.errors import SettingNames, UserError
from paisoar_jax.inference.text import Text
from paisoar_jax.parallel import sharding
from paisoar_jax.tasks.builtin import LanguageModelling, TaskSections, token_losses

# How errors name the dataset's settings: the run's keys
HF_NAMES = SettingNames({"from_hf": "data.source=hf:", "split": "data.hf_split"}, "=")


class PromptRows:
    """The prompts of (record, where) pairs, tokenized, each right-padded to `width`.

    Each row also holds its length and index; the records' other fields are the reward
    functions' keywords.
    """

    def __init__(self, records: Iterator[tuple[Any, str]], text: Text, width: int):
        self.records, self.tokens = [], []
        for record, where in records:
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if isinstance(prompt, str):
                ids = text.encode(prompt)
            elif isinstance(prompt, list):
                ids = text.encode_chat(prompt)
            else:
                raise UserError(f"{where}: a prompt record needs a 'prompt' (text or messages)")
            if not 0 < len(ids) <= width:
                raise UserError(
                    f"{where}: the prompt has {len(ids)} tokens; model.seq_len + 1 - "
                    f"grpo.max_new leaves it {width}"
                )
            self.records.append(record)
            self.tokens.append(ids)
        self.width = width

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        prompt = np.zeros(self.width, np.int32)
        prompt[: len(self.tokens[index])] = self.tokens[index]
        return {
            "prompt": prompt,
            "length": np.int32(len(self.tokens[index])),
            "index": np.int32(index),
        }


class PolicyOptimisation(LanguageModelling):
    """A zoo decoder moved towards the answers its reward functions score higher."""

    unit_of_data = "prompts"
    reports_perplexity = False

    def __init__(
        self, sections: TaskSections, model_class: type, settings: GrpoConfig, init_from: str
    ):
        super().__init__(sections, model_class)
        self.settings, self.init_from = settings, init_from
        self.rewards: list = []  # imported by open_sources: generating from a run needs none
        self.weights = np.asarray(settings.reward_weights or [1.0] * len(settings.rewards))
        names = [name.split(":")[1] for name in settings.rewards]
        self.figure_names = (
            *(f"rewards/{name}/mean" for name in names),
            *(f"rewards/{name}/std" for name in names),
            "reward",
            "reward_std",
            "completions/mean_length",
            "generation_s",
        )
        self.metric_names = (*self.figure_names, "kl", "clip_ratio/region_mean")
        self.prompts: PromptRows | None = None
        # (the step that drew them, their rows on the host): the answers learned from until
        # grpo.iterations steps have (see the module docstring)
        self.held: tuple[int, dict[str, np.ndarray]] | None = None
        if settings.beta and not init_from:
            raise UserError(
                "grpo.beta > 0 compares with the reference weights of checkpoint.init_from (an "
                "import): set it, or grpo.beta=0"
            )

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The prompts (no eval sets: the rewards of each step are its measure)."""
        if jax.process_count() > 1:
            raise UserError("train.objective=grpo runs in one process for now")
        if self.train.global_batch % self.settings.generations:
            raise UserError(
                f"train.global_batch={self.train.global_batch} counts answers: a multiple of "
                f"grpo.generations={self.settings.generations}"
            )
        self.rewards = [_reward_function(name) for name in self.settings.rewards]
        init = pathlib.Path(self.init_from) if self.init_from else None
        tokenizer = (
            init / "tokenizer.json" if init and (init / "tokenizer.json").is_file() else None
        )
        self.text = Text(tokenizer, self.model_config.vocab_size)
        width = self.model_config.seq_len + 1 - self.settings.max_new
        if width < 1:
            raise UserError(
                f"grpo.max_new={self.settings.max_new} leaves no room for a prompt in "
                f"model.seq_len + 1 = {self.model_config.seq_len + 1} tokens"
            )
        source = self.data.source
        records = (
            hf_datasets.rows(pathlib.Path(source[3:]), self.data.hf_split, HF_NAMES)
            if source.startswith("hf:")
            else json_rows(pathlib.Path(source))
        )
        self.prompts = PromptRows(records, self.text, width)
        return self.prompts, ()

    def host_batches(self, source, *, global_batch: int, seed: int, train: bool, workers=0):
        """The prompts of each step: global_batch / grpo.generations of them."""
        prompts = global_batch // self.settings.generations
        return batch_dataset(source, global_batch=prompts, seed=seed, shuffle=train, in_memory=True)

    def batch_shape(self, global_batch: int) -> dict:
        """The rows rollout makes: answers with their prompts, advantages and figures."""
        T, B = self.model_config.seq_len, global_batch
        shape = {
            "tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((B, T), bool),
            "advantages": jax.ShapeDtypeStruct((B,), jnp.float32),
            "figures": jax.ShapeDtypeStruct((B, len(self.figure_names)), jnp.float32),
        }
        if self.settings.beta:
            shape["reference"] = jax.ShapeDtypeStruct((B, T), jnp.float32)
        if self.settings.iterations > 1:
            shape["old"] = jax.ShapeDtypeStruct((B, T), jnp.float32)
        return shape

    def loss(self, model, batch, key: jax.Array) -> tuple[jax.Array, dict]:
        """The clipped surrogate plus beta x KL over the answer tokens; the figures' means."""
        del key
        settings = self.settings
        losses_BxT, learned_BxT, _, _ = token_losses(model, batch)
        log_probs_BxT = -losses_BxT
        # the policy that drew the answers: scored when drawn, or this one (iterations=1)
        old_BxT = batch["old"] if "old" in batch else jax.lax.stop_gradient(log_probs_BxT)
        ratio_BxT = jnp.exp(log_probs_BxT - old_BxT)
        advantages_Bx1 = batch["advantages"][:, None]
        high = settings.epsilon_high or settings.epsilon
        clipped_BxT = jnp.clip(ratio_BxT, 1 - settings.epsilon, 1 + high)
        per_token_BxT = -jnp.minimum(ratio_BxT * advantages_Bx1, clipped_BxT * advantages_Bx1)
        kl_BxT = jnp.zeros_like(per_token_BxT)
        if settings.beta:
            delta_BxT = batch["reference"] - log_probs_BxT
            kl_BxT = jnp.exp(delta_BxT) - delta_BxT - 1
            per_token_BxT = per_token_BxT + settings.beta * kl_BxT
        tokens = jnp.maximum(learned_BxT.sum(), 1)
        masked_BxT = per_token_BxT * learned_BxT
        if settings.loss_type == "dapo":
            loss = masked_BxT.sum() / tokens
        elif settings.loss_type == "grpo":
            loss = (masked_BxT.sum(1) / jnp.maximum(learned_BxT.sum(1), 1)).mean()
        else:  # dr_grpo
            loss = masked_BxT.sum() / (learned_BxT.shape[0] * settings.max_new)
        clipped = (ratio_BxT != clipped_BxT).astype(jnp.float32)
        figures = batch["figures"].mean(axis=0)
        metrics = dict(zip(self.figure_names, figures, strict=True))
        metrics["kl"] = (kl_BxT * learned_BxT).sum() / tokens
        metrics["clip_ratio/region_mean"] = (clipped * learned_BxT).sum() / tokens
        return loss, metrics

    def loss_weight(self, batch) -> jax.Array | None:
        """dapo: the answer tokens (a mean over them); the others: None (over the answers)."""
        if self.settings.loss_type != "dapo":
            return None
        return batch["loss_mask"].sum(dtype=jnp.float32)

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""
        return {"objective": "grpo", "generations": self.settings.generations}

    def prepare(self, layout, global_batch: int) -> None:
        """The step's prompts must split over the batch shards, as its rows do.

        Checked for training alone (its prompts opened): a generator placed over other
        devices reads the run's weights without them.
        """
        if self.prompts is None:
            return
        mesh = jax.tree.leaves(layout.shardings.params)[0].mesh
        prompts, shards = global_batch // self.settings.generations, sharding.batch_shards(mesh)
        if prompts % shards:
            raise UserError(
                f"train.global_batch / grpo.generations = {prompts} prompts a step do not split "
                f"over the {shards} batch shards: make it a multiple of {shards}"
            )

    def closing_sample(self, layout, state, mesh) -> None:
        """No sample: `python -m paisoar_jax.generate RUN` shows what the policy writes."""
        return None

    def rollout(
        self, run: Any, batch: dict, step: int, generator: Any, reference: Any = None
    ) -> dict:
        """The step's rows from its prompts (see the module docstring), on the devices.

        `generator`: an inference.generator.Generator over the run's weights as they are;
        `reference`: one over checkpoint.init_from's (grpo.beta > 0). The loop makes them.
        """
        settings, G = self.settings, self.settings.generations
        host = jax.device_get(batch)
        order = [int(index) for index in host["index"]]
        prompts = [self.prompts.tokens[index] for index in order for _ in range(G)]
        start = time.perf_counter()
        answers = generator.generate(
            prompts,
            settings.max_new,
            greedy=settings.temperature == 0,
            temperature=settings.temperature or 1.0,
            top_p=settings.top_p,
            seed=run.train.seed * 1_000_003 + step,
            stop_at=generator.end_ids,
            batch_size=len(prompts),
        )
        generation_s = time.perf_counter() - start
        answers = [self._until_stop(answer, generator.end_ids) for answer in answers]
        texts = [self.text.decode([t for t in a if t not in generator.end_ids]) for a in answers]
        rewards_RxF = self._rewards(order, texts)
        rewards_R = rewards_RxF @ self.weights
        advantages_R, spread_P = group_advantages(rewards_R, G, settings.scale_rewards)
        rows = self._rows(prompts, answers)
        lengths = np.asarray([len(answer) for answer in answers], np.float32)
        figures = np.concatenate(
            [
                rewards_RxF,
                np.broadcast_to(rewards_RxF.std(axis=0), rewards_RxF.shape),
                rewards_R[:, None],
                np.full((len(prompts), 1), spread_P.mean()),
                lengths[:, None],
                np.full((len(prompts), 1), generation_s),
            ],
            axis=1,
        ).astype(np.float32)
        rows |= {"advantages": advantages_R, "figures": figures}
        used = [len(prompt) + len(answer) for prompt, answer in zip(prompts, answers, strict=True)]
        if settings.beta:
            rows["reference"] = _row_log_probs(reference, rows["tokens"], used)
        if settings.iterations > 1:  # the later steps' ratios are to the policy drawing now
            rows["old"] = _row_log_probs(generator, rows["tokens"], used)
            self.held = (step, rows)
        return jax.device_put(rows, sharding.batch_sharding(run.mesh))

    def reuses(self, step: int) -> bool:
        """Whether step `step` learns from held rows (grpo.iterations > 1): no prompts read."""
        return self.held is not None and step < self.held[0] + self.settings.iterations

    def held_rows(self, run: Any) -> dict:
        """The held rows again, on the devices (their generation's time counted once)."""
        rows = dict(self.held[1])
        rows["figures"] = rows["figures"].copy()
        rows["figures"][:, self.figure_names.index("generation_s")] = 0.0
        return jax.device_put(rows, sharding.batch_sharding(run.mesh))

    def held_record(self, step: int) -> dict | None:
        """What a checkpoint of step `step` keeps of the held rows (None: the next step draws)."""
        if not self.reuses(step + 1):
            return None
        encoded = {name: _encoded(array) for name, array in self.held[1].items()}
        return {"step": self.held[0], "rows": encoded}

    def hold(self, record: dict | None) -> None:
        """Takes back the rows `held_record` saved (None: nothing held)."""
        if record is None:
            self.held = None
            return
        self.held = (int(record["step"]), {k: _decoded(v) for k, v in record["rows"].items()})

    def _until_stop(self, answer: list[int], end_ids) -> list[int]:
        """The answer through the first token whose text completes one of grpo.stop."""
        if not self.settings.stop:
            return answer
        for count in range(1, len(answer) + 1):
            text = self.text.decode([t for t in answer[:count] if t not in end_ids])
            if any(stop in text for stop in self.settings.stop):
                return answer[:count]
        return answer

    def _rewards(self, order: list[int], texts: list[str]) -> np.ndarray:
        """(answers, functions) rewards: each function called once on every answer."""
        G = self.settings.generations
        records = [self.prompts.records[index] for index in order for _ in range(G)]
        prompts = [record["prompt"] for record in records]
        columns = {
            key: [record.get(key) for record in records] for key in records[0] if key != "prompt"
        }
        scores = []
        for function, name in zip(self.rewards, self.settings.rewards, strict=True):
            values = function(prompts=prompts, completions=texts, **columns)
            values = np.asarray([np.nan if v is None else v for v in values], np.float64)
            if values.shape != (len(texts),):
                raise UserError(
                    f"grpo.rewards: {name} gave {values.size} rewards for {len(texts)} answers"
                )
            scores.append(values)
        return np.nan_to_num(np.stack(scores, axis=1), nan=0.0)

    def _rows(self, prompts: list[list[int]], answers: list[list[int]]) -> dict[str, np.ndarray]:
        """Rows of prompt then answer: tokens (R, T + 1), loss_mask (R, T) the answer's targets."""
        T = self.model_config.seq_len
        tokens = np.zeros((len(prompts), T + 1), np.int32)
        learned = np.zeros((len(prompts), T), bool)
        for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            tokens[row, : len(prompt) + len(answer)] = prompt + answer
            learned[row, len(prompt) - 1 : len(prompt) - 1 + len(answer)] = True
        return {"tokens": tokens, "loss_mask": learned}


def _row_log_probs(reference: Any, tokens: np.ndarray, used: list[int]) -> np.ndarray:
    """(R, T) the reference generator's log-probs of each row's first `used` tokens."""
    scored = reference.score(
        [row[:count].tolist() for row, count in zip(tokens, used, strict=True)]
    )
    log_probs = np.zeros((len(tokens), tokens.shape[1] - 1), np.float32)
    for row, (row_log_probs, _) in enumerate(scored):
        log_probs[row, : len(row_log_probs)] = row_log_probs
    return log_probs


def _encoded(array: np.ndarray) -> str:
    """An array as text for a checkpoint's JSON (exact: .npy bytes in base64)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decoded(text: str) -> np.ndarray:
    """The array `_encoded` wrote."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def group_advantages(rewards_R: np.ndarray, group: int, scale: bool) -> tuple:
    """(advantages (R,), each group's standard deviation): rewards less their group's mean.

    Rows come in groups of `group` answers to one prompt; with `scale`, each advantage is
    divided by its group's standard deviation (unbiased, as torch's, plus 1e-4).
    """
    grouped_PxG = rewards_R.reshape(-1, group)
    advantages_PxG = grouped_PxG - grouped_PxG.mean(axis=1, keepdims=True)
    spread_P = grouped_PxG.std(axis=1, ddof=1)
    if scale:
        advantages_PxG = advantages_PxG / (spread_P[:, None] + 1e-4)
    return advantages_PxG.reshape(-1).astype(np.float32), spread_P


def _reward_function(name: str):
    """The function a grpo.rewards entry names ("module:function")."""
    module_name, function_name = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UserError(f"grpo.rewards: cannot import {module_name} ({error})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"grpo.rewards: {module_name} has no function {function_name}")
    return function
