"""The slow tier beside tests/end_to_end/test_examples.py: longer runs, more settings.

The scripts in examples/ run as a user runs them, and a stopped one resumes bit for bit.
"""

import signal
import subprocess
import time

from conftest import PYTHON, run_records, subprocess_env
from doc_blocks import argv, command_lines, doc_block
from test_examples import EXAMPLES, QUIET, run_example, run_python


def test_own_mlp_learns_the_spirals(tmp_path):
    result = run_example("own_mlp.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy = float(result.stdout.split("eval accuracy")[-1])
    assert accuracy > 0.95


def test_own_cnn_in_bf16_and_fp16_is_within_2_points_of_fp32_and_loads_for_inference(tmp_path):
    """BatchNorm, and Dropout keyed by the loss's rng; then paisoar_jax.load in plain Python."""
    accuracy = {}
    [line] = command_lines(doc_block("own-cnn"))  # the tutorial's command, fp16
    _, (_, program, shown) = argv(line)
    assert (program, shown) == ("examples/own_cnn.py", "precision.policy=fp16")
    for policy in ("fp32", "bf16", "fp16"):
        result = run_example(
            "own_cnn.py", f"precision.policy={policy}", f"run.name={policy}", cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-2000:]
        accuracy[policy] = float(result.stdout.split("eval accuracy")[-1].split()[0])
        loaded = float(result.stdout.split("loaded model:")[-1].split()[0])
        # The module loaded back computes in fp32 what the run evaluated in its policy.
        assert abs(loaded - accuracy[policy]) <= 0.01, result.stdout
        assert "Metadata file does not exist" not in result.stderr
    assert accuracy["fp32"] > 0.93
    for policy in ("bf16", "fp16"):
        assert accuracy[policy] >= accuracy["fp32"] - 0.02, accuracy


def test_own_transformer_runs_on_fsdp_and_tensor(tmp_path):
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # the example asks for its own 4 simulated devices
    result = run_example(
        "own_transformer.py", "train.steps=30", "train.log_every=10", cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 2}, 4 cpu devices" in result.stdout
    losses = [record["loss"] for record in run_records(tmp_path / "runs" / "own_transformer")]
    assert losses[-1] < losses[0]


def test_fine_tune_starts_from_the_export(tmp_path):
    result = run_example("fine_tune.py", "train.steps=60", "train.log_every=10", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "runs" / "spirals_pretrain" / "export" / "params").is_dir()
    pre_trained = run_records(tmp_path / "runs" / "spirals_pretrain")
    tuned = run_records(tmp_path / "runs" / "spirals_finetune")
    # Started from the pre-trained weights, not from scratch: its first loss is already low.
    assert tuned[0]["loss"] < pre_trained[0]["loss"] / 2


def test_own_grain_pipeline_under_the_launcher(tmp_path):
    """`launch -- python script.py`: two processes, each feeding its own share."""
    launch = ["-m", "paisoar_jax.launch", "--nproc", "2", "--devices-per-proc", "2", "--"]
    script = ["python", str(EXAMPLES / "own_grain_pipeline.py"), *QUIET, "train.steps=40"]
    result = run_python(*launch, *script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 0] paisoar_jax: 2 processes" in result.stdout
    assert "mesh {'data': 4, 'fsdp': 1, 'tensor': 1}, 4 cpu devices" in result.stdout
    assert "[rank 1] eval accuracy" in result.stdout


def test_sigterm_then_resume_continues_bit_for_bit(tmp_path):
    """A fit run stopped by SIGTERM saves and exits 0; rerun, it ends as the uninterrupted one."""
    settings = ["train.steps=40", "train.log_every=1", "checkpoint.every=0"]
    reference = run_example("own_grain_pipeline.py", *settings, "run.dir=reference", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]
    command = [PYTHON, str(EXAMPLES / "own_grain_pipeline.py"), *QUIET, *settings, "run.dir=cut"]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 8):
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-2000:]
    assert "stopped by SIGTERM" in stdout
    stopped_at = run_records(tmp_path / "cut")[-1]["step"]
    assert stopped_at < 40
    resumed = run_example("own_grain_pipeline.py", *settings, "run.dir=cut", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout
    fields = ("loss", "accuracy", "grad_norm", "eval_loss")
    want = {r["step"]: tuple(r.get(f) for f in fields) for r in run_records(tmp_path / "reference")}
    got = {r["step"]: tuple(r.get(f) for f in fields) for r in run_records(tmp_path / "cut")}
    assert got == want


def test_supervised_fine_tuning_of_an_imported_model_answers_in_transformers(tmp_path):
    """Import a random Llama, fine-tune it on sums with the prompts masked, export it: in
    transformers it answers the sums (at random it would get about 1 in 20)."""
    result = run_example("sft_instructions.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "data.loss_on=response" in result.stdout
    accuracy = int(result.stdout.split("transformers answers ")[1].split("%")[0])
    assert accuracy >= 90, result.stdout[-2000:]


def test_lora_adapters_alone_teach_a_frozen_model_and_load_in_peft(tmp_path):
    """Import a random Llama, train LoRA adapters on sums (the model frozen), export them
    with --peft: the base model with the adapter in PEFT answers the sums."""
    result = run_example("lora_fine_tune.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lora.rank=16" in result.stdout and "--peft" in result.stdout
    accuracy = int(result.stdout.split("adapter answers ")[1].split("%")[0])
    assert accuracy >= 90, result.stdout[-2000:]


def test_a_mixture_changes_weights_at_a_stage_and_on_resume(tmp_path):
    """Two sources (the embedded Python, sums from a `datasets` directory), a stage at 41, a
    stop at 40 and at 80, new weights on the second resume: each stretch has its shares."""
    result = run_example("data_mixture.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from step 40" in result.stdout and "resumed from step 80" in result.stdout
    assert "every source goes on from where it was (python at example" in result.stdout
    lines = [line for line in result.stdout.splitlines() if "sums are" in line]
    shares = [float(line.split("sums are ")[1].split("%")[0]) for line in lines]
    assert len(shares) == 3
    for share, weight in zip(shares, (10, 50, 80), strict=True):
        assert abs(share - weight) < 1, lines


def test_own_loop_over_prepare_learns_and_resumes_from_its_last_save(tmp_path):
    first = run_example("own_loop.py", "train.global_batch=64", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "step 300: eval_accuracy" in first.stdout  # prepared.evaluate's line
    assert float(first.stdout.split("held-out accuracy")[-1]) > 0.95
    again = run_example("own_loop.py", cwd=tmp_path)  # resumes at step 300: nothing to train
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step " not in again.stdout and "held-out accuracy" in again.stdout
