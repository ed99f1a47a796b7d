"""The slow tier beside tests/end_to_end/test_clusters.py: longer runs, more settings.

Real cluster engines on this machine: SLURM (srun, sbatch, a preemption and a requeue),
Open MPI (mpirun) and a shell in an allocation, each against the one-process losses.
"""

import re
import subprocess

import numpy as np
from conftest import subprocess_env
from test_clusters import (  # noqa: F401 (fixtures)
    RUN,
    STEPS,
    TRAIN,
    assert_reads_well,
    cluster,
    docs_sbatch_script,
    job_state,
    one_process,
    run,
    run_losses,
    srun_job,
    wait_for,
)


def test_srun_two_tasks_give_the_one_process_losses(srun_job, one_process):
    run_dir, text = srun_job
    assert "paisoar_jax: 2 processes (SLURM)" in text
    np.testing.assert_allclose(run_losses(run_dir), one_process, rtol=1e-5)
    assert_reads_well(text)
    assert re.search(rf"train: 100%.*\| {STEPS}/{STEPS} \[.*loss=", text), text[-2000:]


def test_mpirun_two_ranks_give_the_one_process_losses(cluster, one_process, tmp_path):
    run_dir = tmp_path / "run"
    command = ["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe"]
    command += ["-x", "PAISOAR_CPU_DEVICES", "-x", "PYTHONPATH", "-x", "XLA_FLAGS"]
    result = run([*command, *TRAIN, *RUN, "mesh.dcn_data=2", f"run.dir={run_dir}"], tmp_path)
    text = result.stdout + result.stderr
    assert "paisoar_jax: 2 processes (Open MPI)" in text
    np.testing.assert_allclose(run_losses(run_dir), one_process, rtol=1e-5)
    assert_reads_well(text)


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
    assert run_losses(run_dir) == run_losses(srun_job[0])  # bit for bit: the same two tasks
    assert_reads_well(text)


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
