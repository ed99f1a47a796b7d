"""A model of one's own with a newcomer's mistake: one line naming it, and the doctor agrees.

A factory of the wrong shape, labels that make the loss nan before any update, and a model
whose output carries no gradient (cast to an integer).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import paisoar_jax
from paisoar_jax.errors import UserError
from paisoar_jax.tools.doctor.command import diagnose, load_run


class Classifier(nnx.Module):
    def __init__(self, rngs, integer_output=False):
        self.layer = nnx.Linear(4, 3, rngs=rngs)
        self.integer_output = integer_output

    def __call__(self, x_Bx4):
        logits_Bx3 = self.layer(x_Bx4)
        return logits_Bx3.astype(jnp.int32) if self.integer_output else logits_Bx3


def loss(model, batch, rng):
    logits = model(batch[0]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean(), {}


X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int32)


def fit(tmp_path, model, labels=LABELS):
    overrides = ["train.steps=2", "train.global_batch=16", "train.eval_every=0",
                 "run.progress=false", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    return paisoar_jax.fit(None, overrides, model=model, loss=loss, data=(X, labels))


@pytest.mark.parametrize(
    "model, said",
    [
        (nnx.Linear, "model=Linear cannot be called as model(rngs) (missing a required argument"),
        (lambda: Classifier(nnx.Rngs(0)), "model=<lambda> cannot be called as model(rngs) (too"),
        (lambda rngs: None, "model=<lambda> returned None, not an nnx.Module"),
        (lambda rngs: Classifier, "model=<lambda> returned the class Classifier (not an inst"),
    ],
    ids=["a class needing arguments", "no rngs", "returns None", "returns the class"],
)
def test_a_factory_of_the_wrong_shape_is_one_line(tmp_path, model, said):
    with pytest.raises(UserError) as refused:
        fit(tmp_path, model)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_a_factory_taking_rngs_as_a_keyword_only_is_called_so(tmp_path):
    def build(*, rngs):
        return Classifier(rngs)

    assert fit(tmp_path, build)["steps"] == 2


def test_a_loss_not_finite_before_any_update_blames_the_labels_and_the_doctor_agrees(tmp_path):
    with pytest.raises(UserError) as refused:
        fit(tmp_path, Classifier, labels=np.full(64, 7, np.int32))  # 3 classes
    assert str(refused.value).startswith(
        "the loss is nan at step 1, before any update: the inputs or labels are the likely "
        "cause, not the learning rate"
    )
    findings = diagnose(load_run(tmp_path / "run"))
    assert [finding.name for finding in findings] == ["bad-inputs"]
    assert findings[0].fixes[0].startswith("check the labels")


def test_an_integer_output_that_trains_nothing_is_said_and_found(tmp_path, capsys):
    fit(tmp_path, lambda rngs: Classifier(rngs, integer_output=True))
    warned = [line for line in capsys.readouterr().err.splitlines() if "gradient" in line]
    assert warned == [
        "paisoar_jax: warning: the gradient is exactly 0 at step 1: no parameter receives one, "
        "so nothing trains (a model output cast to an integer dtype, jax.lax.stop_gradient, or "
        "a loss that does not use the model's output)"
    ]
    findings = diagnose(load_run(tmp_path / "run"))
    assert "no-gradient" in [finding.name for finding in findings]
