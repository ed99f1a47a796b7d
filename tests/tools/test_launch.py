"""`python -m paisoar_jax.launch` with real processes on 127.0.0.1 (CPU, gloo collectives)."""

import collections
import errno
import io
import json
import re
import shutil
import subprocess
import time

import jax
import numpy as np
import pytest
from conftest import PYTHON, RESUMABLE, build_run, losses, subprocess_env

from paisoar_jax.data.pipeline import batch_dataset
from paisoar_jax.data.sources import open_source
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding
from paisoar_jax.runtime import heartbeat
from paisoar_jax.runtime.ports import free_port
from paisoar_jax.tools.launch import command as launch
from paisoar_jax.tools.launch.rank_output import Output, RankLog, copy_lines

RUN = RESUMABLE
TWO_PROCESSES = ["--nproc", "2", "--devices-per-proc", "4", "--grace", "5"]


def run_launcher(*arguments, timeout=240):
    return subprocess.run(
        [PYTHON, "-m", "paisoar_jax.launch", *arguments],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_two(run_dir, *overrides):
    result = run_launcher(
        *TWO_PROCESSES, "--", *RUN, "mesh.dcn_data=2", f"run.dir={run_dir}", *overrides
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_one(run_dir, *overrides, timeout=240):
    result = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.train", *RUN, f"run.dir={run_dir}", *overrides],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def checkpoint_steps(run_dir):
    """The complete checkpoint steps (a save in flight has a temporary name)."""
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def cut_at_step_two(source, target):
    """A copy of a finished run directory as if it had stopped after saving step 2."""
    shutil.copytree(source, target)
    for step in checkpoint_steps(target):
        if step > 2:
            shutil.rmtree(target / "checkpoints" / str(step))
    return target


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    # With the closing sample: decoded over both processes' devices, read by each.
    result = train_two(run_dir, "train.steps=5", "run.tensorboard=true", "train.sample_bytes=8")
    return run_dir, result


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The reference: the same run in one process with 8 devices, through the same CLI."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train_one(run_dir, "train.steps=5")
    return run_dir


def assert_same_losses(run_dir, reference_dir, from_step=1):
    """The logged losses of two runs agree from `from_step` on (a reduction order apart)."""
    logged, reference = losses(run_dir), losses(reference_dir)
    assert list(logged) == list(reference) == [1, 2, 3, 4, 5]
    steps = [step for step in logged if step >= from_step]
    # Exact with jax 0.10; other versions may reduce in another order (about 1e-7 apart).
    np.testing.assert_allclose(
        [logged[step] for step in steps], [reference[step] for step in steps], rtol=1e-5
    )


def one_process_reference(devices, steps, overrides=()):
    """Step metrics of one process with 8 devices, fed the global sampler's batches."""
    config, mesh, _, state, train_step = build_run([*RUN, *overrides], devices)
    source, _ = open_source(config.data, config.model, config.train.seed)
    reader = batch_dataset(source, global_batch=config.train.global_batch, seed=config.train.seed)
    result = []
    with jax.set_mesh(mesh):
        for _ in range(steps):
            batch = jax.device_put(next(reader), sharding.batch_sharding(mesh))
            state, metrics = train_step(state, batch)
            result.append({name: float(value) for name, value in metrics.items()})
    return result


def test_two_processes_train_like_one_process_with_eight_devices(two_process_run, one_process_run):
    run_dir, result = two_process_run
    assert_same_losses(run_dir, one_process_run)  # the same data order, no batches by hand
    # Only process 0 writes logs, metrics, TensorBoard and the config; both write checkpoints.
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert (run_dir / "config.yaml").is_file()
    assert checkpoint_steps(run_dir) == [2, 4, 5]
    rank_one = [line for line in result.stdout.splitlines() if line.startswith("[rank 1]")]
    assert not [line for line in rank_one if "paisoar_jax" in line], rank_one
    assert "[rank 0] paisoar_jax: done: 5 steps" in result.stdout
    assert "[rank 0] sample:" in result.stdout
    assert "mesh {'data': 8, 'fsdp': 1, 'tensor': 1}" in result.stdout


def test_the_doctor_says_processes_on_cpus_are_slow_by_nature(two_process_run, one_process_run):
    """Before: 2 processes x 4 devices took 17x the step of 1 x 8, and `no findings`."""
    from paisoar_jax.tools.doctor import command as doctor

    run_dir, _ = two_process_run
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert (record["process_count"], record["device_count"], record["platform"]) == (2, 8, "cpu")
    found = {one.name: one for one in doctor.diagnose(doctor.load_run(run_dir))}
    finding = found["poor-scaling"]
    assert finding.evidence.startswith("2 processes on CPUs: each step's collectives cross")
    assert finding.fixes[0].startswith("expected on CPUs: one process with all the devices")
    alone = {one.name for one in doctor.diagnose(doctor.load_run(one_process_run))}
    assert "poor-scaling" not in alone


def test_checkpoint_of_two_processes_resumes_in_one(two_process_run, one_process_run, tmp_path):
    run_dir, _ = two_process_run
    resumed = cut_at_step_two(run_dir, tmp_path / "run")
    result = train_one(resumed, "train.steps=5")
    assert "resumed from step 2" in result.stdout
    assert "input" not in result.stderr  # nothing to say: the input keeps its place
    assert_same_losses(resumed, one_process_run)  # the uninterrupted run's, from step 3 on
    assert checkpoint_steps(resumed) == [2, 4, 5]


def wait_for_text(path, pattern, process, timeout=180):
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text()):
        assert process.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return re.search(pattern, path.read_text())


def start_launcher(log, run_dir):
    """A long 2-process run in the background, its output going to `log`."""
    with log.open("w") as output:
        return subprocess.Popen(
            [PYTHON, "-m", "paisoar_jax.launch", *TWO_PROCESSES, "--", *RUN]
            + ["mesh.dcn_data=2", "train.steps=100000", "checkpoint.every=0", f"run.dir={run_dir}"],
            env=subprocess_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def stop_for_sure(process):
    if process.poll() is None:
        process.kill()
        process.wait()


def test_only_a_rank_whose_beats_stopped_is_judged(tmp_path):
    def child(rank, beat):
        path = tmp_path / f"rank-{rank}.json"
        if beat is not None:
            path.write_text(json.dumps(beat))
        process = subprocess.Popen(["sleep", "30"])
        return launch.Child(rank, process, path)

    now = time.time()
    children = [
        child(0, {"time": now, "step": 5}),
        child(1, None),  # never beat: still importing, or a script without paisoar_jax
        child(2, {"time": now - 100, "step": 3, "exiting": True}),  # tearing down
    ]
    try:
        assert launch._stalled(children, older_than=10) is None
        children.append(child(3, {"time": now - 60, "step": 4}))
        assert launch._stalled(children, older_than=10) is children[3]
        assert launch._stalled(children, older_than=120) is None
    finally:
        for each in children:
            each.process.kill()
            each.process.wait()


def test_an_exiting_process_says_so_in_its_last_beat(tmp_path):
    beat = tmp_path / "beat.json"
    script = (
        "from paisoar_jax.runtime import heartbeat; import time; heartbeat.start(); time.sleep(1.5)"
    )
    env = {**subprocess_env(), heartbeat.HEARTBEAT_FILE: str(beat)}
    subprocess.run([PYTHON, "-c", script], env=env, check=True, timeout=60)
    last = heartbeat.read(beat)
    assert last["exiting"] is True and last["pid"] > 0


def test_a_failing_log_file_is_dropped_and_output_keeps_flowing(tmp_path):
    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    log, screen, output = RankLog(), io.BytesIO(), Output()
    log.open(tmp_path / "logs" / "rank-0.log")
    output.write(screen, log, b"one\n")
    log.file = FullDisk()
    output.write(screen, log, b"two\n")  # no exception: the pipe behind it must drain
    output.write(screen, log, b"three\n")
    assert screen.getvalue() == b"one\ntwo\nthree\n"
    assert log.failed and log.file is None
    assert (tmp_path / "logs" / "rank-0.log").read_bytes() == b"one\n"


def test_an_unreachable_coordinator_is_one_clear_line():
    port = free_port()
    start = time.monotonic()
    result = run_launcher(
        "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
        "--coordinator", f"127.0.0.1:{port}", "--timeout", "3",
        "--", "run.dir=unused", timeout=90,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert time.monotonic() - start < 60
    expected = (
        f"paisoar_jax.train: error: could not reach the coordinator 127.0.0.1:{port} "
        "within 3 s (from PAISOAR_COORDINATOR; last error: Connection refused)"
    )
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    # Said once, though every rank finds it (issue 68: each rank printed the same line).
    assert len(errors) == 1 and errors[0].endswith(expected), result.stderr
    assert "Traceback" not in result.stderr
    assert "[rank 2]" in result.stderr or "[rank 3]" in result.stderr  # node 1's ranks


def test_peers_that_never_join_are_one_clear_line(tmp_path):
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "paisoar_jax.train",
            f"distributed.coordinator=127.0.0.1:{free_port()}",
            "distributed.num_processes=2",
            "distributed.process_id=0",
            "distributed.timeout_s=2",
            f"run.dir={tmp_path}",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("paisoar_jax.train: error: process 0 of 2 waited 2 s for all processes to join")
    )


def test_child_environments_give_ranks_and_devices():
    args = launch.parse_arguments(
        ["--nproc", "2", "--devices-per-proc", "4", "--nnodes", "2", "--node-rank", "1",
         "--coordinator", "head:1234", "--", "train.steps=3"]
    )  # fmt: skip
    assert args.arguments == ["train.steps=3"]
    cpu = launch.child_environments(args, {"PATH": "/bin"}, gpu_count=0, coordinator="head:1234")
    assert [env["PAISOAR_PROCESS_ID"] for env in cpu] == ["2", "3"]
    assert {env["PAISOAR_NUM_PROCESSES"] for env in cpu} == {"4"}
    assert {env["PAISOAR_CPU_DEVICES"] for env in cpu} == {"4"}
    assert {env["PAISOAR_COORDINATOR"] for env in cpu} == {"head:1234"}
    gpu_args = launch.parse_arguments(["--nproc", "4", "train.steps=3"])
    gpu = launch.child_environments(gpu_args, {}, gpu_count=8, coordinator="127.0.0.1:5")
    assert [env["PAISOAR_LOCAL_DEVICE_IDS"] for env in gpu] == ["0,1", "2,3", "4,5", "6,7"]
    assert all("PAISOAR_CPU_DEVICES" not in env for env in gpu)
    cpu_only = launch.child_environments(gpu_args, {"JAX_PLATFORMS": "cpu"}, 8, "127.0.0.1:5")
    assert all("PAISOAR_LOCAL_DEVICE_IDS" not in env for env in cpu_only)
    with pytest.raises(UserError, match="4 processes x 3 GPUs do not fit the 8 GPUs"):
        gpu_args.devices_per_proc = 3
        launch.child_environments(gpu_args, {}, gpu_count=8, coordinator="127.0.0.1:5")
    assert launch.local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,3"}) == 2
    assert launch.local_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_a_skypilot_node_gives_the_launcher_its_nodes_rank_and_coordinator():
    sky = {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8",
    }
    args = launch.parse_arguments(["--nproc", "8"], {**sky, "JAX_COORDINATOR_PORT": "7000"})
    assert (args.nnodes, args.node_rank, args.coordinator) == (2, 1, "10.0.0.7:7000")
    given = launch.parse_arguments(["--nproc", "8", "--coordinator", "head:1"], sky)
    assert given.coordinator == "head:1"  # what is given wins
    alone = launch.parse_arguments(["--nproc", "8"], {})
    assert (alone.nnodes, alone.node_rank, alone.coordinator) == (1, 0, None)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "2", "--nnodes", "2"], "needs --coordinator"),
        (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"], "not in"),
    ],
)
def test_bad_launcher_arguments(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_arguments(arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_json_lines_of_a_rank_carry_its_rank_instead_of_a_prefix(monkeypatch):
    monkeypatch.setenv("PAISOAR_OUTPUT", "json")
    stream = io.BytesIO(b'{"level": "note", "message": "hi"}\nplain text\n')
    screen, tail = io.BytesIO(), collections.deque(maxlen=4)
    copy_lines(stream, screen, b"[rank 3] ", RankLog(), tail, Output())
    first, second = screen.getvalue().decode().splitlines()
    assert json.loads(first) == {"rank": 3, "level": "note", "message": "hi"}
    assert second == "[rank 3] plain text"


@pytest.mark.parametrize("mode", ["quiet", "json"])
def test_a_bad_launch_is_one_error_line_in_every_mode(mode):
    environment = {**subprocess_env(), "PAISOAR_OUTPUT": mode}
    command = [PYTHON, "-m", "paisoar_jax.launch", "--nproc", "2", "--", "python"]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "-- python needs a script (or -m MODULE) to run" in lines[0]
    if mode == "json":
        assert json.loads(lines[0])["level"] == "error"


TWO_PROCESS_SCRIPT = """
import os, sys
import numpy as np, optax, paisoar_jax
from flax import nnx

rank = int(os.environ["PAISOAR_PROCESS_ID"])
seed = rank if os.environ["CASE"] == "different" else 0  # different: each process its own!
x = np.random.default_rng(seed).normal(size=(64, 8)).astype(np.float32)
x[7, 3] = np.nan if os.environ["CASE"] == "nan" else x[7, 3]
y = (x[:, 0] > 0).astype(np.int32)
if os.environ["CASE"] == "early":  # jax used before fit joins the processes
    import jax; print(jax.device_count())

def loss(model, batch, rng):
    logits = model(batch["x"]).astype(np.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

paisoar_jax.fit(None, sys.argv[1:], model=lambda rngs: nnx.Linear(8, 2, rngs=rngs), loss=loss,
                data={"x": x, "y": y}, optimizer=optax.adam(1e-2))
"""


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("different", "the processes were given different train data: process 1's has 64"),
        ("nan", "holds non-finite values ("),  # one process reads the row; both stop
        ("early", "call paisoar_jax.initialize() at the top of the script"),
    ],
)
def test_bad_data_on_two_processes_stops_both_with_one_line(case, expected, tmp_path):
    """Before: two processes handed different arrays each trained on their rows of their
    own; a nan row was a divergence (or, under fp16, skipped steps) on every process."""
    script = tmp_path / "script.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    arguments = ["--nproc", "2", "--devices-per-proc", "1", "--grace", "5", "--", "python"]
    arguments += [str(script), "train.steps=8", "train.global_batch=8", "train.log_every=4"]
    result = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.launch", *arguments, f"run.dir={tmp_path}/run"],
        env={**subprocess_env(), "CASE": case},
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    # Each process stops with its line, none hangs; the same line from both is said once.
    errors = [line.split("] ", 1)[-1] for line in output.splitlines() if ": error: " in line]
    assert errors and len(errors) == len(set(errors)), output[-3000:]
    assert "stopping 0 other process(es)" in output, output[-3000:]
    assert expected in output
