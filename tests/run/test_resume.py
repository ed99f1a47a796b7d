"""paisoar_jax/run/resume.py: what a resumed run says of what changed since its checkpoint."""

import pytest

from paisoar_jax.checkpointing.checkpoint import Restored
from paisoar_jax.config import load_config
from paisoar_jax.run.resume import schedule_change


def restored_at(step, steps):
    return Restored(step, None, None, {"config": {"train": {"steps": steps}}})


@pytest.mark.parametrize(
    ("overrides", "saved_steps", "said"),
    [
        (["train.steps=80"], 40, True),  # cosine: its decay spans train.steps
        (["train.steps=40"], 40, False),  # nothing changed
        (["train.steps=80", "optim.schedule=constant"], 40, False),  # warmup 30 in both
        (["train.steps=80", "optim.schedule=constant"], 20, True),  # warmup min(30, 20) -> 30
        (["train.steps=80", "optim.schedule=constant", "optim.warmup_steps=0"], 20, False),
    ],
)
def test_a_schedule_that_follows_train_steps_is_said_to_change(overrides, saved_steps, said):
    config = load_config(None, overrides)
    line = schedule_change(restored_at(20, saved_steps), config.train, config.optim)
    assert bool(line) == said
    if said:
        assert line.startswith(
            f"train.steps changed since checkpoint step 20 ({saved_steps} -> 80)"
        )
        assert "learning rate from step 21 on is not the one the run had before" in line
