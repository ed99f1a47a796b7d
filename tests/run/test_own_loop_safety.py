"""A loop of one's own over `prepare` is as safe as fit: it evaluates whole eval sets as fit
does, saves once per step, leaves a run directory `load` reads, and refuses a state or batch
of another run in one line (it stops on SIGTERM after saving: tests/slow/run/). And a batch
whose labels the loss cannot take, at a later step, is named as the cause, not divergence."""

import json
import pathlib

import jax
import numpy as np
import optax
import pytest
from test_prepare import MLP, loss  # the model and loss of the fast prepare test

import paisoar_jax
from paisoar_jax.data.pipeline import stream_indices
from paisoar_jax.tools.doctor import command as doctor

REPO = pathlib.Path(__file__).resolve().parents[2]


def examples(count, seed):
    x = np.random.default_rng(seed).normal(size=(count, 8)).astype(np.float32)
    return {"x": x, "y": x[:, :4].argmax(-1).astype(np.int32)}


DATA, HELD_OUT = examples(256, 0), examples(72, 1)  # 72: a last eval batch of 8 real rows
SETTINGS = ["mesh.data=4", "mesh.fsdp=2", "train.global_batch=32", "train.steps=8",
            "train.log_every=4", "train.eval_every=8", "run.progress=false",
            "optim.lr=0.01"]  # fmt: skip


def test_prepare_evaluates_saves_once_refuses_other_runs_and_load_reads_its_directory(tmp_path):
    fit_dir, own_dir = tmp_path / "fit", tmp_path / "own"
    paisoar_jax.fit(None, [*SETTINGS, f"run.dir={fit_dir}"], model=MLP, loss=loss, data=DATA,
                    eval_data=HELD_OUT)  # fmt: skip
    fit_records = [json.loads(line) for line in (fit_dir / "metrics.jsonl").open()]
    prepared = paisoar_jax.prepare(None, [*SETTINGS, f"run.dir={own_dir}"], model=MLP,
                                   loss=loss, data=DATA, eval_data=HELD_OUT)  # fmt: skip
    state = prepared.state
    batches = prepared.batches()
    for step, batch in zip(range(1, 9), batches, strict=False):
        state, metrics = prepared.train_step(state, batch)
        if step % 4 == 0:
            evals = prepared.evaluate(state, step) if step == 8 else {}
            prepared.log(step, metrics | evals)
    # The whole held-out set, as fit evaluates it (its last batch's padding left out).
    assert evals["eval_loss"] == pytest.approx(fit_records[-1]["eval_loss"], rel=1e-6)
    sums = prepared.eval_step(state, batch)  # one batch, the documented form
    assert float(sums["rows"]) == 32 and np.isfinite(float(sums["loss"]))
    assert prepared.save(state) == 8
    assert prepared.save(state) == 8  # a step already saved is left as it is
    with pytest.raises(paisoar_jax.UserError, match=r"batch\['x'\] is float32\[16, 8\], where "
                       r"this run's global batch holds float32\[32, 8\]"):  # fmt: skip
        prepared.train_step(state, {"x": batch["x"][:16], "y": batch["y"][:16]})
    other = paisoar_jax.prepare(None, [*SETTINGS, f"run.dir={tmp_path / 'other'}"], model=MLP,
                                loss=loss, data=DATA, optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(paisoar_jax.UserError, match=r"the state's opt_state are not this run's "
                       r"\(\d+ arrays where the run has \d+\): a state of another model, "
                       r"optimizer"):  # fmt: skip
        prepared.train_step(other.state, batch)
    other.close()
    prepared.close()
    own_records = [json.loads(line) for line in (own_dir / "metrics.jsonl").open()]
    assert [record["step"] for record in own_records] == [4, 8]
    for own, fit in zip(own_records, fit_records, strict=True):
        assert own["loss"] == pytest.approx(fit["loss"], rel=1e-6)
        assert {"step_time_s", "examples_per_s", "data_wait_frac", "grad_norm"} <= set(own)
    status, stdout, _ = _doctor(own_dir)  # the doctor reads it as it reads fit's
    assert status == 0 and str(own_dir) in stdout, stdout
    model = paisoar_jax.load(own_dir, model=MLP)  # prepare's directory reads as fit's
    np.testing.assert_allclose(model(HELD_OUT["x"][:4]), prepared.model(state)(HELD_OUT["x"][:4]),
                               rtol=1e-6)  # fmt: skip


def test_a_label_out_of_range_at_a_later_step_names_its_batch_and_the_doctor_agrees(tmp_path):
    seed = 0
    # An example the global batch of step 3 holds (the order is a function of the seed).
    third = stream_indices(np.arange(64, 96), len(DATA["y"]), seed, shuffle=True)
    bad = int(third[5])
    labels = DATA["y"].copy()
    labels[bad] = 99  # 4 classes: the loss is nan for it, its gradient finite
    data = {"x": DATA["x"], "y": labels}
    with pytest.raises(paisoar_jax.UserError) as caught:
        paisoar_jax.fit(None, [*SETTINGS, "train.eval_every=0", f"train.seed={seed}",
                               f"run.dir={tmp_path}"], model=MLP, loss=loss, data=data)  # fmt: skip
    message = str(caught.value)
    assert "\n" not in message
    assert "the loss is nan at step 3, computed with the finite weights of step 2" in message
    assert "the batch of step 3 is the cause, not the learning rate" in message
    assert "; its examples: " in message and "(all in metrics.jsonl)" in message
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert records[-1]["bad_batch"] and bad in records[-1]["examples"]
    assert sorted(records[-1]["examples"]) == sorted(third.tolist())
    status, stdout, _ = _doctor(tmp_path)
    assert "bad-inputs" in stdout and "diverging" not in stdout, stdout
    assert "computed with the finite weights of step 2" in stdout


def _doctor(run_dir):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = doctor.main([str(run_dir)])
    return status, out.getvalue(), err.getvalue()


def test_the_state_check_sees_another_model(tmp_path):
    prepared = paisoar_jax.prepare(None, [*SETTINGS, f"run.dir={tmp_path}"], model=MLP,
                                   loss=loss, data=DATA)  # fmt: skip
    state = prepared.state
    wider = jax.tree.map(lambda x: x, state)
    params = dict(wider.params)
    params.pop(next(iter(params)))
    with pytest.raises(paisoar_jax.UserError, match="the state's params are not this run's"):
        prepared.train_step(wider.replace(params=params), next(prepared.batches()))
    prepared.close()
