"""The public face typed for users' tools: mypy reads paisoar_jax as an installed package
(py.typed), sees fit's and prepare's keywords, and flags a misspelt one; at run time the same
keyword is one line."""

import os
import pathlib
import subprocess
import sys

import pytest

import paisoar_jax

REPO = pathlib.Path(__file__).resolve().parents[2]

USER_SCRIPT = """
import optax
from flax import nnx

import paisoar_jax


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.out = nnx.Linear(8, 4, rngs=rngs)


reveal_type(paisoar_jax.fit)
reveal_type(paisoar_jax.prepare)
result = paisoar_jax.fit(None, ["train.steps=1"], model=MLP, optimiser=optax.adam(1e-3))
prepared = paisoar_jax.prepare(None, model=MLP, data=None, eval_every=3)
reveal_type(prepared.train_step)
reveal_type(result.model)
"""

# Only paisoar_jax is analysed (jax, flax and optax are read as Any): seconds, not minutes.
MYPY_CONFIG = """
[mypy]
follow_imports = skip
ignore_missing_imports = True
[mypy-paisoar_jax,paisoar_jax.*]
follow_imports = silent
"""


def test_mypy_sees_fits_and_prepares_keywords_and_flags_a_misspelt_one(tmp_path):
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    # On the search path as an installed package is: mypy reads it only through py.typed.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "user_script.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert not [line for line in lines if "py.typed" in line], lines
    fit_type = next(line for line in lines if ":13: note: Revealed type" in line)
    prepare_type = next(line for line in lines if ":14: note: Revealed type" in line)
    for keyword in ("model", "loss", "optimizer", "data", "eval_data", "eval_sets"):
        assert f"'{keyword}'?" in fit_type and f"'{keyword}'?" in prepare_type, keyword
    assert "-> paisoar_jax.run.result.FitResult" in fit_type
    assert "-> paisoar_jax.run.prepared.Prepared" in prepare_type
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 2, lines
    assert ':15: error: Unexpected keyword argument "optimiser" for "fit"' in errors[0]
    assert 'did you mean "optimizer"' in errors[0]
    assert ':16: error: Unexpected keyword argument "eval_every" for "prepare"' in errors[1]
    train_step = next(line for line in lines if ":17: note: Revealed type" in line)
    assert "def (state: paisoar_jax.engine.state.TrainState, batch: Any)" in train_step


def test_the_package_ships_its_types_and_names_every_public_name():
    assert (REPO / "paisoar_jax" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"paisoar_jax" = ["py.typed"]' in pyproject  # in the wheel too
    assert set(paisoar_jax.__all__) == set(paisoar_jax._EXPORTS) | {"__version__"}


def test_a_misspelt_keyword_is_one_line_at_run_time():
    with pytest.raises(paisoar_jax.UserError, match=r"fit\(\) got an unexpected keyword "
                       r"optimiser=; did you mean optimizer=\?"):  # fmt: skip
        paisoar_jax.fit(None, ["train.steps=1"], optimiser=None)
    with pytest.raises(paisoar_jax.UserError, match=r"plan_fit\(\) takes no eval_data=: fit "):
        paisoar_jax.plan_fit(None, eval_data=[1])
    with pytest.raises(paisoar_jax.UserError, match=r"bench_fit\(\) .* batches=; it takes model"):
        paisoar_jax.bench_fit(None, batches=[1])


def test_an_uncaught_error_of_any_public_function_is_one_line_and_status_2(tmp_path):
    """Not only fit's and prepare's: token_windows, load_config, Generator, Prepared."""
    script = tmp_path / "mine.py"
    for call, expected in (
        ("paisoar_jax.token_windows('no_such_dir', 8)", "no_such_dir"),
        ("paisoar_jax.load_config(None, ['train.stepz=3'])", "unknown config key train.stepz"),
        ("paisoar_jax.Generator('no_such_run')", "no_such_run"),
    ):
        script.write_text(f"import paisoar_jax\n{call}\n")
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and ": error: " in lines[0], lines
