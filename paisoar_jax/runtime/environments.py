"""Where a process learns its place in a job: one row per source, first match wins.

    launcher   PAISOAR_COORDINATOR, PAISOAR_NUM_PROCESSES, PAISOAR_PROCESS_ID
               (set by `python -m paisoar_jax.launch`)
    SLURM      srun's SLURM_* variables, read by jax's own cluster detection (not when
               mpirun started the process inside an allocation: then Open MPI's ranks count)
    Open MPI   mpirun's OMPI_* variables, read by jax's own detection (Open MPI 4); for
               Open MPI 5 the ranks are mapped here and the coordinator must be given
    torchrun   MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (also PyTorchJob)
    Kubeflow   JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (Kubeflow
               Trainer's jax-distributed runtime injects them; anything may set them)
    JobSet     JOBSET_NAME, REPLICATED_JOB_NAME, JOB_GLOBAL_INDEX, GLOBAL_REPLICAS and
               JOB_COMPLETION_INDEX: the coordinator is pod 0's name under the JobSet's
               headless service, <jobset>-<job>-0-0.<jobset> (JAX_NUM_PROCESSES when a
               job has several pods; one pod a job otherwise)
    indexed Job  JOB_COMPLETION_INDEX is the rank; the manifest gives JAX_NUM_PROCESSES
               and JAX_COORDINATOR_ADDRESS (pod 0's name under its headless service)
    SkyPilot   SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS (the first is
               the coordinator's host): one process a node
    Ray Train  a worker of Ray Train (JaxTrainer's train_loop_per_worker): its context's
               world size and rank; rank 0 picks the coordinator and Ray broadcasts it, or
               JaxConfig has joined the processes already (runtime/ray_train.py)

A source that names only the coordinator's host takes the port from JAX_COORDINATOR_PORT,
else DEFAULT_PORT. distributed.py resolves the plan (the config's fields override) and
starts jax.distributed once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from paisoar_jax import output
from paisoar_jax.errors import UserError

COORDINATOR = "PAISOAR_COORDINATOR"
NUM_PROCESSES = "PAISOAR_NUM_PROCESSES"
PROCESS_ID = "PAISOAR_PROCESS_ID"
CPU_DEVICES = "PAISOAR_CPU_DEVICES"
LOCAL_DEVICE_IDS = "PAISOAR_LOCAL_DEVICE_IDS"
TIMEOUT = "PAISOAR_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300
# The variables jax's SlurmCluster needs; srun sets them all (a bare sbatch script does not).
SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
OPENMPI_4_URI = "OMPI_MCA_orte_hnp_uri"


@dataclass(frozen=True)
class Plan:
    """What jax.distributed.initialize gets, and where each part came from."""

    source: str  # config, single, or the row of SOURCES that matched
    num_processes: int
    process_id: int
    coordinator: str | None = None  # None: jax's cluster detection picks it
    coordinator_origin: str = ""  # for messages: "from PAISOAR_COORDINATOR"
    local_device_ids: tuple[int, ...] | None = None
    cluster_detection: str = "deactivate"  # jax's cluster_detection_method
    cpu_devices: int | None = None
    timeout_s: int = DEFAULT_TIMEOUT_S
    joined: bool = False  # the process group is already started (Ray Train's JaxConfig)

    @property
    def multi_process(self) -> bool:
        """Whether jax.distributed must be started at all."""
        return self.num_processes > 1


def integer(environ: Mapping[str, str], name: str) -> int:
    """An integer environment variable, or one line naming it."""
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not an integer") from None


def device_ids(text: str, name: str) -> tuple[int, ...] | None:
    """`0,1,3` -> (0, 1, 3); empty -> None."""
    if not text.strip():
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"{name}={text!r} is not a comma-separated list of device ids") from None


def _launcher_plan(environ: Mapping[str, str]) -> Plan | None:
    """PAISOAR_* variables (python -m paisoar_jax.launch, or set by hand)."""
    if NUM_PROCESSES not in environ and PROCESS_ID not in environ:
        return None
    for name in (NUM_PROCESSES, PROCESS_ID):
        if name not in environ:
            other = PROCESS_ID if name == NUM_PROCESSES else NUM_PROCESSES
            raise UserError(f"{other} is set but {name} is missing")
    return Plan(
        "launcher",
        integer(environ, NUM_PROCESSES),
        integer(environ, PROCESS_ID),
        environ.get(COORDINATOR),
        f"from {COORDINATOR}",
        device_ids(environ.get(LOCAL_DEVICE_IDS, ""), LOCAL_DEVICE_IDS),
    )


def _slurm_plan(environ: Mapping[str, str]) -> Plan | None:
    """An srun step: jax reads the coordinator (first node) and the ranks itself."""
    if not all(name in environ for name in SLURM_VARIABLES):
        _say_outside_srun(environ)
        return None
    if "OMPI_COMM_WORLD_RANK" in environ:
        # mpirun inside an allocation starts its daemons with srun: their SLURM_* variables
        # count nodes, not ranks, and the ranks are Open MPI's (jax checks Open MPI first too).
        return None
    return Plan(
        "SLURM",
        integer(environ, "SLURM_NTASKS"),
        integer(environ, "SLURM_PROCID"),
        coordinator_origin="chosen by jax from SLURM_STEP_NODELIST and SLURM_JOB_ID",
        local_device_ids=None,
        cluster_detection="slurm",
    )


def _say_outside_srun(environ: Mapping[str, str]) -> None:
    """A shell in an allocation (salloc, sbatch's own script) has SLURM_NTASKS without a rank.

    jax's own detection would start a job of SLURM_NTASKS processes there and wait for
    peers that never come (jax#30073); this process trains alone, and says so once.
    """
    tasks = environ.get("SLURM_NTASKS", "1")
    if "SLURM_JOB_ID" not in environ or "SLURM_PROCID" in environ or tasks in ("", "1"):
        return
    if "OMPI_COMM_WORLD_SIZE" in environ or "WORLD_SIZE" in environ:
        return  # mpirun or torchrun inside the allocation: they give the ranks
    output.note(
        f"inside SLURM job {environ['SLURM_JOB_ID']} but not started by srun (no "
        f"SLURM_PROCID): one process trains here; `srun python -m ...` starts the job's "
        f"{tasks} tasks"
    )


def _openmpi_plan(environ: Mapping[str, str]) -> Plan | None:
    """mpirun: jax detects Open MPI 4; Open MPI 5 needs the coordinator given."""
    if "OMPI_COMM_WORLD_SIZE" not in environ or "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    plan = Plan(
        "Open MPI",
        integer(environ, "OMPI_COMM_WORLD_SIZE"),
        integer(environ, "OMPI_COMM_WORLD_RANK"),
        coordinator_origin=f"chosen by jax from {OPENMPI_4_URI}",
        cluster_detection="ompi",
    )
    if OPENMPI_4_URI in environ:
        return plan
    # Open MPI 5 has no URI to take a coordinator from: map the ranks here instead (one
    # device per process when several share a node, as jax does for Open MPI 4).
    local_size = int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    local_rank = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    return replace(
        plan,
        coordinator_origin="",
        cluster_detection="deactivate",
        local_device_ids=(local_rank,) if local_size > 1 else None,
    )


def _torchrun_plan(environ: Mapping[str, str]) -> Plan | None:
    """The torchrun / PyTorchJob variables, mapped here (jax has no detector for them)."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if not all(name in environ for name in names):
        return None
    port = integer(environ, "MASTER_PORT")
    origin = "from MASTER_ADDR and MASTER_PORT"
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # torchrun's agent already listens on MASTER_PORT (its rendezvous store).
        port, origin = port + 1, "from MASTER_ADDR and MASTER_PORT + 1"
    if "JAX_COORDINATOR_PORT" in environ:
        port, origin = integer(environ, "JAX_COORDINATOR_PORT"), "from JAX_COORDINATOR_PORT"
    local_size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    return Plan(
        "torchrun",
        integer(environ, "WORLD_SIZE"),
        integer(environ, "RANK"),
        f"{environ['MASTER_ADDR']}:{port}",
        origin,
        (local_rank,) if local_size > 1 else None,
    )


DEFAULT_PORT = 8476  # the coordinator's port where a source names only its host


def _port(environ: Mapping[str, str]) -> tuple[int, str]:
    """(port, where it came from) for a coordinator whose host alone is known."""
    if "JAX_COORDINATOR_PORT" in environ:
        return integer(environ, "JAX_COORDINATOR_PORT"), "JAX_COORDINATOR_PORT"
    return DEFAULT_PORT, f"port {DEFAULT_PORT}"


def _with_port(address: str, environ: Mapping[str, str]) -> str:
    """`host` -> `host:port` (a port given is kept)."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit():
        return address
    return f"{address}:{_port(environ)[0]}"


def _kubeflow_plan(environ: Mapping[str, str]) -> Plan | None:
    """JAX's own variables, as Kubeflow Trainer's jax-distributed runtime injects them."""
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    if not all(name in environ for name in names):
        return None
    return _jax_variables_plan("Kubeflow", "JAX_PROCESS_ID", environ)


def _jax_variables_plan(source: str, rank: str, environ: Mapping[str, str]) -> Plan:
    """JAX_NUM_PROCESSES processes, this one's rank in `rank`, JAX_COORDINATOR_ADDRESS's."""
    return Plan(
        source,
        integer(environ, "JAX_NUM_PROCESSES"),
        integer(environ, rank),
        _with_port(environ["JAX_COORDINATOR_ADDRESS"], environ),
        "from JAX_COORDINATOR_ADDRESS",
    )


JOBSET_VARIABLES = (
    "JOBSET_NAME",
    "REPLICATED_JOB_NAME",
    "JOB_GLOBAL_INDEX",
    "GLOBAL_REPLICAS",
    "JOB_COMPLETION_INDEX",
)


def _jobset_plan(environ: Mapping[str, str]) -> Plan | None:
    """A JobSet's pod: its rank from the job's and the pod's index; pod 0 coordinates."""
    if not all(name in environ for name in JOBSET_VARIABLES):
        return None
    jobs = integer(environ, "GLOBAL_REPLICAS")
    processes = integer(environ, "JAX_NUM_PROCESSES") if "JAX_NUM_PROCESSES" in environ else jobs
    if processes % jobs:
        raise UserError(
            f"JAX_NUM_PROCESSES={processes} is not a multiple of the JobSet's "
            f"GLOBAL_REPLICAS={jobs} jobs (each job's pods: its parallelism)"
        )
    rank = integer(environ, "JOB_GLOBAL_INDEX") * (processes // jobs)
    rank += integer(environ, "JOB_COMPLETION_INDEX")
    name, job = environ["JOBSET_NAME"], environ["REPLICATED_JOB_NAME"]
    port, port_origin = _port(environ)
    return Plan(
        "JobSet",
        processes,
        rank,
        f"{name}-{job}-0-0.{name}:{port}",
        f"pod 0 of JobSet {name} under its headless service, {port_origin}",
    )


def _indexed_job_plan(environ: Mapping[str, str]) -> Plan | None:
    """A Kubernetes indexed Job's pod: JOB_COMPLETION_INDEX is its rank.

    Without JAX_NUM_PROCESSES each pod trains alone (a sweep's pods, say).
    """
    if "JOB_COMPLETION_INDEX" not in environ or "JAX_NUM_PROCESSES" not in environ:
        return None
    if "JAX_COORDINATOR_ADDRESS" not in environ:
        raise UserError(
            "an indexed Job (JOB_COMPLETION_INDEX) with JAX_NUM_PROCESSES needs "
            "JAX_COORDINATOR_ADDRESS too: pod 0's name under the Job's headless service, "
            "<job>-0.<service>:PORT"
        )
    return _jax_variables_plan("indexed Job", "JOB_COMPLETION_INDEX", environ)


SKYPILOT_VARIABLES = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS")


def skypilot_nodes(environ: Mapping[str, str]) -> tuple[int, int, str, str] | None:
    """A SkyPilot task's nodes: (count, this node's rank, coordinator, where it came from)."""
    if not all(name in environ for name in SKYPILOT_VARIABLES):
        return None
    hosts = environ["SKYPILOT_NODE_IPS"].split()
    nodes, rank = integer(environ, "SKYPILOT_NUM_NODES"), integer(environ, "SKYPILOT_NODE_RANK")
    if len(hosts) != nodes:
        raise UserError(
            f"SKYPILOT_NODE_IPS names {len(hosts)} hosts for SKYPILOT_NUM_NODES={nodes}"
        )
    port, port_origin = _port(environ)
    return nodes, rank, f"{hosts[0]}:{port}", f"the first of SKYPILOT_NODE_IPS, {port_origin}"


def _skypilot_plan(environ: Mapping[str, str]) -> Plan | None:
    """A SkyPilot task's `run:` on each node, without the launcher: one process a node."""
    nodes = skypilot_nodes(environ)
    if nodes is None:
        return None
    count, rank, coordinator, origin = nodes
    return Plan("SkyPilot", count, rank, coordinator, origin)


def _ray_train_plan(environ: Mapping[str, str]) -> Plan | None:
    """A worker of Ray Train (runtime/ray_train.py reads its context)."""
    from paisoar_jax.runtime import ray_train

    world = ray_train.world()
    if world is None:
        return None
    return Plan("Ray Train", **world)


# The environments a process may find itself in, first match wins (see the docstring).
SOURCES = (
    _launcher_plan,
    _slurm_plan,
    _openmpi_plan,
    _torchrun_plan,
    _kubeflow_plan,
    _jobset_plan,
    _indexed_job_plan,
    _skypilot_plan,
    _ray_train_plan,
)
