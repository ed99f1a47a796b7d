"""runtime/environments.py: each cloud engine's variables give the process its place.

Several processes joined through these rows run in tests/tools/test_launch.py (SkyPilot's
variables, two launchers) and tests/slow/runtime/test_ray_train_slow.py (a real Ray cluster).
"""

import pytest

from paisoar_jax.config import DistributedConfig
from paisoar_jax.errors import UserError
from paisoar_jax.runtime import distributed, environments

KUBEFLOW = {
    "JAX_COORDINATOR_ADDRESS": "job-node-0-0.job:8080",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "3",
}
JOBSET = {
    "JOBSET_NAME": "llm",
    "REPLICATED_JOB_NAME": "workers",
    "JOB_GLOBAL_INDEX": "1",
    "GLOBAL_REPLICAS": "2",
    "JOB_COMPLETION_INDEX": "0",
    "JOB_INDEX": "1",
}
SKYPILOT = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
}


def resolve(environ):
    return distributed.resolve(DistributedConfig(), environ)


def test_each_engine_gives_its_ranks_and_coordinator():
    kubeflow = resolve(KUBEFLOW)
    assert (kubeflow.source, kubeflow.num_processes, kubeflow.process_id) == ("Kubeflow", 4, 3)
    assert kubeflow.coordinator == "job-node-0-0.job:8080"
    jobset = resolve(JOBSET)  # one pod a job: its rank is the job's index
    assert (jobset.source, jobset.num_processes, jobset.process_id) == ("JobSet", 2, 1)
    assert jobset.coordinator == f"llm-workers-0-0.llm:{environments.DEFAULT_PORT}"
    wide = {"JAX_NUM_PROCESSES": "8", "JAX_COORDINATOR_PORT": "9000", "JOB_COMPLETION_INDEX": "1"}
    wide = resolve({**JOBSET, **wide})  # two jobs of four pods: pod 1 of job 1
    assert (wide.num_processes, wide.process_id) == (8, 5)
    assert wide.coordinator == "llm-workers-0-0.llm:9000"
    indexed = resolve(
        {"JOB_COMPLETION_INDEX": "2", "JAX_NUM_PROCESSES": "3", "JAX_COORDINATOR_ADDRESS": "t-0.t"}
    )
    assert (indexed.source, indexed.process_id) == ("indexed Job", 2)
    assert indexed.coordinator == f"t-0.t:{environments.DEFAULT_PORT}"
    sky = resolve(SKYPILOT)
    assert (sky.source, sky.num_processes, sky.process_id) == ("SkyPilot", 2, 1)
    assert sky.coordinator == f"10.0.0.7:{environments.DEFAULT_PORT}"
    assert resolve({"JOB_COMPLETION_INDEX": "4"}).source == "single"  # a sweep's pod


@pytest.mark.parametrize(
    "environ, message",
    [
        ({**JOBSET, "JAX_NUM_PROCESSES": "3"}, "not a multiple of the JobSet's GLOBAL_REPLICAS=2"),
        ({"JOB_COMPLETION_INDEX": "1", "JAX_NUM_PROCESSES": "2"}, "needs JAX_COORDINATOR_ADDRESS"),
        ({**SKYPILOT, "SKYPILOT_NODE_IPS": "10.0.0.7"}, "names 1 hosts for SKYPILOT_NUM_NODES=2"),
        ({**KUBEFLOW, "JAX_PROCESS_ID": "x"}, "JAX_PROCESS_ID='x' is not an integer"),
    ],
)
def test_bad_variables_are_one_line(environ, message):
    with pytest.raises(UserError, match=message):
        resolve(environ)


def test_outside_a_ray_train_worker_there_is_no_ray_row():
    import ray  # imported, but this is the driver: get_context() refuses, the row stays out

    assert ray and environments._ray_train_plan({}) is None
