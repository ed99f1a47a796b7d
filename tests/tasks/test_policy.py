"""GRPO (tasks/policy.py): its loss against a reference written here, its advantages, a
resumed run, and bad settings.

The recipe that learns a verifiable task (examples/grpo_copy.py) runs in the slow tier.
"""

import dataclasses
import json
import sys

import jax
import numpy as np
import pytest
from conftest import TINY, run_records, train
from flax import nnx

import paisoar_jax
from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.policy import group_advantages
from paisoar_jax.tasks.zoo import zoo_workload


def copies_the_letter(prompts, completions, letter, **unused):
    """The recipe's reward: the share of the answer's characters that are the letter."""
    return [
        sum(c == want for c in text) / max(len(text), 1)
        for text, want in zip(completions, letter, strict=True)
    ]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    records = [{"prompt": f"{letter * 4}=", "letter": letter} for letter in "abcd" * 4]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def grpo_settings(prompts, *extra):
    module = sys.modules[__name__].__name__
    return [
        *TINY,
        "train.objective=grpo",
        f"data.source={prompts}",
        f"grpo.rewards=[{module}:copies_the_letter]",
        "grpo.generations=4",
        "grpo.max_new=6",
        "train.global_batch=32",
        "train.log_every=1",
        "optim.lr=3e-3",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        *extra,
    ]


@pytest.mark.parametrize(
    "loss_type, drawn", [("dapo", "now"), ("grpo", "now"), ("dr_grpo", "now"), ("dapo", "before")]
)
def test_the_loss_equals_a_reference_written_here(prompts, loss_type, drawn):
    """A fixed batch of answers, advantages and reference log-probs, beta = 0.1.

    drawn="before": the answers were drawn by an earlier policy (grpo.iterations > 1), whose
    log-probs the batch holds: the ratio is not 1 and the clip holds it.
    """
    config = load_config(None, grpo_settings(prompts, f"grpo.loss_type={loss_type}"))
    run = setup(config, zoo_workload(config), jax.devices()[:1])
    # (a run's beta > 0 reads checkpoint.init_from's reference; here the batch holds it)
    run.task.settings = dataclasses.replace(run.task.settings, beta=0.1)
    model = nnx.merge(
        run.layout.graphdef, *nnx.split(run.layout.create_model(), nnx.Param, ...)[1:]
    )
    rng = np.random.default_rng(0)
    B, T = 6, 32
    tokens = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
    learned = np.zeros((B, T), bool)
    for row, (start, length) in enumerate(
        zip(rng.integers(2, 8, B), rng.integers(1, 7, B), strict=True)
    ):
        learned[row, start : start + length] = True
    batch = {
        "tokens": tokens,
        "loss_mask": learned,
        "advantages": rng.normal(size=B).astype(np.float32),
        "reference": -rng.uniform(4, 7, (B, T)).astype(np.float32),
        "figures": np.zeros((B, len(run.task.figure_names)), np.float32),
    }
    logits = np.asarray(model(tokens[:, :-1]), np.float64)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    taken = np.take_along_axis(log_probs, tokens[:, 1:, None], -1)[..., 0]
    ratio = np.ones((B, T))  # drawn by the policy learning now
    if drawn == "before":
        batch["old"] = (taken + rng.uniform(-0.4, 0.4, (B, T))).astype(np.float32)
        ratio = np.exp(taken - batch["old"])
    loss, metrics = run.task.loss(model, batch, jax.random.key(0))
    delta = batch["reference"] - taken
    kl = np.exp(delta) - delta - 1
    advantages = batch["advantages"][:, None]
    clipped = np.clip(ratio, 0.8, 1.2)
    per_token = -np.minimum(ratio * advantages, clipped * advantages) + 0.1 * kl
    if loss_type == "dapo":
        expected = (per_token * learned).sum() / learned.sum()
    elif loss_type == "grpo":
        expected = ((per_token * learned).sum(1) / learned.sum(1)).mean()
    else:
        expected = (per_token * learned).sum() / (B * 6)
    assert float(loss) == pytest.approx(expected, rel=1e-4)
    assert float(metrics["kl"]) == pytest.approx((kl * learned).sum() / learned.sum(), rel=1e-4)
    clip_share = ((ratio != clipped) * learned).sum() / learned.sum()
    assert float(metrics["clip_ratio/region_mean"]) == pytest.approx(clip_share, abs=1e-6)
    assert (clip_share > 0.2) == (drawn == "before")


def test_advantages_are_rewards_less_their_groups_mean_over_its_spread():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    advantages, spread = group_advantages(rewards, 4, scale=True)
    first = rewards[:4] - rewards[:4].mean()
    assert np.allclose(advantages[:4], first / (np.std(rewards[:4], ddof=1) + 1e-4))
    assert np.all(advantages[4:] == 0) and spread[1] == 0
    unscaled, _ = group_advantages(rewards, 4, scale=False)
    assert np.allclose(unscaled[:4], first)


