"""Real cluster engines on this machine: SLURM (srun, sbatch, a preemption and a requeue),
Open MPI (mpirun) and a shell in an allocation, each against the one-process losses.

scripts/local_slurm.sh starts a single-node SLURM (Debian's slurmctld, slurmd and munge,
installed when missing) and Open MPI; that needs root, which CI has. Each job is two CPU
tasks of four simulated devices, the mesh's data axis across them (mesh.dcn_data=2).
"""

import os
import re
import subprocess
import time

import pytest
from conftest import PYTHON, REPO, RESUMABLE, losses, subprocess_env

STEPS = 12
# run.progress: into a file, the bar must draw lines, not carriage returns.
RUN = [*RESUMABLE, "run.progress=true", f"train.steps={STEPS}"]
TRAIN = [PYTHON, "-m", "paisoar_jax.train"]


def run_losses(run_dir):
    """The losses of steps 1 .. STEPS, in order (one record per step after any resume)."""
    return list(losses(run_dir, STEPS).values())


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
    return run_losses(run_dir)


@pytest.fixture(scope="module")
def srun_job(cluster, tmp_path_factory):
    """`srun -n 2` of the trainer: its run directory and what it printed."""
    run_dir = tmp_path_factory.mktemp("srun") / "run"
    command = ["srun", "-n", "2", "--kill-on-bad-exit=1", *TRAIN, *RUN, "mesh.dcn_data=2"]
    result = run([*command, f"run.dir={run_dir}"], run_dir.parent)
    return run_dir, result.stdout + result.stderr


def docs_sbatch_script():
    """The sbatch script of the multi-host page's "to try on one machine", as written."""
    from doc_blocks import doc_block

    script = doc_block("sbatch-script").text
    assert "--job-name=paisoar-try" in script
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
