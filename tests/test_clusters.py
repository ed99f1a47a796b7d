"""Real cluster engines on this machine: SLURM (srun, sbatch, a preemption and a requeue),
Open MPI (mpirun) and a shell in an allocation, each against the one-process losses.

scripts/local_slurm.sh starts a single-node SLURM (Debian's slurmctld, slurmd and munge,
installed when missing) and Open MPI; that needs root, which CI has. Each job is two CPU
tasks of four simulated devices, the mesh's data axis across them (mesh.dcn_data=2).
"""

import json
import os
import re
import subprocess
import time

import numpy as np
import pytest
from conftest import PYTHON, REPO, RESUMABLE, subprocess_env

STEPS = 12
# run.progress: into a file, the bar must draw lines, not carriage returns.
RUN = [*RESUMABLE, "run.progress=true", f"train.steps={STEPS}"]
TRAIN = [PYTHON, "-m", "paisoar_jax.train"]


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    return [record["loss"] for record in records]


def environment(devices_per_task=4):
    env = subprocess_env()
    env["PAISOAR_CPU_DEVICES"] = str(devices_per_task)
    return env


def run(command, cwd, env=None, timeout=300):
    result = subprocess.run(
        command, cwd=cwd, env=env or environment(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def assert_reads_well(text):
    """No carriage returns and no collectives' chatter in what the job wrote."""
    assert "\r" not in text
    assert "[Gloo]" not in text and "peer ranks" not in text, text[-3000:]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a local SLURM needs root (CI runs as root)")
    started = subprocess.run(
        ["bash", str(REPO / "scripts" / "local_slurm.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert started.returncode == 0, started.stdout + started.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process with 8 devices."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run([*TRAIN, *RUN, f"run.dir={run_dir}"], run_dir.parent, env=subprocess_env())
    return losses(run_dir)


@pytest.fixture(scope="module")
def srun_job(cluster, tmp_path_factory):
    """`srun -n 2` of the trainer: its run directory and what it printed."""
    run_dir = tmp_path_factory.mktemp("srun") / "run"
    command = ["srun", "-n", "2", "--kill-on-bad-exit=1", *TRAIN, *RUN, "mesh.dcn_data=2"]
    result = run([*command, f"run.dir={run_dir}"], run_dir.parent)
    return run_dir, result.stdout + result.stderr


@pytest.mark.slow
def test_srun_two_tasks_give_the_one_process_losses(srun_job, one_process):
    run_dir, text = srun_job
    assert "paisoar_jax: 2 processes (SLURM)" in text
    np.testing.assert_allclose(losses(run_dir), one_process, rtol=1e-5)
    assert_reads_well(text)
    assert re.search(rf"train: 100%.*\| {STEPS}/{STEPS} \[.*loss=", text), text[-2000:]


@pytest.mark.slow
def test_mpirun_two_ranks_give_the_one_process_losses(cluster, one_process, tmp_path):
    run_dir = tmp_path / "run"
    command = ["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe"]
    command += ["-x", "PAISOAR_CPU_DEVICES", "-x", "PYTHONPATH", "-x", "XLA_FLAGS"]
    result = run([*command, *TRAIN, *RUN, "mesh.dcn_data=2", f"run.dir={run_dir}"], tmp_path)
    text = result.stdout + result.stderr
    assert "paisoar_jax: 2 processes (Open MPI)" in text
    np.testing.assert_allclose(losses(run_dir), one_process, rtol=1e-5)
    assert_reads_well(text)


def docs_sbatch_script():
    """The sbatch script of docs/multihost.md's 'to try on one machine', as it is written."""
    text = (REPO / "docs" / "multihost.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    [script] = [block for block in blocks if "--job-name=paisoar-try" in block]
    return script


def job_state(job_id):
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    match = re.search(r"JobState=(\w+)", shown.stdout)
    return match.group(1) if match else "GONE"


def wait_for(condition, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_the_docs_sbatch_script_is_preempted_requeued_and_resumes(cluster, srun_job, tmp_path):
    """sbatch the docs' script; SIGTERM to its tasks after step 4 is saved (what
    `--signal=TERM@120` or a preemption sends); both save and exit; `scontrol requeue`
    runs it again, and it ends with the losses of the srun job that was never stopped."""
    script, run_dir, log = tmp_path / "try.sbatch", tmp_path / "run", tmp_path / "job.out"
    script.write_text(docs_sbatch_script())
    submit = ["sbatch", "--parsable", f"--output={log}", str(script), *RUN, f"run.dir={run_dir}"]
    env = subprocess_env()  # the script sets PAISOAR_CPU_DEVICES itself
    job_id = run(submit, tmp_path, env=env).stdout.strip().split(";")[0]
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "4").is_dir(), "the checkpoint of step 4")
        run(["scancel", "--signal=TERM", job_id], tmp_path)
        wait_for(lambda: job_state(job_id) == "COMPLETED", "the stopped job to complete")
        stopped = re.search(r"stopped by SIGTERM after step (\d+); saved", log.read_text())
        assert stopped, log.read_text()[-3000:]
        assert int(stopped.group(1)) < STEPS
        run(["scontrol", "requeue", job_id], tmp_path)  # (it waits cred_expire, 10 s here)
        wait_for(lambda: "done:" in log.read_text(), "the requeued job to finish")
        wait_for(lambda: job_state(job_id) == "COMPLETED", "the requeued job to complete")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    text = log.read_text()
    assert f"resumed from step {stopped.group(1)}" in text, text[-3000:]
    assert losses(run_dir) == losses(srun_job[0])  # bit for bit: the same two tasks
    assert_reads_well(text)


@pytest.mark.slow
def test_a_shell_in_an_allocation_trains_alone_and_says_so(cluster, tmp_path):
    """`salloc -n 2 python -m paisoar_jax.train`: SLURM_NTASKS=2 without a rank (jax#30073)."""
    run_dir = tmp_path / "run"
    command = ["salloc", "-n", "2", *TRAIN, *RUN, "train.steps=2", f"run.dir={run_dir}"]
    result = run(command, tmp_path, env=subprocess_env())
    note = re.search(
        r"paisoar_jax: inside SLURM job \d+ but not started by srun \(no SLURM_PROCID\): one "
        r"process trains here; `srun python -m \.\.\.` starts the job's 2 tasks",
        result.stdout,
    )
    assert note, result.stdout + result.stderr[-2000:]
    assert "8 cpu devices" in result.stdout  # one process, the machine's devices
