"""Multi-process start-up: `jax.distributed.initialize` from the config or the environment.

The config's distributed.coordinator, .num_processes and .process_id (all three set) come
first; else the first environment of runtime/environments.py's table that matches (the
launcher, SLURM, Open MPI, torchrun, Kubeflow, JobSet, an indexed Job, SkyPilot, Ray
Train); none: one process, jax.distributed is not started.

Config fields that are set override the environment's value for that field.
PAISOAR_COORDINATOR on its own overrides the coordinator of any source;
PAISOAR_CPU_DEVICES=K gives each process K CPU devices (simulated hosts for tests);
PAISOAR_LOCAL_DEVICE_IDS restricts a process to some of its node's GPUs.

A process that cannot reach the coordinator, or whose peers do not all join within the
timeout, stops with one line naming the address and where it came from (exit status 2),
rather than jax's abort after a stack dump.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import replace

from paisoar_jax import output
from paisoar_jax.config import DistributedConfig
from paisoar_jax.errors import USER_ERROR_EXIT_CODE, UserError
from paisoar_jax.runtime import chatter, heartbeat
from paisoar_jax.runtime.environments import (
    COORDINATOR,
    CPU_DEVICES,
    DEFAULT_TIMEOUT_S,
    LOCAL_DEVICE_IDS,
    NUM_PROCESSES,
    PROCESS_ID,
    SOURCES,
    TIMEOUT,
    Plan,
    device_ids,
    integer,
)

__all__ = ["COORDINATOR", "CPU_DEVICES", "LOCAL_DEVICE_IDS", "NUM_PROCESSES", "PROCESS_ID"]
__all__ += ["TIMEOUT", "Plan", "initialize", "joined", "resolve", "split_address"]

# jax's timeout must outlast ours, so that our one-line error comes before its abort.
JAX_TIMEOUT_MARGIN_S = 30
# Every rank of a script that used jax before fit (or initialize) says this: status 2, and
# the launcher does not restart what would fail the same way.
JAX_USED_FIRST = (
    "jax was used before this process joined the others (jax.devices(), an array, a model "
    "built eagerly); call paisoar_jax.initialize() at the top of the script, before anything "
    "touches jax"
)


def resolve(settings: DistributedConfig, environ: Mapping[str, str]) -> Plan:
    """The plan for this process: explicit config, else the first environment that matches."""
    explicit = {
        "coordinator": settings.coordinator or None,
        "num_processes": settings.num_processes or None,
        "process_id": settings.process_id if settings.process_id >= 0 else None,
    }
    if None not in explicit.values():
        plan = Plan("config", **explicit, coordinator_origin="from distributed.coordinator")
    else:
        plan = next(filter(None, (detect(environ) for detect in SOURCES)), None)
        if plan is None:
            plan = Plan("single", 1, 0)
            given = [f"distributed.{key}" for key, value in explicit.items() if value is not None]
            if given and explicit["num_processes"] != 1:
                wanted = [f"distributed.{key}" for key, value in explicit.items() if value is None]
                raise UserError(
                    f"{', '.join(given)} set but {' and '.join(wanted)} missing, and no "
                    "launcher, cluster or cloud environment provides them"
                )
        if COORDINATOR in environ and plan.source != "launcher":
            plan = replace(plan, coordinator=environ[COORDINATOR])
            plan = replace(plan, coordinator_origin=f"from {COORDINATOR}")
        overrides = {key: value for key, value in explicit.items() if value is not None}
        if "coordinator" in overrides:
            overrides["coordinator_origin"] = "from distributed.coordinator"
        plan = replace(plan, **overrides)
    local_ids = device_ids(settings.local_device_ids, "distributed.local_device_ids")
    timeout_s = settings.timeout_s or (
        integer(environ, TIMEOUT) if TIMEOUT in environ else DEFAULT_TIMEOUT_S
    )
    plan = replace(
        plan,
        local_device_ids=local_ids or plan.local_device_ids,
        cpu_devices=integer(environ, CPU_DEVICES) if CPU_DEVICES in environ else None,
        timeout_s=timeout_s,
    )
    _check(plan)
    return plan


def _check(plan: Plan) -> None:
    """One line for a plan that cannot work: bad ranks, a malformed or missing address."""
    if plan.num_processes < 1:
        raise UserError(f"{plan.source}: the number of processes must be >= 1")
    if not 0 <= plan.process_id < plan.num_processes:
        raise UserError(
            f"{plan.source}: process id {plan.process_id} is not in 0 .. {plan.num_processes - 1}"
        )
    if plan.timeout_s < 1:
        raise UserError(f"the distributed start-up timeout must be >= 1 s, got {plan.timeout_s}")
    if plan.cpu_devices is not None and plan.cpu_devices < 1:
        raise UserError(f"{CPU_DEVICES} must be >= 1, got {plan.cpu_devices}")
    if not plan.multi_process:
        return
    if plan.coordinator is None and plan.cluster_detection == "deactivate" and not plan.joined:
        raise UserError(
            f"{plan.source} gives {plan.num_processes} processes but no coordinator address: "
            f"set distributed.coordinator=HOST:PORT or {COORDINATOR} (a free port on the "
            "host of process 0)"
        )
    if plan.coordinator is not None:
        split_address(plan.coordinator, plan.coordinator_origin)


def split_address(address: str, origin: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) -> (host, port), or one line naming the bad address."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"coordinator address {address!r} ({origin}) is not HOST:PORT")
    return host.strip("[]"), int(port)


def initialize(
    settings: DistributedConfig,
    program: str = "paisoar_jax",
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Starts jax.distributed as the config or the environment says; returns the plan used.

    Must run before anything touches the devices. A single-process plan only applies
    PAISOAR_CPU_DEVICES. Waits at most the plan's timeout for the other processes.
    """
    environ = os.environ if environ is None else environ
    plan = resolve(settings, environ)
    import jax

    started = _jax_in_use()
    # Each rank says so at once, before the join (none waits for a rank 0 that never joins).
    if started and plan.multi_process and not jax.distributed.is_initialized():
        raise UserError(JAX_USED_FIRST)
    if plan.cpu_devices is not None and not started:
        jax.config.update("jax_num_cpu_devices", plan.cpu_devices)
    elif plan.cpu_devices is not None and jax.local_device_count() != plan.cpu_devices:
        raise UserError(JAX_USED_FIRST)  # too late to set the device count
    if not plan.multi_process or jax.distributed.is_initialized():
        return plan
    heartbeat.start(environ)  # under the launcher: beats from before the (long) join
    deadline = time.monotonic() + plan.timeout_s
    _probe_coordinator(plan, deadline)
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0), _give_up, (plan, program))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=plan.coordinator,
            num_processes=plan.num_processes,
            process_id=plan.process_id,
            local_device_ids=list(plan.local_device_ids) if plan.local_device_ids else None,
            cluster_detection_method=plan.cluster_detection,
            initialization_timeout=plan.timeout_s + JAX_TIMEOUT_MARGIN_S,
            **_peer_timeout(plan, environ, jax.distributed.initialize),
        )
    except RuntimeError as error:
        if "must be called before" not in str(error):
            raise
        raise UserError(JAX_USED_FIRST) from None  # (a jax without the check above)
    finally:
        watchdog.cancel()
    if jax.default_backend() == "cpu" and not environ.get(heartbeat.HEARTBEAT_FILE):
        chatter.filter_stdout()  # srun, mpirun: no launcher keeps gloo's lines off the log
    if jax.process_index() == 0:
        output.note(
            f"{jax.process_count()} processes ({plan.source}), coordinator "
            f"{plan.coordinator or 'chosen by jax'}; {jax.device_count()} devices, "
            f"{jax.local_device_count()} per process"
        )
    return plan


