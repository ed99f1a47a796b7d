"""What `fit` hands back and `paisoar_jax.load` reads: the trained module, for inference.

Also what a script meets around it: the loss's rng, a module instance as the start, Ctrl-C.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import FIT_BASE
from flax import nnx

import paisoar_jax
from paisoar_jax.errors import UserError

BASE = FIT_BASE  # a model of one's own through fit: log each step, no eval


def examples(count=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 16)).astype(np.float32)
    return {"x": x, "y": (np.abs(x[:, :3]).argmax(-1) + 3 * (x[:, 3] > 0)).astype(np.int32)}


class RandomNet(nnx.Module):
    """BatchNorm and a Dropout keyed by the loss's rng, as a Keras user writes them."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.2)
        self.down = nnx.Linear(64, 6, rngs=rngs)

    def __call__(self, x, rng=None):
        x = jax.nn.relu(self.norm(self.up(x)))
        return self.down(self.drop(x, rngs=rng) if rng is not None else x)


def random_loss(model, batch, rng):
    """The loss's rng is a real key: a Dropout takes it, jax.random draws from it."""
    dropout_key, noise_key = jax.random.split(rng)
    x = batch["x"] + 0.01 * jax.random.normal(noise_key, batch["x"].shape, batch["x"].dtype)
    logits = model(x, dropout_key).astype(jax.numpy.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def test_the_loss_rng_is_a_real_key_and_fit_hands_back_the_trained_model(tmp_path):
    """Before: the check before training passed a ShapeDtypeStruct as the key (a 40-line
    traceback in nnx.Dropout or jax.random), and fit returned only the summary."""
    overrides = [*BASE, "train.steps=6", "mesh.data=4", "mesh.fsdp=2", "precision.policy=bf16"]
    overrides += [f"run.dir={tmp_path}/run", "checkpoint.every=3"]
    result = paisoar_jax.fit(
        None,
        overrides,
        model=RandomNet,
        loss=random_loss,
        data=examples(),
        optimizer=optax.adam(1e-2),
    )
    assert isinstance(result, paisoar_jax.FitResult) and result["steps"] == 6
    model = result.model
    assert isinstance(model, RandomNet)
    x = examples(32, seed=5)["x"]
    model.eval()
    predicted = np.asarray(model(x))
    # The same from disk: the run directory's newest checkpoint, as the factory builds it.
    loaded = paisoar_jax.load(tmp_path / "run", model=RandomNet)
    loaded.eval()
    np.testing.assert_array_equal(np.asarray(loaded(x)), predicted)
    assert loaded.up.kernel[...].dtype == np.float32  # the fp32 master weights
    # The weights are the trained ones: the checkpoint's, not a fresh init.
    fresh = RandomNet(nnx.Rngs(0))
    assert not np.allclose(np.asarray(fresh.up.kernel[...]), np.asarray(model.up.kernel[...]))
    assert np.abs(np.asarray(model.norm.mean[...])).max() > 0  # BatchNorm's running mean moved
    step_dir = tmp_path / "run" / "checkpoints" / "3"
    earlier = paisoar_jax.load(step_dir, model=RandomNet)
    assert not np.array_equal(np.asarray(earlier.up.kernel[...]), np.asarray(model.up.kernel[...]))


def test_load_of_a_directory_without_weights_is_one_line(tmp_path, capsys):
    with pytest.raises(UserError) as refused:
        paisoar_jax.load(tmp_path, model=RandomNet)
    # The same finding as hf-export's and generate's (weights.weights_source).
    assert f"{tmp_path} is not a run directory (no config.yaml)" in str(refused.value)


def test_a_model_instance_is_its_own_start(tmp_path):
    """Before: an instance instead of a factory was called with an nnx.Rngs (95 lines)."""
    instance = RandomNet(nnx.Rngs(7))
    before = np.asarray(instance.down.kernel[...]).copy()
    overrides = [*BASE, "train.steps=1", f"run.dir={tmp_path}"]
    parts = {"loss": random_loss, "data": examples(), "optimizer": optax.sgd(0.0)}
    result = paisoar_jax.fit(None, overrides, model=instance, **parts)
    # lr 0: the trained model is the instance's weights, and the instance was left as it was.
    np.testing.assert_array_equal(np.asarray(result.model.down.kernel[...]), before)
    np.testing.assert_array_equal(np.asarray(instance.down.kernel[...]), before)
    assert result.model is not instance


CTRL_C_SCRIPT = """
import sys, numpy as np, optax, jax
from flax import nnx
import paisoar_jax

model = lambda rngs: nnx.Linear(4, 2, rngs=rngs)
def loss(model, batch, rng):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

data = {"x": np.ones((64, 4), np.float32), "y": np.zeros(64, np.int32)}
overrides = ["train.steps=100000", "train.global_batch=8", "run.progress=false",
             "run.tensorboard=false", "checkpoint.every=0", "train.eval_every=0"]
for name in ("first", "second"):
    print("starting", name, flush=True)
    paisoar_jax.fit(None, [*overrides, "run.dir=" + name], model=model, loss=loss, data=data)
"""


def test_ctrl_c_saves_and_stops_the_script(tmp_path):
    """Before: Ctrl-C returned from fit as if it had finished, so the next fit started and
    a second Ctrl-C was needed, and the script exited 0."""
    import signal
    import subprocess
    import time

    from conftest import PYTHON, subprocess_env

    (tmp_path / "script.py").write_text(CTRL_C_SCRIPT)
    process = subprocess.Popen(
        [PYTHON, "script.py"], cwd=tmp_path, env=subprocess_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    metrics = tmp_path / "first" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode != 0, stdout
    assert "KeyboardInterrupt: fit stopped by Ctrl-C at step" in stderr
    assert "stopped by SIGINT after step" in stdout and "starting second" not in stdout
    assert [step.name for step in (tmp_path / "first" / "checkpoints").iterdir()]  # it saved
