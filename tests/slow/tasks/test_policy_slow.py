"""The GRPO recipe learns its verifiable task (examples/grpo_copy.py, docs/how-to/grpo.md)."""

from conftest import run_records
from doc_blocks import argv, command_lines, doc_block
from test_examples import run_example


def test_the_recipe_learns_to_copy_from_rewards_alone(tmp_path):
    [line] = command_lines(doc_block("grpo-recipe"))
    _, words = argv(line)
    assert words == ["python", "examples/grpo_copy.py"]
    result = run_example("grpo_copy.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rewards = [record["reward"] for record in run_records(tmp_path / "runs" / "grpo_copy")]
    assert rewards[0] < 0.2 and rewards[-1] >= 0.9, rewards
