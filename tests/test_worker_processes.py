"""data.workers > 0 in a script of one's own: a top-level fit is refused before workers start."""

import subprocess
import textwrap

from conftest import PYTHON, subprocess_env

from paisoar_jax.data.worker_processes import _is_main_guard

FIT_SCRIPT = """
import numpy as np, optax
from flax import nnx
import paisoar_jax

def loss(model, batch, rng):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}

data = {"x": np.ones((64, 2), np.float32), "y": np.zeros((64, 1), np.float32)}
overrides = ["train.steps=2", "data.workers=2", "run.dir=run", "run.progress=false"]
"""
FIT_CALL = "paisoar_jax.fit(None, overrides, model=lambda rngs: nnx.Linear(2, 1, rngs=rngs), "
FIT_CALL += "loss=loss, optimizer=optax.sgd(0.1), data=data)"


def run_script(tmp_path, text):
    """Runs `text` as a script of its own in tmp_path; the CompletedProcess."""
    script = tmp_path / "mine.py"
    script.write_text(textwrap.dedent(text))
    return subprocess.run(
        [PYTHON, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fit_at_a_scripts_top_level_with_workers_is_one_line_and_exit_2(tmp_path):
    """Each worker would run the script again, train again and die on the run's lock; the
    refusal names the line and the fix before any worker starts."""
    result = run_script(tmp_path, FIT_SCRIPT + FIT_CALL + "\n")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "data.workers=2 starts worker processes that import your script again" in lines[0]
    line = FIT_SCRIPT.count("\n") + 1  # the fit call's
    assert f"mine.py line {line} runs at its top level: put it under `if __name__ ==" in lines[0]


def test_the_same_fit_under_the_main_guard_trains_with_workers(tmp_path):
    guarded = FIT_SCRIPT + 'if __name__ == "__main__":\n    result = ' + FIT_CALL + "\n"
    result = run_script(tmp_path, guarded + "    print('steps', result['steps'])\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "steps 2" in result.stdout


def test_the_guard_is_told_apart_from_other_top_level_statements():
    import ast

    def first(source):
        return ast.parse(textwrap.dedent(source)).body[0]

    assert _is_main_guard(first('if __name__ == "__main__":\n    pass'))
    assert _is_main_guard(first("if '__main__' == __name__:\n    pass"))
    assert not _is_main_guard(first('if __name__ != "__main__":\n    pass'))
    assert not _is_main_guard(first("if True:\n    pass"))
    assert not _is_main_guard(first("fit()"))
