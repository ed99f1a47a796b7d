"""The evaluation page's commands and Python, as written, on a run (docs/how-to/evaluate.md).

The page's public task names are swapped for test_harness.py's local tasks (no download).
"""

import json
import os
import shutil

from doc_blocks import command_lines, doc_block
from test_doc_blocks_slow import run_line
from test_harness import trained  # noqa: F401 (the module fixture: a run and the tasks)


def test_the_evaluation_page_runs(trained, tmp_path):  # noqa: F811
    shutil.copytree(trained / "run", tmp_path / "runs" / "sft")
    include = f"--include-path {trained / 'tasks'}"
    [short] = command_lines(doc_block("evaluate-run"))
    run_line(short.replace("hellaswag,arc_easy", f"tiny_choice,tiny_text {include}"), tmp_path)
    *_, record = [json.loads(line) for line in (tmp_path / "runs" / "sft" / "harness.jsonl").open()]
    assert record["tasks"] == ["tiny_choice", "tiny_text"]
    assert record["results"]["tiny_text"]["word_perplexity,none"] > 1
    [lm_eval_line] = command_lines(doc_block("evaluate-lm-eval"))
    swapped = lm_eval_line.replace("hellaswag", f"tiny_choice --include_path {trained / 'tasks'}")
    result = run_line(swapped, tmp_path)
    assert "tiny_choice" in result.stdout and "acc" in result.stdout
    program = doc_block("evaluate-python").text.replace(
        'tasks=["hellaswag"]',
        f'tasks=["tiny_choice"], task_manager=lm_eval.tasks.TaskManager(include_path='
        f'"{trained / "tasks"}")',
    )
    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        names = {}
        exec("import lm_eval.tasks\n" + program, names)
    finally:
        os.chdir(previous)
    assert 0 <= names["results"]["results"]["tiny_choice"]["acc,none"] <= 1
    [during] = command_lines(doc_block("harness-during-training"))
    shutil.copytree(trained / "imported", tmp_path / "imported")
    during = during.replace("[hellaswag]", "[tiny_text]").replace("=500", "=2")
    quick = ["train.steps=2", "train.global_batch=8", "model.seq_len=32", "data.source=synthetic"]
    quick += [f"train.harness_include_path={trained / 'tasks'}", "train.eval_every=0"]
    run_line(during.replace("runs/sft", "runs/during"), tmp_path, quick)
    records = [json.loads(line) for line in (tmp_path / "runs" / "during" / "metrics.jsonl").open()]
    assert records[-1]["eval_harness_tiny_text/word_perplexity"] > 1