def _jax_in_use() -> bool:
    """Whether this process has started jax's backends (devices listed, an array made)."""
    from jax._src import xla_bridge  # no public check; jax 0.10 and later have this one

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def _peer_timeout(plan: Plan, environ: Mapping[str, str], start_jax) -> dict[str, int]:
    """Under the launcher, jax's peer heartbeat waits past the launcher's own stall timeout.

    The launcher names a stalled rank after `--timeout` s without its beats; jax's
    coordination service (100 s by default) would otherwise abort the healthy ranks first.
    """
    parameters = inspect.signature(start_jax).parameters  # jax 0.10 and later versions
    if not environ.get(heartbeat.HEARTBEAT_FILE) or "heartbeat_timeout_seconds" not in parameters:
        return {}
    return {"heartbeat_timeout_seconds": plan.timeout_s + JAX_TIMEOUT_MARGIN_S}


def _give_up(plan: Plan, program: str) -> None:
    """The watchdog: one line and exit status 2 before jax's own abort (a stack dump)."""
    output.error(
        f"process {plan.process_id} of {plan.num_processes} waited "
        f"{plan.timeout_s} s for all processes to join the coordinator "
        f"{plan.coordinator or ''} ({plan.coordinator_origin}): start every process with "
        "the same coordinator and process count, each with its own process id",
        program=program,
    )
    chatter.restore()
    os._exit(USER_ERROR_EXIT_CODE)  # the main thread is blocked inside jax: no clean exit


