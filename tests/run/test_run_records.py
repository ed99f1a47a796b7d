"""The loop's records (run_records.py): the summary line that closes a run."""

import types

from paisoar_jax.run import run_records

TOKENS = types.SimpleNamespace(unit="tokens")


def summary(**changes):
    """A run's summary as the loop hands it to print_summary."""
    made = {"steps": 10, "first_loss": 3.5, "final_loss": 2.25, "logged_losses": 2}
    made |= {"eval_loss": None, "eval_s": 0.0, "train_s": 1.0, "tokens_per_s": 100.0}
    return made | {"compile_s": 2.0, "run_dir": "runs/x", "resumed_from": 0} | changes


def test_the_summary_line_shows_the_loss_from_first_to_last_log(capsys):
    run_records.print_summary(summary(), TOKENS)
    assert "done: 10 steps in 1.0s, loss 3.5000 -> 2.2500, 100 tokens/s" in capsys.readouterr().out


def test_one_log_step_is_not_shown_as_a_loss_that_stood_still(capsys):
    """Before: "loss 3.5851 -> 3.5851", as if the run had not trained."""
    run_records.print_summary(summary(final_loss=3.5, logged_losses=1), TOKENS)
    line = capsys.readouterr().out
    assert "loss 3.5000 (one log step: lower train.log_every for more)," in line
    assert "->" not in line


def test_a_run_that_logged_nothing_says_so(capsys):
    empty = summary(first_loss=None, final_loss=None, logged_losses=0)
    run_records.print_summary(empty, TOKENS)
    assert "no loss logged" in capsys.readouterr().out
