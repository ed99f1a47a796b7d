"""The pages' commands, run as written on tiny shapes: each block in a folder of its own.

The commands are the page's; the tests add the overrides that make them tiny (the model of
conftest.TINY, a few steps), fill the placeholders (RUN_DIR, a folder of text) and drop the
optional `[...]` parts. Each must exit 0 and leave what the page says it leaves.
"""

import json
import math
import re
import shutil
import subprocess

from conftest import PYTHON, REPO, TINY, run_records, subprocess_env
from doc_blocks import argv, command_lines, doc_block, without_optional
from test_examples import run_python

SHORT = ["train.steps=4", "train.eval_every=2", "train.log_every=1"]
QUIET = ["run.progress=false", "run.tensorboard=false"]
TAKES_OVERRIDES = ("paisoar_jax.train", "paisoar_jax.plan", "paisoar_jax.bench")


def run_line(line, cwd, extra=(), timeout=600):
    """One command line of a page, in `cwd`, with `extra` overrides; its CompletedProcess."""
    line = without_optional(line)
    line = line.split(" && ", 1)[-1]  # "pip install -e . && python -m ...": the install is ours
    environment, words = argv(line)
    module = words[2] if words[:2] == ["python", "-m"] else ""
    if module in TAKES_OVERRIDES or module == "paisoar_jax.launch" or module == "":
        words = [*words, *extra]
    result = subprocess.run(
        [PYTHON, *words[1:]] if words[0] == "python" else words,
        cwd=cwd,
        env={**subprocess_env(), **environment},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (line, result.stdout[-1500:], result.stderr[-3000:])
    return result


def run_block(name, cwd, extra=(), replace=None):
    """Every line of the block NAME; their CompletedProcesses."""
    results = []
    for line in command_lines(doc_block(name)):
        for old, new in (replace or {}).items():
            line = line.replace(old, new)
        results.append(run_line(line, cwd, extra))
    return results


def test_the_first_run_tutorial(tmp_path):
    """Train, read metrics.jsonl, ask the doctor, change what runs: the tutorial's commands."""
    run_block("first-run-train", tmp_path, [*TINY, *SHORT])
    assert run_records(tmp_path / "runs" / "default")[-1]["step"] == 4
    [printed] = run_block("first-run-metrics", tmp_path)
    assert printed.stdout.splitlines()[-1].startswith("4 ")  # step and loss per record
    [doctor] = run_block("first-run-doctor", tmp_path)
    assert re.match(r"runs/default: (no findings|\d+ findings?)", doctor.stdout), doctor.stdout
    shutil.rmtree(tmp_path / "runs")
    run_block("first-run-overrides", tmp_path, [*TINY, *SHORT])
    assert (tmp_path / "runs" / "gpt2_124m" / "metrics.jsonl").is_file()


def test_configs_and_overrides(tmp_path):
    (tmp_path / "my_run.yaml").write_text("train:\n  steps: 3\n")
    run_block("shipped-configs", tmp_path, [*TINY, *SHORT])
    run_block("overrides", tmp_path, [*TINY, *SHORT])
    for name in ("gpt2_124m", "gpt_1b", "my_run"):
        assert run_records(tmp_path / "runs" / name)[-1]["step"] == 4, name


def test_a_stopped_run_resumes_on_another_mesh(tmp_path):
    first, second = command_lines(doc_block("resume-on-another-mesh"))
    run_line(first, tmp_path, [*TINY, *QUIET, "train.steps=3", "train.log_every=1"])
    resumed = run_line(second, tmp_path, [*TINY, *QUIET, "train.steps=6", "train.log_every=1"])
    assert "resum" in resumed.stdout + resumed.stderr
    assert [record["step"] for record in run_records(tmp_path / "runs" / "default")] == [
        *range(1, 7)
    ]


def test_the_gemma3_page_trains_its_tiny_config(tmp_path):
    run_block("gemma3-tiny", tmp_path, [*TINY, *SHORT, "model.layers=6", "model.sliding_window=8"])
    records = run_records(tmp_path / "runs" / "gemma3_tiny")
    assert records[-1]["step"] == 4 and "eval_loss" in records[-1]


def test_the_meshes_pipeline_and_compressed_gradients(tmp_path):
    for name, extra in (
        ("three-axis-mesh", []),
        ("pipeline", ["model.layers=4"]),  # a layer or more per stage of 4
        ("int8-gradients", []),
    ):
        run_block(name, tmp_path, [*TINY, *SHORT, *extra, f"run.dir={name}"])
        assert run_records(tmp_path / name)[-1]["step"] == 4, name


def test_text_conversion_mixtures_and_the_input_bench(tmp_path):
    corpus = tmp_path / "corpus" / "stdlib"
    corpus.mkdir(parents=True)
    for path in sorted((REPO / "paisoar_jax" / "data").glob("*.py"))[:8]:
        (corpus / f"{path.stem}.txt").write_text(path.read_text())
    run_block("convert-text", tmp_path, [*TINY, *SHORT])
    assert (tmp_path / "data" / "corpus" / "manifest.json").is_file()
    shutil.copytree(tmp_path / "data" / "corpus", tmp_path / "data" / "code")
    run_block("mixture", tmp_path, [*TINY, *SHORT, "run.dir=runs/mixture"])
    assert run_records(tmp_path / "runs" / "mixture")[-1]["step"] == 4
    run_block("bench-data", tmp_path, [*TINY, "train.steps=3"])


def test_export_then_fine_tune_from_it(tmp_path):
    run_line("python -m paisoar_jax.train", tmp_path, [*TINY, *SHORT])
    run_block("export-fine-tune", tmp_path, [*TINY, *SHORT])
    assert run_records(tmp_path / "runs" / "tuned")[-1]["step"] == 4


def test_the_shipped_digits_config(tmp_path):
    run_block("digits", tmp_path, [*QUIET, *SHORT])
    assert "eval_accuracy" in run_records(tmp_path / "runs" / "digits")[-1]


def test_plan_profile_and_the_doctors_scaling(tmp_path):
    [plan] = run_block("plan", tmp_path, [*TINY])
    assert "per device" in plan.stdout
    run_block("profile", tmp_path, [*TINY, *QUIET, "train.steps=26", "train.eval_every=0"])
    assert any((tmp_path / "runs" / "default" / "profile").rglob("*.xplane.pb"))
    run_line("python -m paisoar_jax.train run.dir=run", tmp_path, [*TINY, *SHORT])
    run_block(
        "doctor-scaling",
        tmp_path,
        replace={"RUN_DIR": "run", "[same overrides as the run]": " ".join(TINY)},
    )
    assert all((tmp_path / "run" / name).is_file() for name in ("scaling.json", "plan.json"))


def test_the_launcher_with_restarts_and_with_a_script_of_ones_own(tmp_path):
    run_block("launch-restarts", tmp_path, [*TINY, *SHORT], replace={"train.steps=100": ""})
    assert run_records(tmp_path / "runs" / "default")[-1]["step"] == 4
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    run_block("launch-own-script", tmp_path, [*QUIET], replace={"train.steps=100": "train.steps=4"})


def test_the_prepare_loop_runs_on_the_readmes_definitions(tmp_path, monkeypatch):
    """The tutorial's loop over prepare, after the README program's model, loss and data."""
    program = doc_block("own-model").text.split('if __name__ == "__main__":')[0]
    loop = doc_block("prepare-loop").text.replace("301", "5")  # 4 steps, not 300,
    loop = loop.replace("step % 100", "step % 2")  # saving at 2 and 4
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(program, names)
    settings = '["mesh.fsdp=2", "run.dir=loop", "run.progress=false"]'
    exec(loop.replace('["mesh.fsdp=2"]', settings), names)
    assert names["step"] == 4
    saved = sorted(path.name for path in (tmp_path / "loop" / "checkpoints").iterdir())
    assert [name for name in saved if name.isdigit()] == ["2", "4"], saved
    records = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").open()]
    assert [record["step"] for record in records] == [2, 4] and "eval_loss" in records[-1]
    assert names["model"](names["x"][:2]).shape == (2, 2)  # load read the loop's directory


def test_a_run_directory_holds_what_the_page_lists(tmp_path):
    """The run-directory listing: each name it gives is in a run (profile/ with profile_steps)."""
    listed = re.findall(r"^(\S+)\s", doc_block("run-directory").text, re.M)
    assert listed[:2] == ["config.yaml", "metrics.jsonl"]
    overrides = [*TINY, *SHORT, "run.tensorboard=true", "train.profile_steps=[2,3]"]
    run_line("python -m paisoar_jax.train run.dir=run", tmp_path, overrides)
    for name in listed:
        assert (tmp_path / "run" / name.rstrip("/")).exists(), name


def test_the_readmes_command_line_quick_start(tmp_path):
    run_block("quick-cli", tmp_path, [*TINY, *SHORT])
    assert run_records(tmp_path / "runs" / "gpt2_124m")[-1]["step"] == 4


def test_gradient_accumulation_at_the_pages_batch(tmp_path):
    """The page's global batch of 64 in 4 micro-batches (TINY's batch of 16 left out)."""
    model = [setting for setting in TINY if not setting.startswith("train.global_batch")]
    run_block("grad-accum", tmp_path, [*model, *SHORT])
    assert run_records(tmp_path / "runs" / "default")[-1]["step"] == 4


def test_muon_on_the_tiny_llama(tmp_path):
    run_block("muon", tmp_path, [*SHORT, "run.dir=runs/muon"])
    records = run_records(tmp_path / "runs" / "muon")
    assert records[-1]["step"] == 4 and all(math.isfinite(r["loss"]) for r in records)


def test_skipping_loss_spikes(tmp_path):
    run_block("skip-spikes", tmp_path, [*TINY, *SHORT])
    records = run_records(tmp_path / "runs" / "default")
    assert [record["skipped_spikes"] for record in records][-1] == 0  # (not judged before 16)


def run_python_block(name, cwd):
    """The block NAME as a script in cwd, run as a user runs it; what it printed."""
    script = cwd / f"{name}.py"
    script.write_text(doc_block(name).text)
    result = run_python(str(script), cwd=cwd)
    assert result.returncode == 0, (name, result.stderr[-3000:])
    return result.stdout


def test_the_fine_tuning_tutorial(tmp_path):
    """Make a tiny Llama, import, fine-tune, generate, export, load in transformers and peft."""
    one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    run_python_block("ft-make-model", tmp_path)
    quiet = [*QUIET, "train.log_every=50"]
    for line in command_lines(doc_block("ft-import-train")):
        run_line(f"XLA_FLAGS={one_device['XLA_FLAGS']} {line}", tmp_path, quiet)
    logged = run_records(tmp_path / "runs" / "tuned")
    # From the random model's ln 256 before any update, it learns the bytes of Python.
    assert logged[-1]["loss"] < 0.5 * logged[0]["first_step_loss"], logged[0]
    run_block("ft-export", tmp_path)
    assert run_python_block("ft-transformers", tmp_path).split()[-1] == "True"
    for line in command_lines(doc_block("ft-lora")):
        run_line(f"XLA_FLAGS={one_device['XLA_FLAGS']} {line}", tmp_path, quiet)
    assert run_python_block("ft-peft", tmp_path).split()[-1] == "16"


def test_the_cluster_tutorial_gives_the_same_losses_on_two_processes(tmp_path):
    """One process of eight devices, then two of four: the page's promise, step for step."""
    settings = [*TINY, "train.log_every=1", "train.eval_every=0", "checkpoint.every=3"]
    run_block("cluster-one", tmp_path, settings, replace={"train.steps=100": "train.steps=6"})
    run_block("cluster-two", tmp_path, settings, replace={"train.steps=100": "train.steps=6"})
    one, two = (run_records(tmp_path / "runs" / name) for name in ("one", "two"))
    assert [record["step"] for record in two] == [*range(1, 7)]
    for mine, theirs in zip(one, two, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(mine["loss"]), (mine, theirs)