def _probe_coordinator(plan: Plan, deadline: float) -> None:
    """Fails fast with the address at fault: a busy port on process 0, an unreachable one.

    jax itself would retry until its timeout and then abort the process with a stack dump.
    """
    address = plan.coordinator or _detected_coordinator(plan.cluster_detection)
    if address is None:
        return
    host, port = split_address(address, plan.coordinator_origin)
    if plan.process_id == 0:  # process 0 will listen on this port, on every interface
        with socket.socket() as probe:
            # As the coordinator's server binds (gRPC sets SO_REUSEADDR): the connections of
            # a run that just ended on this port (a requeued job keeps its port) may linger
            # in TIME_WAIT, which only a socket listening there now should fail.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                raise UserError(
                    f"the coordinator port {port} ({plan.coordinator_origin}) is not free on "
                    f"this host, where process 0 runs the coordinator ({error.strerror})"
                ) from None
        return
    reason = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as error:  # refused, unresolvable, unreachable: retried until the end
            reason = error.strerror or str(error) or type(error).__name__
        if time.monotonic() >= deadline:
            raise UserError(
                f"could not reach the coordinator {address} within {plan.timeout_s} s "
                f"({plan.coordinator_origin}; last error: {reason})"
            )
        time.sleep(0.2)


def _detected_coordinator(method: str) -> str | None:
    """The address jax's cluster detection will pick (best effort: a private jax API)."""
    if method == "deactivate":
        return None
    try:
        from jax._src import clusters

        for cluster in clusters.ClusterEnv._cluster_types:
            if cluster.name == method and cluster.is_env_present():
                port = os.environ.get("JAX_COORDINATOR_PORT")
                return cluster.get_coordinator_address(None, port)
    except Exception:  # another jax version: skip the probe, the watchdog still guards
        return None
    return None


def joined() -> bool:
    """Whether this process is part of a started multi-process run."""
    jax = sys.modules.get("jax")  # not imported: certainly not started
    return jax is not None and jax.distributed.is_initialized()


def exit_now(status: int) -> None:
    """Ends this process at once, skipping jax's shutdown barrier (for a failed process).

    At exit jax waits up to 5 minutes for every other process to shut down too. A process
    that failed alone would sit there while its peers block in a collective, and the
    launcher would not see the failure; leaving now lets it (or jax's heartbeat) stop them.
    """
    sys.stdout.flush()
    chatter.restore()  # (flushes stdout and stderr)
    os._exit(status)
