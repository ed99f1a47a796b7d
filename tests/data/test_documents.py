"""Supervised fine-tuning windows (data/documents.py): packing, masks, and losses that equal
a hand-computed mean and the documents run one by one, on any mesh and accumulation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIT_BASE, TINY, build_run, run_records, task_for
from flax import nnx

import paisoar_jax
from paisoar_jax.config import load_config
from paisoar_jax.data.documents import plan_windows
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.parallel import sharding
from paisoar_jax.tasks.zoo import build_model
from paisoar_jax.tools import convert


def convert_instructions(directory, pairs):
    """A byte-level instruction dataset of (prompt, response) pairs in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": prompt, "response": response}) for prompt, response in pairs]
    (directory / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    arguments = ["text", "--input", str(directory / "pairs.jsonl"), "--no-progress"]
    arguments += ["--output", str(directory / "data"), "--format", "instruction"]
    assert convert.main(arguments) == 0
    return directory / "data"


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    """300 random question-and-answer pairs of 5 to 60 bytes, converted byte-level."""
    rng = np.random.default_rng(0)
    words = ["add", "two", "and", "three", "what", "is", "five", "six", "seven"]
    pairs = [
        (
            "Q: " + " ".join(rng.choice(words, rng.integers(1, 8))) + "\nA: ",
            " ".join(rng.choice(words, rng.integers(1, 6))),
        )
        for _ in range(300)
    ]
    return convert_instructions(tmp_path_factory.mktemp("sft"), pairs)


def test_documents_are_packed_in_order_and_a_long_one_takes_a_window_alone():
    assert plan_windows(np.array([3, 4, 2, 9, 1]), 8, False).tolist() == [0, 2, 3, 4, 5]
    assert plan_windows(np.array([3, 4, 2]), 8, True).tolist() == [0, 1, 2, 3]


def test_windows_mark_documents_positions_and_learned_targets(tmp_path):
    data = convert_instructions(tmp_path, [("ab", "c"), ("d", "ef")])
    tokens = [ord(c) for c in "abc"] + [0] + [ord(c) for c in "def"] + [0]
    packed, no_eval = paisoar_jax.token_windows(data, 8, eval_fraction=0)
    assert no_eval is None and len(packed) == 1
    window = packed[0]
    assert window["tokens"].tolist() == [*tokens, 0]  # the last slot is padding
    assert window["segments"].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert window["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # Target t is learned when it is a response's (c, eos; e, f, eos) within t's document.
    learned = [False, True, True, False, True, True, True, False]
    assert window["loss_mask"].tolist() == learned
    everything, _ = paisoar_jax.token_windows(data, 8, loss_on="all", eval_fraction=0)
    assert everything[0]["loss_mask"].tolist() == [True, True, True, False, *learned[4:]]
    padded, _ = paisoar_jax.token_windows(data, 8, packing="padding", eval_fraction=0)
    assert len(padded) == 2 and set(padded[0]) == {"tokens", "loss_mask"}
    assert padded[1]["tokens"].tolist() == [*tokens[4:], 0, 0, 0, 0, 0]
    assert padded[1]["loss_mask"].tolist() == [True, True, True, False, False, False, False, False]
    # Stream windows cut across documents: window 0 is tokens 0..4, its targets b c eos d.
    stream, _ = paisoar_jax.token_windows(data, 4, packing="stream", eval_fraction=0)
    assert len(stream) == 1 and stream[0]["tokens"].tolist() == tokens[:5]
    assert stream[0]["loss_mask"].tolist() == [False, True, True, False]


def make_model(overrides):
    config = load_config(None, ["model.layers=2", "model.width=32", "model.heads=4", *overrides])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy("fp32"), config.remat.policy, nnx.Rngs(0))
    return config, model


def first_windows(data, seq_len, count, **settings):
    windows, _ = paisoar_jax.token_windows(data, seq_len, eval_fraction=0, **settings)
    examples = [windows[index] for index in range(count)]
    return {name: jnp.asarray(np.stack([e[name] for e in examples])) for name in examples[0]}


def test_the_masked_loss_is_the_mean_over_response_tokens(instructions):
    config, model = make_model(["model.seq_len=64"])
    task = task_for(load_config(None, ["data.packing=documents", "data.loss_on=response"]))
    batch = first_windows(instructions, 64, 4)
    loss, _ = task.loss(model, batch, jax.random.PRNGKey(0))
    logits = np.asarray(
        model(batch["tokens"][:, :-1], batch["segments"], batch["positions"]), np.float64
    )
    log_probabilities = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = np.asarray(batch["tokens"][:, 1:])
    picked = np.take_along_axis(log_probabilities, targets[..., None], axis=-1)[..., 0]
    learned = np.asarray(batch["loss_mask"])
    assert 0 < learned.sum() < learned.size / 2  # prompts and padding are most of it
    assert float(loss) == pytest.approx(-picked[learned].mean(), rel=1e-5)
    # Eval weighs each row by its learned targets: the same mean per token.
    rows = task.eval_rows(model, batch)
    weighted = float((rows["loss"] * rows["weight"]).sum() / rows["weight"].sum())
    assert weighted == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.checks("sft", families=["zoo:gpt", "zoo:llama"])
@pytest.mark.parametrize(
    "overrides",
    [
        ["model.name=gpt"],
        ["model.name=gpt", "model.position=rotary"],
        ["model.name=llama", "model.kv_heads=2"],
        pytest.param(["model.name=gpt", "model.scan_layers=false"], marks=pytest.mark.slow),
    ],
    ids=["gpt", "gpt-rotary", "llama-gqa", "gpt-unscanned"],
)
def test_packed_documents_give_the_losses_of_each_document_alone(instructions, overrides):
    """Attention stays within each document and positions restart: every target's loss in
    a packed window equals the loss of its document run alone."""
    _, model = make_model(["model.seq_len=128", *overrides])
    batch = first_windows(instructions, 128, 2)
    logits = model(batch["tokens"][:, :-1], batch["segments"], batch["positions"])
    packed = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    # Each document alone at the start of its own row (padding after it changes nothing
    # before it in a causal model): one call for all of them.
    spans = []
    for row in range(2):
        segments = np.asarray(batch["segments"][row])
        for segment in sorted(set(segments.tolist()) - {0}):
            where = np.flatnonzero(segments == segment)
            spans.append((row, where[0], where[-1]))  # its tokens: first..last (its eos)
    alone = np.zeros((len(spans), 129), np.int32)
    for index, (row, first, last) in enumerate(spans):
        alone[index, : last + 1 - first] = batch["tokens"][row, first : last + 1]
    losses = optax.softmax_cross_entropy_with_integer_labels(
        model(jnp.asarray(alone[:, :-1])), alone[:, 1:]
    )
    for index, (row, first, last) in enumerate(spans):
        np.testing.assert_allclose(
            packed[row, first:last], losses[index, : last - first], rtol=2e-5, atol=2e-6
        )
    assert len(spans) >= 4


def one_masked_step(overrides, devices, batch, data):
    settings = [f"data.source=arrayrecord:{data}", "data.packing=documents"]
    settings += ["data.loss_on=response", "optim.name=sgd", "optim.momentum=0"]
    settings += ["optim.weight_decay=0", "optim.warmup_steps=0", "optim.clip_norm=0"]
    _, mesh, _, state, train_step = build_run([*settings, *overrides], devices, TINY)
    with jax.set_mesh(mesh):
        state, metrics = train_step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    return jax.device_get(metrics), jax.device_get(state.params)


@pytest.mark.checks("sft", "sharded", families=["zoo:gpt"])
@pytest.mark.parametrize(
    "overrides, count",
    [
        (["train.grad_accum=4"], 1),
        pytest.param(
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum=2"],
            8,
            marks=pytest.mark.slow,
        ),
        (["mesh.data=4", "mesh.grad_comm=bf16"], 4),
    ],
    ids=["accumulation", "data-fsdp-tensor", "compressed-exchange"],
)
def test_masked_steps_match_one_device_over_the_whole_batch(
    instructions, devices, overrides, count
):
    """Micro-batches and data shards hold different numbers of learned targets: each
    one's loss is weighed by its share, so the step is the whole batch's mean."""
    batch = {name: np.asarray(v) for name, v in first_windows(instructions, 32, 16).items()}
    learned = batch["loss_mask"].reshape(4, 4, -1).sum(axis=(0, 2))  # per micro-batch
    assert len(set(learned.tolist())) > 1
    reference, expected = one_masked_step([], devices[:1], batch, instructions)
    metrics, params = one_masked_step(overrides, devices[:count], batch, instructions)
    assert float(metrics["loss"]) == pytest.approx(float(reference["loss"]), rel=1e-5)
    if "mesh.grad_comm=bf16" not in overrides:  # bf16 gradients: the loss is the check
        assert float(metrics["grad_norm"]) == pytest.approx(float(reference["grad_norm"]), 1e-4)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, expected
        )


