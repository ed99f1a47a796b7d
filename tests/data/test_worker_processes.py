"""data.workers > 0 in a script of one's own: a top-level fit is refused before workers start."""

import subprocess
import textwrap

import pytest
from conftest import PYTHON, subprocess_env

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


WHERE = "from paisoar_jax.data.worker_processes import unguarded_main_line as where\n"
GUARDED = {  # each calls where() from a line a worker's import of the script would not run
    "plain": 'if __name__ == "__main__":\n    print(where())\n',
    "reversed": "if '__main__' == __name__:\n    print(where())\n",
    "with an and": 'import sys\nif __name__ == "__main__" and sys.argv:\n    print(where())\n',
    "inside a try": 'try:\n    if __name__ == "__main__":\n        print(where())\nfinally:\n'
    "    pass\n",
    "a main() it calls": 'def main():\n    print(where())\n\nif __name__ == "__main__":\n'
    "    main()\n",
}
UNGUARDED = {  # each is run again by the import: (the script, the line named)
    "at the top": ("print(where())\n", 2),
    "a main() at the top": ("def main():\n    print(where())\n\nmain()\n", 5),
    "inside a try": ("try:\n    print(where())\nexcept OSError:\n    pass\n", 3),
    "inside another if": ("if True:\n    print(where())\n", 3),
    "with a byte-order mark": ("\ufeffprint(where())\n", 2),
}


def run_where(tmp_path, body):
    """What unguarded_main_line() says in a script of WHERE + body (its stdout's last line)."""
    script = tmp_path / "mine.py"
    mark = "\ufeff" if body.startswith("\ufeff") else ""  # a byte-order mark opens the file
    script.write_text(mark + WHERE + body.removeprefix(mark), encoding="utf-8")
    result = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", GUARDED)
def test_a_guarded_call_is_never_refused(tmp_path, name):
    assert run_where(tmp_path, GUARDED[name]) == "None"


@pytest.mark.parametrize("name", UNGUARDED)
def test_an_unguarded_call_is_found_with_its_line(tmp_path, name):
    body, line = UNGUARDED[name]
    assert run_where(tmp_path, body) == str((tmp_path / "mine.py", line))


def test_a_run_with_input_workers_leaves_no_shared_memory_behind(tmp_path):
    """Before: `resource_tracker: There appear to be 4 leaked shared_memory objects` at the
    end of every run with workers (the device array kept a view of grain's segment)."""
    from conftest import TINY, run_module

    settings = [*TINY, "train.steps=6", "train.eval_every=0", "data.workers=2", "run.dir=run"]
    result = run_module("train", *settings, "train.sample_bytes=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "leaked shared_memory" not in result.stderr, result.stderr[-2000:]
    assert "resource_tracker" not in result.stderr
