"""The one output path: text, quiet and JSON-lines modes, in a function and in a real run."""

import io
import json
import subprocess
import sys

import pytest
from conftest import PYTHON, TINY, subprocess_env

from paisoar_jax import output


def speak():
    output.note("a note")
    output.warning("a warning")
    output.error("an error", program="paisoar_jax.plan")
    output.result("a table")


def test_text_mode_is_the_default(monkeypatch, capsys):
    monkeypatch.delenv("PAISOAR_OUTPUT", raising=False)
    speak()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["paisoar_jax: a note", "a table"]
    assert captured.err.splitlines() == [
        "paisoar_jax: warning: a warning",
        "paisoar_jax.plan: error: an error",
    ]
    assert output.shows_progress()


def test_quiet_mode_keeps_warnings_errors_and_results(monkeypatch, capsys):
    monkeypatch.setenv("PAISOAR_OUTPUT", "quiet")
    speak()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["a table"]
    assert len(captured.err.splitlines()) == 2
    assert not output.shows_progress()


def test_json_mode_writes_one_object_a_line(monkeypatch, capsys):
    monkeypatch.setenv("PAISOAR_OUTPUT", "json")
    output.note("two\nlines", stderr=True)
    output.error("bad", program="paisoar_jax.train")
    lines = capsys.readouterr().err.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"level": "note", "program": "paisoar_jax", "message": "two\nlines"},
        {"level": "error", "program": "paisoar_jax.train", "message": "bad"},
    ]


@pytest.mark.parametrize("mode", ["json", pytest.param("quiet", marks=pytest.mark.slow)])
def test_a_training_run_follows_the_switch(mode, tmp_path):
    environment = {**subprocess_env(), "PAISOAR_OUTPUT": mode}
    command = [PYTHON, "-m", "paisoar_jax.train", *TINY, "train.steps=2", "train.eval_every=2"]
    command += ["run.progress=true", f"run.dir={tmp_path}/run"]  # the bar obeys the mode too
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if mode == "quiet":
        assert result.stdout == ""
        assert "train:" not in result.stderr  # no progress bar
        return
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {record["level"] for record in records} == {"note"}
    messages = [record["message"] for record in records]
    assert "M params, mesh " in messages[0] and "compiled in " in messages[0]
    assert any(message.startswith("step 2: eval_loss ") for message in messages)
    assert messages[-1].startswith("done: 2 steps in ")


def test_a_bad_input_is_one_json_error_line(tmp_path):
    environment = {**subprocess_env(), "PAISOAR_OUTPUT": "json"}
    command = [PYTHON, "-m", "paisoar_jax.train", "train.steps=0", f"run.dir={tmp_path}/run"]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    errors = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert errors == [
        {
            "level": "error",
            "program": "paisoar_jax.train",
            "message": "train.steps must be >= 1, got 0",
        }
    ]


def test_a_small_model_is_counted_in_params_not_zero_millions():
    """Before: a 8,386-parameter model printed `0.00M params`."""
    from paisoar_jax.output import describe_params

    assert describe_params(8_386) == "8,386 params"
    assert describe_params(120_384) == "0.12M params"
    assert describe_params(124_439_808) == "124.44M params"


def test_a_progress_bar_into_a_file_draws_lines_not_carriage_returns(capsys):
    """Before: output redirected to a file got one huge `\\r`-joined progress line."""
    bar = output.progress_bar(total=3, desc="train")
    for _ in range(3):
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("train: 100%|")
    assert len(err.splitlines()) <= 3  # the start, the end (30 s apart at most in between)


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "srun", [{}, {"SLURM_STEP_ID": "0"}, {"SLURM_STEP_ID": "0", "SLURM_PTY_PORT": "1"}]
)
def test_a_progress_bar_under_srun_draws_lines_even_on_a_terminal(srun, monkeypatch):
    """Before: a task srun started redrew with carriage returns into the SLURM log."""
    for name in ("SLURM_STEP_ID", "SLURM_PTY_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    bar = output.progress_bar(total=3, desc="train")
    for _ in range(3):
        bar.update(1)
    bar.close()
    in_place = not srun or "SLURM_PTY_PORT" in srun  # a terminal, or srun --pty's
    assert ("\r" in stream.getvalue()) == in_place


def test_model_written_text_is_printed_with_its_control_characters_escaped():
    """Before: a closing sample put NUL and form feeds on stdout; grep called the log binary."""
    text = "line one\n\tindented\x00 and\x0c a \x1b[31m colour, é and \ufffd"
    assert output.printable(text) == (
        "line one\n\tindented\\x00 and\\x0c a \\x1b[31m colour, é and \ufffd"
    )