@pytest.mark.parametrize(
    "settings, message",
    [
        (["data.loss_on=response"], "marks no response tokens"),
        (["data.source=embedded", "data.packing=documents"], "has none"),
        (["data.source=synthetic", "data.loss_on=response"], "has none"),
    ],
)
def test_settings_the_data_cannot_meet_are_refused(token_dataset, settings, message):
    from paisoar_jax.data.sources import open_source

    config = load_config(None, [f"data.source=arrayrecord:{token_dataset}", *settings])
    with pytest.raises(UserError, match=message):
        open_source(config.data, config.model, 0)


def test_a_dataset_without_a_document_index_is_refused(tmp_path):
    data = convert_instructions(tmp_path, [("ab", "c"), ("d", "ef")] * 10)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["document_index"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="no document index .* convert the text again"):
        paisoar_jax.token_windows(data, 8)


class Bigram(nnx.Module):
    """A model of one's own: next-token logits from the current token alone."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(jnp.zeros((256, 256)))

    def __call__(self, tokens_BxT):
        return self.table[...][tokens_BxT]


def masked_loss(model, batch, rng):
    """The mean cross-entropy over the learned targets, and how many there were."""
    logits = model(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    learned = batch["loss_mask"]
    mean = (losses * learned).sum() / jnp.maximum(learned.sum(), 1)
    return mean, {"learned": learned.sum().astype(jnp.float32)}


def test_a_model_of_ones_own_trains_on_the_same_windows_through_fit(instructions, tmp_path):
    train, held_out = paisoar_jax.token_windows(instructions, 32)
    assert set(train[0]) == {"tokens", "loss_mask", "segments", "positions"}
    settings = [*FIT_BASE, "train.steps=6", "optim.lr=0.5", "train.eval_every=6"]
    result = paisoar_jax.fit(
        None,
        [*settings, f"run.dir={tmp_path / 'run'}"],
        model=Bigram,
        loss=masked_loss,
        optimizer=optax.sgd(0.5),
        data=train,
        eval_data=held_out,
    )
    records = run_records(tmp_path / "run")
    assert 0 < records[0]["learned"] < 16 * 32  # the prompts and padding are not learned
    assert result["final_loss"] < records[0]["loss"] and result["eval_loss"] < np.log(256)
