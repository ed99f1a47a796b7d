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
from typing import TYPE_CHECKING, Any, Unpack

from paisoar_jax import cli, output
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
from paisoar_jax.tasks.fit_parts import Eval as Eval  # public: paisoar_jax.Eval
from paisoar_jax.tasks.fit_parts import (
    FitKeywords,
    ModelKeywords,
    as_factory,
    build_workload,
    check_keywords,
)
from paisoar_jax.tasks.fit_parts import _program_name as _program_name  # (tests read it)

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

    Args:
        config: as `fit` takes it (its `distributed` section: coordinator, timeouts).

    Example:
        ```python
        import jax

        import paisoar_jax

        paisoar_jax.initialize()  # under launch, SLURM or mpirun: joins the others
        print(jax.process_index(), jax.process_count())  # alone: 0 1
        ```

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
    raise_on_interrupt: bool = True,
    exit_on_error: bool | None = None,
    **parts: Unpack[FitKeywords],
) -> FitResult:
    """Trains `model` on `data` with `loss` as the config says; the summary and the model.

    Args:
        config: a Config, a YAML path or a shipped config's name; None: the defaults.
        overrides: `section.key=value` strings applied over it.
        raise_on_interrupt: Ctrl-C saves a checkpoint, then raises KeyboardInterrupt out of
            fit (so a script stops there); False returns the result as for a finished run.
        exit_on_error: deprecated; a UserError left uncaught already exits with status 2.
        **parts: a model of one's own and what trains it (`FitKeywords`): model, loss,
            optimizer, data, eval_data, eval_sets, flops_per_example. No model: the
            config's zoo model.

    Returns:
        A FitResult: the summary fields, `.model` (the trained module) and `.ema_model`.

    Raises:
        UserError: bad input, with one line naming it (exit status 2 when uncaught).

    Example:
        ```python
        import paisoar_jax

        overrides = ["model.layers=2", "train.steps=20", "run.dir=runs/tiny"]
        result = paisoar_jax.fit(None, overrides)
        print(result.steps, result.final_loss)  # 20, the last logged loss
        ```

    """
    model = parts.get("model")

    def work() -> FitResult:
        check_keywords(parts, FitKeywords, "fit")
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
    exit_on_error: bool | None = None,
    **parts: Unpack[FitKeywords],
) -> Prepared:
    """The pieces `fit` trains with, for a loop of one's own (run/prepared.py's Prepared).

    Args:
        config: as `fit` takes it.
        overrides: `section.key=value` strings applied over it.
        exit_on_error: deprecated, as in `fit`.
        **parts: `fit`'s keywords (`FitKeywords`): model, loss, optimizer, data,
            eval_data, eval_sets, flops_per_example.

    Returns:
        A Prepared run: `.state` (sharded; restored when the run directory holds
            a checkpoint), `.start_step`, `.batches()` (global batches on the mesh from
            the state's step), `.train_step(state, batch) -> (state, metrics)` (fit's
            compiled step), `.evaluate(state)` (fit's eval of every eval set),
            `.should_stop(step)`, `.save(state)`, `.log(step, metrics)`, `.model(state)`
            and `.close()`.

    Raises:
        UserError: bad input, with one line naming it (exit status 2 when uncaught).

    Example:
        ```python
        import paisoar_jax

        overrides = ["model.layers=2", "train.steps=10", "run.dir=runs/own-loop"]
        with paisoar_jax.prepare(None, overrides) as prepared:
            state = prepared.state
            for step, batch in zip(range(prepared.start_step + 1, 11), prepared.batches()):
                state, metrics = prepared.train_step(state, batch)
                if step % 5 == 0:
                    prepared.log(step, metrics)  # a metrics.jsonl record, as fit writes it
                    prepared.save(state)  # asynchronous; closing commits it
        ```

    """

    def work() -> Prepared:
        check_keywords(parts, FitKeywords, "prepare")
        from paisoar_jax.run.loop import open_sources
        from paisoar_jax.run.prepared import prepare_run
        from paisoar_jax.run.setup import setup

        resolved, run_workload = _started("paisoar_jax.prepare", config, overrides, parts)
        train_source, eval_sets = open_sources(run_workload.task, resolved.train.global_batch)
        return prepare_run(setup(resolved, run_workload), run_workload, train_source, eval_sets)

    return _run("paisoar_jax.prepare", work, exit_on_error)


