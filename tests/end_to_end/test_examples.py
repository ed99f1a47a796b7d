"""The scripts in examples/ run as a user runs them, and a stopped one resumes bit for bit."""

import subprocess

import numpy as np
import pytest
from conftest import PYTHON, REPO, run_records, subprocess_env
from doc_blocks import argv, command_lines, doc_block

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


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.py")))
def test_every_example_has_a_docstring_with_its_command(name):
    text = (EXAMPLES / name).read_text()
    assert text.startswith('"""') and f"python examples/{name}" in text


def test_the_readme_program_runs(tmp_path):
    """The complete program of the README's "Your own model" section, as a user pastes it."""
    program = doc_block("own-model").text
    assert len([line for line in program.splitlines() if line.strip()]) <= 20
    script = tmp_path / "readme_program.py"
    script.write_text(program)
    result = run_python(str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "paisoar_jax: done: 200 steps" in result.stdout
    # Its own run directory, named after the script: not the CLI's runs/default.
    assert (tmp_path / "runs" / "readme_program" / "metrics.jsonl").is_file()


def test_own_image_folder_trains_a_cnn_on_a_folder_of_images(tmp_path):
    """The vision tutorial's program on a folder of red and blue images, as a user runs it."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for channel, name in ((0, "red"), (2, "blue")):
        (tmp_path / "photos" / name).mkdir(parents=True)
        for index in range(24):
            pixels = rng.integers(0, 90, (40, 48, 3), dtype=np.uint8)
            pixels[..., channel] += 150
            Image.fromarray(pixels).save(tmp_path / "photos" / name / f"{index}.png")
    # The page's command, on this folder, for 30 steps instead of its 400.
    [line] = command_lines(doc_block("own-images-run"))
    _, (python, program, folder, *overrides) = argv(line)
    assert (python, program, folder) == ("python", "examples/own_image_folder.py", "photos")
    # The page shows this program whole, and its reading lines, by including them.
    assert doc_block("own-images-program").text.strip() == f'--8<-- "{program}"'
    assert doc_block("own-images-read").text.strip() == f'--8<-- "{program}:read"'
    assert "# --8<-- [start:read]" in (REPO / program).read_text()
    overrides += ["train.steps=30", "train.global_batch=8", "train.eval_every=30"]
    result = run_python(str(REPO / program), folder, *QUIET, *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "classes ['blue', 'red']" in result.stdout
    last = run_records(tmp_path / "runs" / "own_image_folder")[-1]
    assert last["step"] == 30 and last["eval_accuracy"] == 1.0  # colour is easy to see
