"""The scripts in examples/ run as a user runs them, and a stopped one resumes bit for bit."""

import json
import subprocess

import pytest
from conftest import PYTHON, REPO, subprocess_env

EXAMPLES = REPO / "examples"
QUIET = ["run.progress=false", "run.tensorboard=false"]


def run_python(*arguments, cwd, env=None, timeout=300):
    """`python ARGUMENTS` as a user runs it, in `cwd`; the CompletedProcess."""
    return subprocess.run(
        [PYTHON, *arguments],
        cwd=cwd,
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_example(name, *overrides, cwd, env=None):
    return run_python(str(EXAMPLES / name), *QUIET, *overrides, cwd=cwd, env=env)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.py")))
def test_every_example_has_a_docstring_with_its_command(name):
    text = (EXAMPLES / name).read_text()
    assert text.startswith('"""') and f"python examples/{name}" in text


def test_the_readme_program_runs(tmp_path):
    """The complete program of the README's "Your own model" section, as a user pastes it."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1].split("## A tour", 1)[0]
    program = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in program.splitlines() if line.strip()]) <= 20
    script = tmp_path / "readme_program.py"
    script.write_text(program)
    result = run_python(str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "paisoar_jax: done: 200 steps" in result.stdout
    # Its own run directory, named after the script: not the CLI's runs/default.
    assert (tmp_path / "runs" / "readme_program" / "metrics.jsonl").is_file()
