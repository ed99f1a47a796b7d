"""The Python API: a model, loss, optimizer and data of one's own, trained as the CLI trains.

    import optax, paisoar_jax
    summary = paisoar_jax.fit(
        "my_run.yaml", ["mesh.fsdp=2", "precision.policy=bf16"],
        model=lambda rngs: MyModel(rngs=rngs),   # built abstractly, then sharded
        loss=my_loss,                            # (model, batch, rng) -> (loss, metrics)
        optimizer=optax.adamw(3e-4),             # default: the config's optim section
        data=my_batches,                         # see paisoar_jax/data/user_data.py
    )

Everything the command line has applies unchanged: the mesh and ZeRO stages, sharding rules,
precision and loss scaling, remat, grad accumulation, eval, metrics.jsonl, TensorBoard, async
checkpoints with exact resume, SIGTERM saves, the out-of-memory report and `doctor`. Bad
input raises paisoar_jax.UserError (a ValueError) with a one-line message; uncaught in a
script it is that line on stderr and exit status 2, as on the command line. With no model,
the config's zoo model is trained. `prepare` hands over the same pieces for a loop of one's
own (run/prepared.py).
"""

from __future__ import annotations

import pathlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from paisoar_jax import output
from paisoar_jax.config import (
    Config,
    CustomModelConfig,
    config_from_dict,
    load_config,
    to_dict,
)
from paisoar_jax.errors import DivergenceError, HangError, UserError, end_uncaught
from paisoar_jax.run.result import FitResult
from paisoar_jax.run.startup import start
from paisoar_jax.runtime import heartbeat
from paisoar_jax.runtime.platform import choose_platform
from paisoar_jax.tasks.fit_parts import (
    DataLike,
    LossFunction,
    ModelLike,
    OptimizerLike,
    as_factory,
    build_workload,
)
from paisoar_jax.tasks.fit_parts import Eval as Eval  # public: paisoar_jax.Eval
from paisoar_jax.tasks.fit_parts import _program_name as _program_name  # (tests read it)
from paisoar_jax.tools import cli

if TYPE_CHECKING:
    from paisoar_jax.run.prepared import Prepared

ConfigLike = Config | str | pathlib.Path | None


def resolve_config(config: ConfigLike = None, overrides: Sequence[str] = ()) -> Config:
    """A Config from a Config, a YAML path or shipped name, or None (the defaults), + overrides."""
    if isinstance(overrides, str):
        raise UserError(
            f"overrides must be a list of section.key=value, got the string {overrides!r}"
        )
    from paisoar_jax.tasks.zoo import check_model

    if isinstance(config, Config):
        resolved = config_from_dict(to_dict(config), overrides) if overrides else config
    elif config is not None and not isinstance(config, str | pathlib.Path):
        raise UserError(
            f"config must be a Config, a YAML path or a name, got {type(config).__name__}"
        )
    else:
        resolved = load_config(None if config is None else str(config), list(overrides))
    # An image variant's shape, fp8 blocks: before any device.
    check_model(resolved.model, resolved.mesh, resolved.train, resolved.precision.policy)
    return resolved


def initialize(config: ConfigLike = None) -> None:
    """Joins the other processes of a multi-process run (jax.distributed), once.

    Reads the launcher's PAISOAR_* variables, SLURM, Open MPI or torchrun's (what
    `python -m paisoar_jax.launch -- python my_script.py` sets); with none of them, a
    single process. `fit` calls it; call it yourself before touching devices otherwise.
    """
    start(resolve_config(config), "paisoar_jax")


def _run(program: str, work: Callable[[], Any], exit_on_error: bool | None) -> Any:
    """work(); bad input raises UserError (a ValueError) with its one-line message.

    Left uncaught in a script, it ends the program as on the command line: that line on
    stderr and exit status 2 (1 for a divergence, 3 for a hang), not a traceback
    (`errors.end_uncaught`). `exit_on_error=True`, deprecated, turns it into SystemExit there.
    The platform is chosen first, as the command line chooses it (runtime/platform.py).
    """
    choose_platform()
    if exit_on_error is not None:
        warnings.warn(
            "exit_on_error is deprecated: library calls raise paisoar_jax.UserError (a "
            "ValueError); left uncaught in a script it is one line and exit status 2",
            DeprecationWarning,
            stacklevel=3,
        )
    if exit_on_error:
        result = []
        status = cli.exit_status(program, lambda: result.append(work()))
        if status:
            sys.stderr.flush()
            raise SystemExit(status)
        return result[0]
    try:
        return work()
    except (UserError, DivergenceError, HangError) as error:
        heartbeat.record_failure(str(error), retryable=not isinstance(error, UserError))
        if exit_on_error is None:
            end_uncaught(program)
        raise


def _started(
    program: str, config: ConfigLike, overrides: Sequence[str], parts: dict[str, Any]
) -> tuple[Config, Any]:
    """(config, workload) of fit's keywords `parts`, the process started as the CLI starts."""
    resolved = resolve_config(config, overrides)
    start(resolved, program)  # as the command line starts (run/startup.py)
    return build_workload(resolved, **parts)


def fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    model: ModelLike | None = None,
    loss: LossFunction | None = None,
    optimizer: OptimizerLike | None = None,
    data: DataLike | None = None,
    eval_data: DataLike | None = None,
    eval_sets: dict[str, DataLike | Eval] | None = None,
    flops_per_example: float | None = None,
    exit_on_error: bool | None = None,
    raise_on_interrupt: bool = True,
) -> FitResult:
    """Trains `model` on `data` with `loss` as the config says; the summary and the model.

    model: `rngs -> nnx.Module` (called abstractly: nothing full-size on one device), or
        an nnx.Module instance whose weights are the start (placed with the shardings).
    loss: `(model, batch, rng) -> (scalar loss, {name: scalar})`, taken in fp32.
    optimizer: an optax GradientTransformation, or a function of the config's lr
        schedule that returns one; default: the config's optim section. It runs as
        given: clipped only when optim.clip_norm is set; the loss scaler (fp16) and grad
        accumulation wrap it.
    data, eval_data: examples (a grain MapDataset, a random-access source, a numpy array,
        a dict or an (x, y) tuple of arrays) or batches (a grain IterDataset or a
        re-iterable of per-process batches); eval_data None: no default eval set. Both,
        and every eval set, are checked against the loss before the first step.
    eval_sets: more eval sets, {name: data or Eval(data, every=STEPS)}, each evaluated on
        its own cadence (default train.eval_every) and reported as eval_<name>_loss, ...
    flops_per_example: training FLOPs per example, for MFU (None: MFU not reported).
    raise_on_interrupt: Ctrl-C saves a checkpoint, then raises KeyboardInterrupt out of
        fit (so a script stops there); False returns the result as for a finished run.
    Returns a FitResult: the summary fields, and `.model`, the trained module.
    """
    parts = dict(model=model, loss=loss, optimizer=optimizer, data=data, eval_data=eval_data)
    parts |= dict(eval_sets=eval_sets, flops_per_example=flops_per_example)

    def work() -> FitResult:
        from paisoar_jax.run import loop
        from paisoar_jax.runtime.preemption import StopRequest
        from paisoar_jax.tasks import trained

        with StopRequest():  # a signal before the first step ends the process at once
            resolved, run_workload = _started("paisoar_jax.fit", config, overrides, parts)
            finished = loop.run(resolved, run_workload)
        if raise_on_interrupt and finished.summary.get("stopped_by") == "SIGINT":
            raise KeyboardInterrupt(f"fit stopped by Ctrl-C at step {finished.summary['steps']}")
        if model is None:
            return FitResult(finished.summary)
        params, model_state = finished.state.params, finished.state.model_state

        def build(weights: Any) -> Callable[[], Any]:
            return lambda: trained.model_with(
                run_workload.model, weights, model_state, resolved.lora
            )

        average = finished.state.ema["params"] if finished.state.ema else None
        return FitResult(
            finished.summary, build(params), build(average) if average is not None else None
        )

    return _run("paisoar_jax.fit", work, exit_on_error)


def prepare(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    model: ModelLike | None = None,
    loss: LossFunction | None = None,
    optimizer: OptimizerLike | None = None,
    data: DataLike | None = None,
    eval_data: DataLike | None = None,
    eval_sets: dict[str, DataLike | Eval] | None = None,
    flops_per_example: float | None = None,
    exit_on_error: bool | None = None,
) -> Prepared:
    """The pieces `fit` trains with, for a loop of one's own (run/prepared.py's Prepared).

    Takes what `fit` takes. Returns `.state` (sharded; restored when the run directory holds
    a checkpoint), `.start_step`, `.batches()` (global batches on the mesh from the state's
    step), `.train_step(state, batch) -> (state, metrics)` (fit's compiled step),
    `.eval_step`, `.mesh`, `.save(state)` and `.model(state)` (the NNX module of a state).
    """
    parts = dict(model=model, loss=loss, optimizer=optimizer, data=data, eval_data=eval_data)
    parts |= dict(eval_sets=eval_sets, flops_per_example=flops_per_example)

    def work() -> Prepared:
        from paisoar_jax.run.loop import open_sources
        from paisoar_jax.run.prepared import prepare_run
        from paisoar_jax.tasks.workload import setup

        resolved, run_workload = _started("paisoar_jax.prepare", config, overrides, parts)
        train_source, _ = open_sources(run_workload.task, resolved.train.global_batch)
        return prepare_run(setup(resolved, run_workload), run_workload, train_source)

    return _run("paisoar_jax.prepare", work, exit_on_error)