def load(
    path: str | pathlib.Path,
    model: Callable | None = None,
    *,
    ema: bool = False,
    exit_on_error: bool | None = None,
) -> Any:
    """The module holding a run's trained weights: `model` (rngs -> nnx.Module) builds it.

    Args:
        path: a run directory (its newest checkpoint; fit's or prepare's), a checkpoint step
            or an export (an hf-import's too).
        model: the factory the run trained; None: a zoo model built from the run's own
            config.yaml (model.name=custom needs its factory).
        ema: the moving average of the weights instead (a run with train.ema_decay > 0).
        exit_on_error: deprecated, as in `fit`.

    Returns:
        The nnx.Module with the weights, checked against the checksums written with them.

    Raises:
        UserError: no such run, another model's weights, or damaged files, in one line.

    Example:
        ```python
        import jax.numpy as jnp

        import paisoar_jax

        model = paisoar_jax.load("runs/tiny")  # fit's example's zoo GPT, its trained weights
        logits = model(jnp.zeros((1, 8), jnp.int32))  # (batch, tokens, vocabulary)
        ```

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
    from paisoar_jax.numerics.precision import policy_of
    from paisoar_jax.tasks.zoo import build_model, check_model

    if isinstance(config.model, CustomModelConfig):
        raise UserError(
            f"{path} holds a model of your own (model.name=custom): give its factory, "
            f"paisoar_jax.load({str(path)!r}, model=MyModel)"
        )
    check_model(config.model, config.mesh, config.train, config.precision.policy)
    policy = policy_of(config.precision)
    return lambda rngs: build_model(config.model, policy, "none", rngs)


def plan_fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    show: bool = True,
    target: str | None = None,
    hosts: int = 1,
    devices_per_host: int = 8,
    exit_on_error: bool | None = None,
    **parts: Unpack[ModelKeywords],
) -> dict[str, Any]:
    """The plan of what `fit` would run (memory, each parameter's sharding, collectives).

    Args:
        config: as `fit` takes it.
        overrides: `section.key=value` strings applied over it.
        show: print the table.
        target: "h200" or "h100": compile for `hosts` x `devices_per_host` of that GPU
            without one (the gpu-aot extra; `python -m paisoar_jax.plan --target` says
            more); None: the devices jax sees (XLA_FLAGS simulates more on CPU).
        hosts: the target's hosts.
        devices_per_host: the target's GPUs per host.
        exit_on_error: deprecated, as in `fit`.
        **parts: model, loss, optimizer, data, flops_per_example, as `fit` takes them
            (`ModelKeywords`).

    Returns:
        The plan as a JSON-ready dict (what `plan --json` prints).

    Example:
        ```python
        import paisoar_jax

        plan = paisoar_jax.plan_fit(None, ["model.layers=2", "mesh.fsdp=2"], show=False)
        print(plan["mesh"], plan["memory_bytes"])  # what each device would hold
        ```

    """

    def work() -> dict[str, Any]:
        check_keywords(parts, ModelKeywords, "plan_fit")
        import jax

        from paisoar_jax.tools import plan as planning
        from paisoar_jax.tools.plan import gpu_target

        resolved, run_workload = build_workload(resolve_config(config, overrides), **parts)
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
    scaling: bool = False,
    exit_on_error: bool | None = None,
    **parts: Unpack[ModelKeywords],
) -> dict[str, Any]:
    """The measured speed of what `fit` would run (no checkpoints, no eval), as `bench` does.

    Args:
        config: as `fit` takes it.
        overrides: `section.key=value` strings applied over it.
        scaling: as `bench --scaling`, the step on 1, 2, 4, ... devices, strong and weak;
            prints the table and writes scaling.json in run.dir.
        exit_on_error: deprecated, as in `fit`.
        **parts: model, loss, optimizer, data, flops_per_example, as `fit` takes them
            (`ModelKeywords`).

    Returns:
        One JSON-ready dict (also printed): examples/s, step time, MFU, compile time
            and data wait; with `scaling`, what scaling.json holds.

    Example:
        ```python
        import paisoar_jax

        speed = paisoar_jax.bench_fit(None, ["model.layers=2", "train.steps=5"])
        print(speed["tokens_per_s"], speed["step_ms"], speed["compile_s"])
        ```

    """

    def work() -> dict[str, Any]:
        check_keywords(parts, ModelKeywords, "bench_fit")
        import json

        from paisoar_jax.tools.bench import BENCH_OVERRIDES, bench_train

        resolved = resolve_config(config, [*overrides, *BENCH_OVERRIDES])
        if not resolved.run.dir:
            resolved = resolve_config(resolved, [f"run.dir=runs/bench/{resolved.run.name}"])
        resolved, run_workload = build_workload(resolved, **parts)
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
    paisoar_jax.export RUN_DIR --output DIR` writes it (with each array's checksum).

    Args:
        run_dir: the run directory.
        output: an empty or new directory.
        step: the checkpoint step; None: the newest complete one.

    Returns:
        The step exported.

    Example:
        ```python
        import paisoar_jax

        step = paisoar_jax.export_run("runs/tiny", "exports/tiny")  # fit's example's run
        # a later run fine-tunes from it: checkpoint.init_from=exports/tiny
        ```

    """
    from paisoar_jax.tools.export import export

    return export(pathlib.Path(run_dir), pathlib.Path(output), step)
