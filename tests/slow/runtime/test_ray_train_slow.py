"""Ray Train (runtime/ray_train.py, ray_job.py) on a real local Ray cluster.

`ray start --head` with 2 CPUs; JaxTrainer runs 2 workers of 1 CPU and 4 simulated devices
each: a user's `fit` call, placed as it is in train_loop_per_worker, joins the job by
itself and learns as one process on 8 devices does; the command line's run does too, and
a worker killed mid-run is restarted by Ray (FailureConfig) and the run ends with the
uninterrupted losses.
"""

import json
import os
import pathlib
import signal
import subprocess
import threading
import time

import pytest
import ray  # noqa: E402  (the test extra installs it)
from conftest import PYTHON, REPO, RESUMABLE, run_records, train

from paisoar_jax.config import load_config
from paisoar_jax.runtime.ports import free_port

SETTINGS = [*RESUMABLE, "train.steps=10", "checkpoint.every=4"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The address of a local Ray cluster whose workers see 4 CPU devices each."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="", PAISOAR_CPU_DEVICES="4")
    # the workers unpickle this module's functions by name
    paths = [REPO, REPO / "tests", pathlib.Path(__file__).parent, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    ray_bin = [PYTHON, "-m", "ray.scripts.scripts"]
    start = [*ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2"]
    start += ["--disable-usage-stats", "--include-dashboard=false"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([*ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


def fit_in_a_worker(config):
    """A user's train_loop_per_worker: their fit call as it is, the run on Ray's storage."""
    import paisoar_jax
    from paisoar_jax.runtime import ray_train

    pids = pathlib.Path(config["pids"])
    pids.mkdir(exist_ok=True)
    rank = ray.train.get_context().get_world_rank()
    (pids / f"rank-{rank}-{os.getpid()}").touch()
    paisoar_jax.fit(None, [*config["overrides"], f"run.dir={ray_train.run_dir()}"])


def run_on_ray(cluster, tmp_path, loop, loop_config, kill_at_step=None):
    """Runs JaxTrainer with 2 workers; the records Ray heard of, and the run directory."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback
    from ray.train.v2.jax import JaxTrainer

    heard = tmp_path / "heard.jsonl"

    class Heard(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with heard.open("a") as file:
                file.write(json.dumps(metrics[0]) + "\n")

    run_dir = tmp_path / "storage" / "job" / "run"
    killer = threading.Thread(target=kill_rank_1, args=(tmp_path, run_dir, kill_at_step))
    if kill_at_step:
        killer.start()
    ray.init(address=cluster, ignore_reinit_error=True)
    try:
        JaxTrainer(
            loop,
            train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                storage_path=str(tmp_path / "storage"),
                name="job",
                failure_config=FailureConfig(max_failures=1),
                callbacks=[Heard()],
            ),
        ).fit()
    finally:
        ray.shutdown()
        if kill_at_step:
            killer.join()
    return [json.loads(line) for line in heard.read_text().splitlines()], run_dir


def kill_rank_1(tmp_path, run_dir, step):
    """SIGKILLs the worker of rank 1 once the run has logged `step`."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    [pid] = [p.name.rpartition("-")[2] for p in (tmp_path / "pids").glob("rank-1-*")]
    os.kill(int(pid), signal.SIGKILL)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The losses of the same run in one process on 8 devices."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(load_config(None, [*SETTINGS, f"run.dir={run_dir}"]))
    return [record["loss"] for record in run_records(run_dir)]


def test_a_fit_call_in_jaxtrainer_learns_as_one_process(cluster, tmp_path, one_process):
    config = {"overrides": SETTINGS, "pids": str(tmp_path / "pids")}
    heard, run_dir = run_on_ray(cluster, tmp_path, fit_in_a_worker, config)
    records = run_records(run_dir)
    assert records[0]["process_count"] == 2 and records[0]["device_count"] == 8
    assert [r["loss"] for r in records] == pytest.approx(one_process, rel=1e-6)
    assert [r["step"] for r in heard] == list(range(1, 11))  # ray.train.report, each log
    assert [r["loss"] for r in heard] == [r["loss"] for r in records]


def test_a_killed_worker_is_restarted_by_ray_and_the_run_ends_as_if_uncut(
    cluster, tmp_path, one_process
):
    """The command line's run (ray_job.train_loop); rank 1 killed after step 6 (saved: 4)."""
    from paisoar_jax.ray_job import train_loop

    def loop(config):
        pids = pathlib.Path(config["pids"])
        pids.mkdir(exist_ok=True)
        rank = ray.train.get_context().get_world_rank()
        (pids / f"rank-{rank}-{os.getpid()}").touch()
        train_loop(config)

    config = {"args": SETTINGS, "pids": str(tmp_path / "pids")}
    _, run_dir = run_on_ray(cluster, tmp_path, loop, config, kill_at_step=6)
    assert len(list((tmp_path / "pids").glob("rank-1-*"))) == 2  # Ray started it again
    by_step = {r["step"]: r["loss"] for r in run_records(run_dir)}  # the resumed run's last
    assert [by_step[step] for step in range(1, 11)] == pytest.approx(one_process, rel=1e-6)
