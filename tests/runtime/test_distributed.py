"""Where multi-process settings come from (no jax.distributed started here)."""

import socket
import time

import pytest

from paisoar_jax.config import DistributedConfig
from paisoar_jax.errors import UserError
from paisoar_jax.runtime import distributed

LAUNCHER = {
    "PAISOAR_COORDINATOR": "10.0.0.1:1234",
    "PAISOAR_NUM_PROCESSES": "4",
    "PAISOAR_PROCESS_ID": "3",
}
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "5",
}
OPENMPI = {
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
}
TORCHRUN = {
    "MASTER_ADDR": "10.0.0.9",
    "MASTER_PORT": "29500",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}
EXPLICIT = DistributedConfig(coordinator="10.0.0.5:999", num_processes=3, process_id=2)


def resolve(environ, settings=None):
    return distributed.resolve(settings or DistributedConfig(), environ)


@pytest.mark.parametrize(
    "environ, settings, source",
    [
        ({**LAUNCHER, **SLURM, **OPENMPI, **TORCHRUN}, EXPLICIT, "config"),
        ({**LAUNCHER, **SLURM, **OPENMPI, **TORCHRUN}, DistributedConfig(), "launcher"),
        ({**SLURM, **TORCHRUN}, DistributedConfig(), "SLURM"),
        ({**SLURM, **OPENMPI, **TORCHRUN}, DistributedConfig(), "Open MPI"),  # mpirun in sbatch
        ({**OPENMPI, **TORCHRUN}, DistributedConfig(), "Open MPI"),
        (TORCHRUN, DistributedConfig(), "torchrun"),
        ({"HOME": "/root"}, DistributedConfig(), "single"),
    ],
)
def test_sources_in_order_of_precedence(environ, settings, source):
    assert resolve(environ, settings).source == source


def test_each_source_gives_its_values():
    assert resolve({}, EXPLICIT).coordinator == "10.0.0.5:999"
    launcher = resolve({**LAUNCHER, "PAISOAR_LOCAL_DEVICE_IDS": "2,3"})
    assert (launcher.num_processes, launcher.process_id) == (4, 3)
    assert launcher.coordinator == "10.0.0.1:1234" and launcher.local_device_ids == (2, 3)
    assert launcher.cluster_detection == "deactivate"
    slurm = resolve(SLURM)  # jax detects the coordinator and the local device itself
    assert (slurm.num_processes, slurm.process_id, slurm.coordinator) == (16, 5, None)
    assert slurm.cluster_detection == "slurm"
    openmpi = resolve(OPENMPI)
    assert (openmpi.num_processes, openmpi.process_id, openmpi.cluster_detection) == (8, 2, "ompi")
    torchrun = resolve(TORCHRUN)
    assert (torchrun.num_processes, torchrun.process_id) == (2, 1)
    assert torchrun.coordinator == "10.0.0.9:29500" and torchrun.local_device_ids == (1,)
    single = resolve({})
    assert (single.num_processes, single.process_id, single.multi_process) == (1, 0, False)
    assert single.timeout_s == distributed.DEFAULT_TIMEOUT_S