def test_a_resumed_run_draws_and_learns_as_the_uninterrupted_one(prompts, tmp_path):
    """Answers are drawn with a key of (seed, step), each learned from for 2 steps
    (grpo.iterations=2): cut at step 3, between a generation's two steps, the run goes on
    with the rows its checkpoint held and learns as the uninterrupted one."""
    settings = grpo_settings(prompts, "grpo.iterations=2", "checkpoint.every=3")
    whole = train(load_config(None, [*settings, "train.steps=4", f"run.dir={tmp_path / 'a'}"]))
    train(load_config(None, [*settings, "train.steps=3", f"run.dir={tmp_path / 'b'}"]))
    train(load_config(None, [*settings, "train.steps=4", f"run.dir={tmp_path / 'b'}"]))
    names = ("loss", "reward", "reward_std", "rewards/copies_the_letter/mean", "kl")
    names += ("clip_ratio/region_mean",)
    uncut, cut = run_records(tmp_path / "a"), run_records(tmp_path / "b")
    assert [[r[n] for n in names] for r in cut] == [[r[n] for n in names] for r in uncut]
    assert whole["steps"] == 4 and all(0 <= r["reward"] <= 1 for r in uncut)
    assert all(r["completions/mean_length"] == 6 for r in uncut)
    # steps 1 and 3 draw; 2 and 4 learn from the same answers again, moved by one update
    assert [r["generation_s"] > 0 for r in uncut] == [True, False, True, False]
    assert uncut[0]["reward"] == uncut[1]["reward"] and uncut[2]["reward"] == uncut[3]["reward"]
    assert uncut[1]["loss"] != uncut[0]["loss"]
    held = json.loads((tmp_path / "b/checkpoints/3/meta/metadata").read_text())["held_rows"]
    assert held["step"] == 3 and set(held["rows"]) >= {"tokens", "advantages", "old"}
    last = json.loads((tmp_path / "a/checkpoints/4/meta/metadata").read_text())
    assert last["held_rows"] is None  # step 5 would draw
    assert last["data_position"]["examples"] == 16  # prompts read at steps 1 and 3: 2 x 8
    # a GRPO run generates as any run, on devices its groups do not divide
    generator = paisoar_jax.Generator(tmp_path / "a", devices=jax.devices()[:1])
    [answer] = generator.generate([[97, 97, 97, 97, 61]], max_new=3)
    assert len(answer) == 3
    [(log_probs, _)] = generator.score([list(range(33))])  # all 32 learned positions
    assert log_probs.shape == (32,) and np.all(log_probs < 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.rewards=[]"], "train.objective=grpo needs grpo.rewards"),
        (["train.global_batch=18"], "counts answers: a multiple of grpo.generations=4"),
        (["train.global_batch=16"], "4 prompts a step do not split over the 8 batch shards"),
        (["grpo.rewards=[no_such_module:f]"], "grpo.rewards: cannot import no_such_module"),
        (["grpo.generations=1"], "grpo.generations must be at least 2"),
        (["grpo.beta=0.1"], "grpo.beta > 0 compares with the reference weights"),
        (["train.harness_every=2", "train.harness_tasks=[x]"], "it reads no eval sets"),
        (["mesh.context=2", "mesh.data=4"], "mesh.stage and mesh.context must be 1"),
        (["grpo.max_new=40"], "leaves no room for a prompt"),
        (["grpo.iterations=0"], "grpo.iterations must be at least 1"),
    ],
)
def test_bad_settings_are_one_line(prompts, tmp_path, overrides, message):
    zoo_workload(load_config(None, grpo_settings(prompts, "grpo.rewards=[no_such_module:f]")))
    # (the rewards are imported for training alone: generating from a run needs none)
    with pytest.raises(UserError, match=message):
        train(load_config(None, [*grpo_settings(prompts, *overrides), f"run.dir={tmp_path}"]))


def short_answers(prompts, completions, **unused):
    """A reward for brevity (the imported model's tokenizer speaks words)."""
    return [1.0 / (1 + len(text)) for text in completions]


def test_an_import_trains_with_a_kl_penalty_to_its_own_weights(tmp_path):
    """grpo.beta > 0: the reference is checkpoint.init_from's; KL is 0 at the first step."""
    from conftest import tiny_llama_import

    tiny_llama_import(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the cat {w}"}) + "\n" for w in "ab" * 8))
    module = sys.modules[__name__].__name__
    result = paisoar_jax.fit(
        str(tmp_path / "imported" / "config.yaml"),
        [
            "train.objective=grpo",
            f"data.source={prompts}",
            f"grpo.rewards=[{module}:short_answers]",
            "grpo.generations=4",
            "grpo.max_new=4",
            "grpo.beta=0.1",
            "train.global_batch=32",
            "train.steps=2",
            "train.log_every=1",
            "model.seq_len=24",
            "optim.lr=1e-2",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    first, second = run_records(tmp_path / "run")
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 0
    assert result.steps == 2