def load(
    path: str | pathlib.Path,
    model: Callable | None = None,
    *,
    ema: bool = False,
    exit_on_error: bool | None = None,
) -> Any:
    """The module holding a run's trained weights: `model` (rngs -> nnx.Module) builds it.

    `path`: a run directory (its newest checkpoint), a checkpoint step or an export (an
    hf-import's too). Without `model`, a zoo model is built from the run's own config.yaml
    (model.name=custom needs its factory). `ema`: the moving average of the weights instead
    (a run with train.ema_decay > 0).
    """
    from paisoar_jax.checkpointing.weights import weights_source
    from paisoar_jax.tasks import trained

    def work() -> Any:
        # As hf-export and generate find it; the run's config says which adapters it has.
        config, where, _ = weights_source(pathlib.Path(path))
        factory = as_factory(model) if model is not None else _zoo_factory(config, path)
        return trained.load(where, factory, config.lora, ema)

    return _run("paisoar_jax.load", work, exit_on_error)


def _zoo_factory(config: Config, path: str | pathlib.Path) -> Callable:
    """The factory of the zoo model `config` names, in the run's precision policy."""
    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.zoo import build_model, check_model

    if isinstance(config.model, CustomModelConfig):
        raise UserError(
            f"{path} holds a model of your own (model.name=custom): give its factory, "
            f"paisoar_jax.load({str(path)!r}, model=MyModel)"
        )
    check_model(config.model, config.mesh, config.train, config.precision.policy)
    policy = get_policy(config.precision.policy)
    return lambda rngs: build_model(config.model, policy, "none", rngs)


def plan_fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    model: ModelLike | None = None,
    loss: LossFunction | None = None,
    optimizer: OptimizerLike | None = None,
    data: DataLike | None = None,
    flops_per_example: float | None = None,
    show: bool = True,
    target: str | None = None,
    hosts: int = 1,
    devices_per_host: int = 8,
    exit_on_error: bool | None = None,
) -> dict[str, Any]:
    """The plan of what `fit` would run (memory, each parameter's sharding, collectives).

    model, loss, optimizer, data, flops_per_example: as `fit` takes them. `show` prints the
    table. Devices: the ones jax sees (set XLA_FLAGS to simulate more on CPU), or with
    `target` ("h200", "h100") `hosts` x `devices_per_host` of that GPU, compiled for
    without one (the gpu-aot extra; `python -m paisoar_jax.plan --target` says more).
    """

    def work() -> dict[str, Any]:
        import jax

        from paisoar_jax.tools import gpu_target
        from paisoar_jax.tools import plan as planning

        parts = dict(model=model, loss=loss, optimizer=optimizer, data=data)
        resolved = resolve_config(config, overrides)
        resolved, run_workload = build_workload(
            resolved, **parts, flops_per_example=flops_per_example
        )
        devices = jax.devices()
        if target is not None:
            devices = gpu_target.target_devices(target, hosts, devices_per_host)
        result = planning.plan(resolved, devices, workload=run_workload, target=target)
        if show:
            output.result(planning.format_table(result))
        return result

    return _run("paisoar_jax.plan", work, exit_on_error)


def bench_fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    model: ModelLike | None = None,
    loss: LossFunction | None = None,
    optimizer: OptimizerLike | None = None,
    data: DataLike | None = None,
    flops_per_example: float | None = None,
    scaling: bool = False,
    exit_on_error: bool | None = None,
) -> dict[str, Any]:
    """The measured speed of what `fit` would run (no checkpoints, no eval), as `bench` does.

    model, loss, optimizer, data, flops_per_example: as `fit` takes them. Prints and
    returns one JSON-ready dict: examples/s, step time, MFU, compile time, data wait.
    `scaling`: as `bench --scaling`, the step on 1, 2, 4, ... devices, strong and weak;
    prints the table, writes scaling.json in run.dir and returns what it holds.
    """

    def work() -> dict[str, Any]:
        import json

        from paisoar_jax.tools.bench import BENCH_OVERRIDES, bench_train

        resolved = resolve_config(config, [*overrides, *BENCH_OVERRIDES])
        if not resolved.run.dir:
            resolved = resolve_config(resolved, [f"run.dir=runs/bench/{resolved.run.name}"])
        parts = dict(model=model, loss=loss, optimizer=optimizer, data=data)
        resolved, run_workload = build_workload(
            resolved, **parts, flops_per_example=flops_per_example
        )
        if scaling:
            from paisoar_jax.tools import scaling as measuring

            result = measuring.scaling(resolved, run_workload)
            output.result(measuring.format_table(result))
            return result
        result = bench_train(resolved, run_workload)
        output.result(json.dumps(result))
        return result

    return _run("paisoar_jax.bench", work, exit_on_error)


def export_run(
    run_dir: str | pathlib.Path, output: str | pathlib.Path, step: int | None = None
) -> int:
    """Writes the weights of a run's checkpoint (default: the newest) to `output`.

    The export is what `checkpoint.init_from` fine-tunes from, as `python -m
    paisoar_jax.export RUN_DIR --output DIR` writes it; returns the step exported.
    """
    from paisoar_jax.tools.export import export

    return export(pathlib.Path(run_dir), pathlib.Path(output), step)
