"""lm-evaluation-harness on our models (inference/harness.py, tools/evaluate.py).

A tiny random Llama is imported, trained two steps and exported to transformers' format;
lm-eval's own `hf` model on the export and our `paisoar_jax` model on the run answer three
local tasks (a multiple choice, a rolling perplexity, a generation): the same accuracies,
perplexities and generated texts.
"""

import json

import numpy as np
import pytest
from conftest import WORDS, run_records, tiny_llama_import

import paisoar_jax
from paisoar_jax.tools import hf

TASKS = ("tiny_choice", "tiny_text", "tiny_gen")


def write_tasks(directory):
    """Three lm-eval task YAMLs over local JSON lines, in `directory`."""
    rng = np.random.default_rng(0)

    def words(count):
        return " ".join(rng.choice(WORDS, count))

    rows = {
        "choice": [
            {
                "question": words(5) + ":",
                "choices": [" " + words(int(rng.integers(1, 4))) for _ in range(3)],
                "answer": int(rng.integers(0, 3)),
            }
            for _ in range(12)
        ],
        "text": [{"text": words(int(rng.integers(10, 60)))} for _ in range(6)],
        "gen": [{"question": words(4), "answer": " x"} for _ in range(6)],
    }
    for name, records in rows.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shared = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
    specifics = {
        "choice": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "text": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
        'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["zzz"]\n'
        "  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, specific in specifics.items():
        data = f"    test: {directory / name}.jsonl\n"
        (directory / f"tiny_{name}.yaml").write_text(f"task: tiny_{name}\n{shared}{data}{specific}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, our run, its export to transformers' format, the task folder)."""
    root = tmp_path_factory.mktemp("harness")
    tiny_llama_import(root)
    (root / "tasks").mkdir()
    write_tasks(root / "tasks")
    paisoar_jax.fit(
        str(root / "imported" / "config.yaml"),
        [
            "train.steps=2",
            "train.global_batch=8",
            "model.seq_len=32",
            "data.source=synthetic",
            "train.eval_every=0",
            "optim.lr=1e-2",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.dir={root / 'run'}",
            # the harness during training: its choice task at the last step
            "train.harness_every=2",
            "train.harness_tasks=[tiny_choice]",
            f"train.harness_include_path={root / 'tasks'}",
        ],
    )
    hf.hf_export(root / "run", root / "export")
    return root


def test_our_model_answers_as_lm_evals_hf_model_on_the_export(trained):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from paisoar_jax.inference.harness import evaluate

    manager = TaskManager(include_path=str(trained / "tasks"))
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={trained / 'export'},dtype=float32",
        tasks=list(TASKS),
        task_manager=manager,
        device="cpu",
        batch_size=4,
        log_samples=True,
    )
    ours = evaluate(trained / "run", TASKS, include_path=str(trained / "tasks"), batch_size=4)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_choice"][metric] == theirs["results"]["tiny_choice"][metric]
    # train.harness_every: the same task on the weights as they were at the last step.
    [record] = [r for r in run_records(trained / "run") if "eval_harness_tiny_choice/acc" in r]
    assert record["step"] == 2
    assert record["eval_harness_tiny_choice/acc"] == theirs["results"]["tiny_choice"]["acc,none"]
    [line] = [json.loads(text) for text in (trained / "run" / "harness.jsonl").open()]
    assert line["step"] == 2 and line["tasks"] == ["tiny_choice"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_text"][metric] == pytest.approx(
            theirs["results"]["tiny_text"][metric], rel=1e-5
        )
    # Greedy generations: the same texts (lm-eval logs them per sample).
    generated = lm_eval.simple_evaluate(
        model="paisoar_jax",
        model_args=f"path={trained / 'run'}",
        tasks=["tiny_gen"],
        task_manager=manager,
        log_samples=True,
    )
    texts = [sample["resps"] for sample in generated["samples"]["tiny_gen"]]
    assert texts == [sample["resps"] for sample in theirs["samples"]["tiny_gen"]]
    assert any(text[0][0] for text in texts)  # not all empty


def test_the_command_line_evaluates_a_run_and_records_it(trained, capsys):
    """The short form in this process (the slow tier runs the page's commands as a user)."""
    from paisoar_jax.tools.evaluate import main

    arguments = [str(trained / "run"), "--include-path", str(trained / "tasks")]
    assert main([*arguments, "--tasks", "tiny_choice", "--limit", "4"]) == 0
    printed = capsys.readouterr().out
    assert "tiny_choice" in printed and "acc" in printed
    *_, record = [json.loads(line) for line in (trained / "run" / "harness.jsonl").open()]
    assert record["tasks"] == ["tiny_choice"] and record["config"]["limit"] == 4
    assert 0 <= record["results"]["tiny_choice"]["acc,none"] <= 1
    assert main([*arguments, "--tasks", "no_such_task"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("paisoar_jax.evaluate: error: lm-eval has no task 'no_such_task'")
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.harness_every=10"], "train.harness_every and train.harness_tasks go together"),
        (
            ["train.harness_every=10", "train.harness_tasks=[x]", "model.name=resnet"],
            "train.harness_every evaluates the zoo's decoders",
        ),
    ],
)
def test_bad_harness_settings_are_one_line(overrides, message):
    from paisoar_jax.config import load_config
    from paisoar_jax.errors import UserError

    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_harness_evals_are_checked_before_the_first_step(tmp_path):
    """An unknown task is one line at the start, not hours in; DPO runs take them too."""
    from conftest import TINY, train

    from paisoar_jax.config import load_config
    from paisoar_jax.errors import UserError
    from paisoar_jax.tasks.zoo import zoo_workload

    harness = ["train.harness_every=2", f"run.dir={tmp_path / 'run'}", "train.steps=2"]
    with pytest.raises(UserError, match="train.harness_tasks: lm-eval has no task 'no_such'"):
        train(load_config(None, [*TINY, *harness, "train.harness_tasks=[no_such]"]))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" for _ in range(4)
        )
    )
    from paisoar_jax.data.text_conversion import TextConversion, convert_text

    convert_text(
        TextConversion(
            output=tmp_path / "pairs", input=(str(pairs),), format="preference", progress=False
        )
    )
    config = load_config(
        None,
        [
            *TINY,
            *harness,
            "train.harness_tasks=[arc_easy]",
            "train.objective=dpo",
            f"data.source=arrayrecord:{tmp_path / 'pairs'}",
            "data.eval_fraction=0",
            "train.eval_every=0",
        ],
    )
    _, eval_sets = zoo_workload(config).task.open_sources()
    assert [one.name for one in eval_sets] == ["", "harness"]
