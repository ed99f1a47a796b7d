"""Ray Train: a worker of JaxTrainer joins the job by itself and tells Ray its metrics.

Inside JaxTrainer's `train_loop_per_worker`, `paisoar_jax.fit(...)` or
`paisoar_jax.ray_job.train_loop` (the command line's run) reads the worker's Ray Train
context as SLURM's variables are read (environments.py's "Ray Train" row): the world size
and this worker's rank. Where Ray's
JaxConfig has started jax.distributed already (GPUs, TPUs) the process group is taken as
it is; otherwise (CPU) rank 0 picks the coordinator's address and Ray broadcasts it, and
the library joins the processes once. Each logged record also goes to `ray.train.report`,
beside metrics.jsonl.

`run_dir()` is the run directory on RunConfig's storage (shared by the workers): a worker
that Ray restarts after a failure (FailureConfig) resumes from the newest checkpoint there.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from paisoar_jax.runtime.ports import free_port

RUN_NAME = "run"  # the run directory's name inside the Ray Train run's storage


def context() -> Any | None:
    """This worker's Ray Train context; None outside a Ray Train worker (or without ray)."""
    if "ray" not in sys.modules:  # a Ray worker has imported it: no import cost elsewhere
        return None
    try:
        import ray.train

        found = ray.train.get_context()
        found.get_world_size()
    except Exception:  # the driver, a plain task or actor, an old Ray: not a train worker
        return None
    return found


def world() -> dict[str, Any] | None:
    """The process plan's fields of a Ray Train worker (environments.py), or None."""
    found = context()
    if found is None:
        return None
    size, rank = found.get_world_size(), found.get_world_rank()
    if size == 1:
        return {"num_processes": 1, "process_id": 0}
    import jax

    if jax.distributed.is_initialized():  # Ray's JaxConfig joined them (use_gpu, use_tpu)
        origin = "joined by Ray Train's JaxConfig"
        return {"num_processes": size, "process_id": rank, "coordinator_origin": origin}
    from ray.train.collective import broadcast_from_rank_zero

    address = broadcast_from_rank_zero(_free_address() if rank == 0 else None)
    return {
        "num_processes": size,
        "process_id": rank,
        "coordinator": address,
        "coordinator_origin": "picked by Ray Train's rank 0 and broadcast to the workers",
    }


def _free_address() -> str:
    """HOST:PORT of a port free now on this node (rank 0's), for the coordinator."""
    import ray.util

    return f"{ray.util.get_node_ip_address()}:{free_port('')}"


def report(record: dict[str, Any]) -> None:
    """Hands a logged record to Ray Train (every worker calls it at the same steps)."""
    if context() is None:
        return
    import ray.train

    ray.train.report({name: value for name, value in record.items() if _plain(value)})


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def run_dir() -> pathlib.Path:
    """The run directory on the Ray Train run's storage (RunConfig's storage_path/name)."""
    found = context()
    if found is None:
        raise RuntimeError("run_dir() is for a Ray Train worker (train_loop_per_worker)")
    return pathlib.Path(found.get_storage().experiment_fs_path) / RUN_NAME
