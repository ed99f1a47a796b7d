"""Eval covers the whole eval set: the exact per-row mean, the last partial batch weighted
by its real rows; `train.eval_batches` caps it; ready batches are read for one pass; named
eval sets run on their own cadence."""

import re
import types

import jax
import numpy as np
import optax
import pytest
from conftest import FIT_BASE, run_records
from flax import nnx

import paisoar_jax
from paisoar_jax.engine.evaluation import EvalSet, check_metric_names, eval_batch_count


def examples(count, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 8)).astype(np.float32)
    return {"x": x, "y": (x[:, :4].argmax(-1)).astype(np.int32)}


class Net(nnx.Module):
    """BatchNorm (eval: running statistics) and a Dropout keyed by the loss's rng."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.norm(self.up(x)))))


def loss(model, batch, rng):
    logits = model(batch["x"]).astype(np.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def exact_means(model, data):
    """The mean loss and accuracy over every row, computed in one batch."""
    model.eval()
    logits = np.asarray(model(data["x"]), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    losses = -log_probs[np.arange(len(data["y"])), data["y"]]
    return losses.mean(), (logits.argmax(-1) == data["y"]).mean()


def fit(tmp_path, eval_data, *overrides):
    return paisoar_jax.fit(
        None,
        [
            *FIT_BASE,
            "train.global_batch=64",
            "train.steps=2",
            "train.eval_every=2",
            f"run.dir={tmp_path}/run",
            *overrides,
        ],
        model=Net,
        loss=loss,
        data=examples(256, seed=1),
        eval_data=eval_data,
        optimizer=optax.adam(1e-2),
    )


def test_eval_is_the_exact_mean_over_1000_rows_with_a_batch_of_64(tmp_path):
    """Before: eval scored train.eval_batches=4 batches, 256 of the 1,000 rows. Now 16
    batches, the last with 40 real rows (24 wrapped round to fill it and not counted)."""
    held_out = examples(1000, seed=2)
    result = fit(tmp_path, held_out, "mesh.data=8")
    loss_mean, accuracy = exact_means(result.model, held_out)
    np.testing.assert_allclose(result["eval_loss"], loss_mean, rtol=1e-5)
    np.testing.assert_allclose(result["eval_accuracy"], accuracy, rtol=1e-6)


def test_eval_batches_caps_an_eval_at_its_first_batches(tmp_path):
    held_out = examples(1000, seed=2)
    result = fit(tmp_path, held_out, "train.eval_batches=2")
    first_rows = {name: values[:128] for name, values in held_out.items()}
    np.testing.assert_allclose(result["eval_loss"], exact_means(result.model, first_rows)[0], 1e-5)


def test_ready_batches_are_evaluated_for_one_pass(tmp_path):
    held_out = examples(192, seed=3)
    batches = [
        {name: values[i : i + 64] for name, values in held_out.items()} for i in (0, 64, 128)
    ]
    result = fit(tmp_path, batches)
    np.testing.assert_allclose(result["eval_loss"], exact_means(result.model, held_out)[0], 1e-5)


@pytest.mark.parametrize(
    ("size", "batch", "cap", "count"),
    [(1000, 64, 0, 16), (1024, 64, 0, 16), (10, 64, 0, 1), (1000, 64, 4, 4), (100, 64, 4, 2)],
)
def test_eval_batch_count(size, batch, cap, count):
    assert eval_batch_count(size, batch, cap) == count


def test_named_eval_sets_run_on_their_own_cadence_with_the_default_ones_numbers(tmp_path):
    """fit's eval_sets: each set's metrics are those the same data gives as eval_data, at its
    own steps (and the last); the default set keeps eval_loss at train.eval_every's."""
    held_out, other = examples(200, seed=2), examples(120, seed=4)
    overrides = ["train.steps=4", "train.eval_every=3"]
    named = {"other": paisoar_jax.Eval(other, every=2), "same": held_out}
    result = paisoar_jax.fit(
        None,
        [*FIT_BASE, "train.global_batch=64", f"run.dir={tmp_path}/named", *overrides],
        model=Net,
        loss=loss,
        data=examples(256, seed=1),
        eval_data=held_out,
        eval_sets=named,
        optimizer=optax.adam(1e-2),
    )
    records = {record["step"]: record for record in run_records(tmp_path / "named")}
    assert "eval_other_loss" in records[2] and "eval_loss" not in records[2]
    assert "eval_loss" in records[3] and "eval_same_loss" in records[3]  # train.eval_every's
    assert "eval_other_loss" not in records[3]
    assert {"eval_loss", "eval_other_loss", "eval_same_loss"} <= set(records[4])  # the last
    np.testing.assert_allclose(result["eval_same_loss"], result["eval_loss"], rtol=1e-6)
    loss_mean, accuracy = exact_means(result.model, other)
    np.testing.assert_allclose(result["eval_other_loss"], loss_mean, rtol=1e-5)
    np.testing.assert_allclose(result["eval_other_accuracy"], accuracy, rtol=1e-6)


@pytest.mark.parametrize(
    ("eval_sets", "eval_every", "message"),
    [
        ({"a b": examples(64)}, 2, "eval_sets['a b']: a name is made of letters"),
        ({"x": paisoar_jax.Eval(examples(64), every=-1)}, 2, "every is the steps between"),
        ({"x": "data/valid"}, 2, "eval_sets['x'] must be a grain dataset"),
        ([examples(64)], 2, "eval_sets is a dict of name: data"),
        ({"x": examples(64)}, 0, "and train.eval_every=0: give it Eval(data, every=STEPS)"),
    ],
)
def test_bad_eval_sets_are_one_line(tmp_path, eval_sets, eval_every, message):
    with pytest.raises(paisoar_jax.UserError, match=re.escape(message)):
        paisoar_jax.fit(
            None,
            [*FIT_BASE, f"train.eval_every={eval_every}", f"run.dir={tmp_path}/run"],
            model=Net,
            loss=loss,
            data=examples(64),
            eval_sets=eval_sets,
        )


def test_eval_sets_whose_metrics_share_a_name_are_refused_before_the_first_step(tmp_path):
    """The default set's metric x_loss and set x's loss would both be eval_x_loss."""

    def with_x_loss(model, batch, rng):
        value, metrics = loss(model, batch, rng)
        return value, {**metrics, "x_loss": value}

    with pytest.raises(paisoar_jax.UserError, match="the default eval set and x would both"):
        paisoar_jax.fit(
            None,
            [*FIT_BASE, "train.eval_every=2", f"run.dir={tmp_path}/run"],
            model=Net,
            loss=with_x_loss,
            data=examples(64),
            eval_data=examples(64),
            eval_sets={"x": examples(64, seed=1)},
        )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_two_named_sets_whose_metrics_share_a_name_are_refused():
    """Set a's metric b_loss and set a_b's loss: both eval_a_b_loss."""
    task = types.SimpleNamespace(metric_names=("b_loss",), reports_perplexity=False)
    sets = (EvalSet(None, 2, "a"), EvalSet(None, 2, "a_b"))
    with pytest.raises(paisoar_jax.UserError, match="eval sets a and a_b would both report"):
        check_metric_names(sets, task)
    check_metric_names((EvalSet(None, 2, "a"), EvalSet(None, 2, "c")), task)  # apart: fine