def test_torchrun_agent_port_and_overrides():
    agent = resolve({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.coordinator == "10.0.0.9:29501"  # torchrun's own store holds MASTER_PORT
    port = resolve({**TORCHRUN, "JAX_COORDINATOR_PORT": "4000"})
    assert port.coordinator == "10.0.0.9:4000"
    alone = resolve({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert alone.local_device_ids is None  # one process per node keeps all its GPUs


def test_open_mpi_5_maps_ranks_and_needs_a_coordinator():
    openmpi_5 = {key: value for key, value in OPENMPI.items() if "orte" not in key}
    openmpi_5["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4"
    with pytest.raises(UserError, match="no coordinator address: set distributed.coordinator"):
        resolve(openmpi_5)
    plan = resolve({**openmpi_5, "PAISOAR_COORDINATOR": "head:5000"})
    assert (plan.coordinator, plan.num_processes, plan.process_id) == ("head:5000", 8, 2)
    assert plan.cluster_detection == "deactivate" and plan.local_device_ids == (2,)


def test_explicit_fields_override_the_environment():
    plan = resolve(SLURM, DistributedConfig(coordinator="head:7000", timeout_s=20))
    assert (plan.source, plan.coordinator, plan.num_processes) == ("SLURM", "head:7000", 16)
    assert plan.coordinator_origin == "from distributed.coordinator" and plan.timeout_s == 20
    plan = resolve(LAUNCHER, DistributedConfig(local_device_ids="0,1"))
    assert plan.local_device_ids == (0, 1)
    assert resolve({**LAUNCHER, "PAISOAR_TIMEOUT_S": "7"}).timeout_s == 7
    assert resolve({**LAUNCHER, "PAISOAR_CPU_DEVICES": "4"}).cpu_devices == 4


@pytest.mark.parametrize(
    "environ, settings, message",
    [
        ({}, DistributedConfig(coordinator="a:1"), "distributed.coordinator set but "),
        ({"PAISOAR_PROCESS_ID": "0"}, DistributedConfig(), "PAISOAR_NUM_PROCESSES is missing"),
        ({**LAUNCHER, "PAISOAR_NUM_PROCESSES": "two"}, DistributedConfig(), "is not an integer"),
        ({**LAUNCHER, "PAISOAR_PROCESS_ID": "4"}, DistributedConfig(), r"not in 0 \.\. 3"),
        ({**LAUNCHER, "PAISOAR_COORDINATOR": "nohost"}, DistributedConfig(), "is not HOST:PORT"),
        ({**LAUNCHER, "PAISOAR_LOCAL_DEVICE_IDS": "0;1"}, DistributedConfig(), "comma-separated"),
        (
            {key: value for key, value in LAUNCHER.items() if key != "PAISOAR_COORDINATOR"},
            DistributedConfig(),
            "launcher gives 4 processes but no coordinator address",
        ),
    ],
)
def test_bad_settings_are_one_line(environ, settings, message):
    with pytest.raises(UserError, match=message):
        resolve(environ, settings)


def test_one_process_needs_no_coordinator():
    plan = resolve({"PAISOAR_NUM_PROCESSES": "1", "PAISOAR_PROCESS_ID": "0"})
    assert plan.source == "launcher" and not plan.multi_process


def test_single_process_initialize_starts_nothing(monkeypatch):
    import jax

    def fail(**kwargs):
        raise AssertionError("jax.distributed.initialize must not run for one process")

    monkeypatch.setattr(jax.distributed, "initialize", fail)
    assert distributed.initialize(DistributedConfig(), environ={}).source == "single"


def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_coordinator_fails_within_the_timeout():
    port = closed_port()
    plan = distributed.Plan(
        "launcher", 2, 1, f"127.0.0.1:{port}", "from PAISOAR_COORDINATOR", timeout_s=1
    )
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        distributed._probe_coordinator(plan, time.monotonic() + plan.timeout_s)
    assert time.monotonic() - start < 5
    assert str(error.value).startswith(
        f"could not reach the coordinator 127.0.0.1:{port} within 1 s (from PAISOAR_COORDINATOR"
    )


def test_process_zero_refuses_a_busy_port():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        plan = distributed.Plan("config", 2, 0, f"127.0.0.1:{port}", "from distributed.coordinator")
        with pytest.raises(UserError, match=f"the coordinator port {port} .* is not free"):
            distributed._probe_coordinator(plan, time.monotonic() + 1)


def test_process_zero_takes_the_port_of_a_run_that_just_ended():
    """A requeued SLURM job keeps its job id, so jax picks the same port: the last run's
    connections on it wait in TIME_WAIT, which the coordinator's server binds over."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's server
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server's end closes first: it waits in TIME_WAIT
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # what the probe did before: refused
    plan = distributed.Plan("config", 2, 0, f"127.0.0.1:{port}", "from distributed.coordinator")
    distributed._probe_coordinator(plan, time.monotonic() + 1)


ALLOCATION_SHELL = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_NODELIST": "node1"}


def test_a_shell_in_an_allocation_is_one_process_with_one_line(capsys):
    """salloc or sbatch's own shell: SLURM_NTASKS without a rank (jax#30073). The real
    thing (salloc on a local SLURM) is in test_clusters.py."""
    plan = distributed.resolve(DistributedConfig(), ALLOCATION_SHELL)
    assert (plan.source, plan.num_processes, plan.process_id) == ("single", 1, 0)
    assert capsys.readouterr().out == (
        "paisoar_jax: inside SLURM job 77 but not started by srun (no SLURM_PROCID): one "
        "process trains here; `srun python -m ...` starts the job's 16 tasks\n"
    )


@pytest.mark.parametrize("starter", [OPENMPI, {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}])
def test_mpirun_in_an_allocation_or_one_task_says_nothing(starter, capsys):
    distributed.resolve(DistributedConfig(), {**ALLOCATION_SHELL, **starter})
    assert capsys.readouterr().out == ""
