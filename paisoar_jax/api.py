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
input is one line on stderr and exit status 2, as on the command line (`exit_on_error=False`
raises paisoar_jax.UserError instead). With no model, the config's zoo model is trained.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from paisoar_jax import output
from paisoar_jax.config import (
    Config,
    CustomModelConfig,
    LanguageModelConfig,
    RunConfig,
    config_from_dict,
    load_config,
    to_dict,
)
from paisoar_jax.errors import UserError
from paisoar_jax.startup import start
from paisoar_jax.tools import cli

ConfigLike = Config | str | pathlib.Path | None


class FitResult(dict):
    """The run's summary (a dict: steps, final_loss, eval_loss, run_dir, ...) and `.model`.

    `.model` is the trained module as the factory builds it, holding the trained weights
    (`.ema_model` the same with their moving average, under train.ema_decay > 0),
    for inference in plain Python (paisoar_jax/trained.py). It is built when first read,
    gathering the weights whole onto one device (under several processes, every process
    must read it); until then the result holds the sharded weights. None for a zoo model
    (`python -m paisoar_jax.export` writes its weights).
    """

    _build: Callable[[], Any] | None = None
    _model: Any = None
    _build_ema: Callable[[], Any] | None = None
    _ema_model: Any = None

    @property
    def model(self) -> Any:
        """The trained module (built on first read)."""
        if self._model is None and self._build is not None:
            self._model, self._build = self._build(), None
        return self._model

    @property
    def ema_model(self) -> Any:
        """The module holding the weights' moving average (train.ema_decay > 0), or None.

        Built on first read, as `.model`.
        """
        if self._ema_model is None and self._build_ema is not None:
            self._ema_model, self._build_ema = self._build_ema(), None
        return self._ema_model


def resolve_config(config: ConfigLike = None, overrides: Sequence[str] = ()) -> Config:
    """A Config from a Config, a YAML path or shipped name, or None (the defaults), + overrides."""
    if isinstance(overrides, str):
        raise UserError(
            f"overrides must be a list of section.key=value, got the string {overrides!r}"
        )
    from paisoar_jax.zoo import check_model

    if isinstance(config, Config):
        resolved = config_from_dict(to_dict(config), overrides) if overrides else config
    elif config is not None and not isinstance(config, str | pathlib.Path):
        raise UserError(
            f"config must be a Config, a YAML path or a name, got {type(config).__name__}"
        )
    else:
        resolved = load_config(None if config is None else str(config), list(overrides))
    check_model(resolved)  # an image variant's shape, fp8 blocks: before any device
    return resolved


def initialize(config: ConfigLike = None) -> None:
    """Joins the other processes of a multi-process run (jax.distributed), once.

    Reads the launcher's PAISOAR_* variables, SLURM, Open MPI or torchrun's (what
    `python -m paisoar_jax.launch -- python my_script.py` sets); with none of them, a
    single process. `fit` calls it; call it yourself before touching devices otherwise.
    """
    start(resolve_config(config), "paisoar_jax")


def build_workload(
    config: Config,
    *,
    model: Any = None,
    loss: Callable | None = None,
    optimizer: Any = None,
    data: Any = None,
    eval_data: Any = None,
    eval_sets: dict[str, Any] | None = None,
    flops_per_example: float | None = None,
) -> tuple[Config, Any]:
    """(config with its model section filled, workload.Workload) for fit, plan and bench."""
    from paisoar_jax.custom import CustomTask
    from paisoar_jax.data.user_data import open_user_data
    from paisoar_jax.precision import get_policy
    from paisoar_jax.workload import Workload
    from paisoar_jax.zoo import zoo_workload

    if model is None:
        if loss is not None or data is not None or eval_data is not None:
            raise UserError("loss and data go with a model of your own: pass model= too")
        if eval_sets is not None:
            raise UserError(
                "eval_sets go with a model of your own; a zoo model's named eval sets are "
                "data.eval_sets=[[source, every, name], ...]"
            )
        zoo = zoo_workload(config)
        return config, Workload(zoo.model, zoo.task, optimizer, follows_policy=True)
    model = as_factory(model)
    if not callable(loss):
        raise UserError("a model of your own needs loss=: (model, batch, rng) -> (loss, metrics)")
    if data is None:
        raise UserError("a model of your own needs data= (examples or batches, see the docs)")
    if not isinstance(config.model, CustomModelConfig) and config.model != LanguageModelConfig():
        raise UserError(
            f"the config sets model.name={config.model.name} and fit got model= too: drop one"
        )
    name = f"{getattr(model, '__module__', '?')}.{getattr(model, '__qualname__', repr(model))}"
    sections = to_dict(config)
    sections["model"] = {"name": "custom", "factory": name}
    if not config.run.dir and config.run.name == RunConfig().name:
        # Each program its own runs/<name>: two scripts (or a script and the CLI's default
        # run) never resume each other's checkpoints.
        sections["run"]["name"] = _program_name(model)
    config = config_from_dict(sections)
    task = CustomTask(
        loss,
        open_user_data(data, "data"),
        user_eval_sets(eval_data, {} if eval_sets is None else eval_sets, config.train.eval_every),
        get_policy(config.precision.policy),
        flops_per_example,
        config.precision.cast_inputs,
    )
    return config, Workload(model, task, optimizer)


@dataclasses.dataclass(frozen=True)
class Eval:
    """An eval set of fit's `eval_sets` with a cadence of its own: `Eval(data, every=500)`."""

    data: Any  # what eval_data takes
    every: int = 0  # steps between its evals (and the last step); 0: train.eval_every's


def user_eval_sets(eval_data: Any, eval_sets: dict[str, Any], eval_every: int) -> tuple:
    """The default eval set (eval_data) and the named ones, as evaluation.EvalSets, checked."""
    from paisoar_jax.config.data import NAME, check_every
    from paisoar_jax.data.user_data import open_user_data
    from paisoar_jax.evaluation import EvalSet

    sets = []
    if isinstance(eval_data, Eval):
        raise UserError("eval_data is data; Eval(data, every=STEPS) goes in eval_sets={name: ...}")
    if eval_data is not None:
        sets.append(EvalSet(open_user_data(eval_data, "eval_data"), eval_every))
    if not isinstance(eval_sets, dict):
        raise UserError(f"eval_sets is a dict of name: data (or Eval), got {type(eval_sets)}")
    for name, given in eval_sets.items():
        label = f"eval_sets[{name!r}]"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UserError(f"{label}: a name is made of letters, digits, _ . -")
        every = check_every(label, given.every) if isinstance(given, Eval) else 0
        if not (every or eval_every):
            raise UserError(
                f"{label} is evaluated every train.eval_every steps, and train.eval_every=0: "
                f"give it Eval(data, every=STEPS)"
            )
        data = given.data if isinstance(given, Eval) else given
        sets.append(EvalSet(open_user_data(data, label), every or eval_every, name))
    return tuple(sets)


def as_factory(model: Any) -> Callable:
    """`model` as a function rngs -> nnx.Module: a factory as it is, an instance copied.

    An instance's weights are the start of the run; the instance itself is not changed.
    """
    from flax import nnx

    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)

        def copy(rngs: Any) -> Any:
            return nnx.merge(graphdef, state)

        copy.__name__ = copy.__qualname__ = type(model).__name__
        copy.__module__ = type(model).__module__
        return copy
    if not callable(model):
        raise UserError(
            f"model must be an nnx.Module or a function rngs -> nnx.Module, got "
            f"{type(model).__name__}"
        )
    return _called_with_rngs(model)


def _called_with_rngs(model: Callable) -> Callable:
    """`model` as a function of one argument, rngs; one that cannot be called so is refused.

    A factory taking rngs as a keyword only (`def make(*, rngs)`) is called with rngs=.
    """
    try:
        if isinstance(model, type):  # a class: its __init__ (flax's metaclass hides it)
            signature = inspect.signature(model.__init__)
            after_self = list(signature.parameters.values())[1:]
            signature = signature.replace(parameters=after_self)
        else:
            signature = inspect.signature(model)
    except (TypeError, ValueError):  # a builtin: nothing to check
        return model
    try:
        signature.bind(None)
        return model
    except TypeError as positional:
        try:
            signature.bind(rngs=None)
        except TypeError:
            name = getattr(model, "__name__", type(model).__name__)
            example = "MyModel" if name == "<lambda>" else name
            raise UserError(
                f"model={name} cannot be called as model(rngs) ({positional}): give an "
                f"nnx.Module, or a function of one argument, rngs, that builds one "
                f"(model=lambda rngs: {example}(..., rngs=rngs))"
            ) from None
    return functools.wraps(model)(lambda rngs: model(rngs=rngs))


def _program_name(model: Callable) -> str:
    """The running script's name (`python my_run.py`: my_run), else the model's."""
    script = pathlib.Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    runners = ("__main__", "ipykernel_launcher")  # python -m ..., a Jupyter kernel
    if script is not None and script.suffix == ".py" and script.stem not in runners:
        return script.stem
    name = getattr(model, "__name__", type(model).__name__)
    return name if name.isidentifier() else "fit"  # a lambda


def _run(program: str, work: Callable[[], Any], exit_on_error: bool) -> Any:
    """work(); bad input becomes one line and SystemExit(2) unless exit_on_error is False."""
    if not exit_on_error:
        return work()
    result = []
    status = cli.exit_status(program, lambda: result.append(work()))
    if status:
        sys.stderr.flush()
        raise SystemExit(status)
    return result[0]


def fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    model: Any = None,
    loss: Callable | None = None,
    optimizer: Any = None,
    data: Any = None,
    eval_data: Any = None,
    eval_sets: dict[str, Any] | None = None,
    flops_per_example: float | None = None,
    exit_on_error: bool = True,
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

    def work() -> FitResult:
        from paisoar_jax import loop, trained
        from paisoar_jax.preemption import StopRequest

        with StopRequest():  # a signal before the first step ends the process at once
            return train(loop, trained)

    def train(loop, trained) -> FitResult:
        resolved = resolve_config(config, overrides)
        start(resolved, "paisoar_jax.fit")  # as the command line starts (startup.py)
        resolved, run_workload = build_workload(
            resolved,
            model=model,
            loss=loss,
            optimizer=optimizer,
            data=data,
            eval_data=eval_data,
            eval_sets=eval_sets,
            flops_per_example=flops_per_example,
        )
        finished = loop.run(resolved, run_workload)
        if raise_on_interrupt and finished.summary.get("stopped_by") == "SIGINT":
            raise KeyboardInterrupt(f"fit stopped by Ctrl-C at step {finished.summary['steps']}")
        result = FitResult(finished.summary)
        if model is not None:
            params, model_state = finished.state.params, finished.state.model_state
            result._build = lambda: trained.model_with(
                run_workload.model, params, model_state, resolved
            )
            if finished.state.ema:
                average = finished.state.ema["params"]
                result._build_ema = lambda: trained.model_with(
                    run_workload.model, average, model_state, resolved
                )
        return result

    return _run("paisoar_jax.fit", work, exit_on_error)


def load(
    path: str | pathlib.Path,
    model: Callable | None = None,
    *,
    ema: bool = False,
    exit_on_error: bool = True,
) -> Any:
    """The module holding a run's trained weights: `model` (rngs -> nnx.Module) builds it.

    `path`: a run directory (its newest checkpoint), a checkpoint step or an export (an
    hf-import's too). Without `model`, a zoo model is built from the run's own config.yaml
    (model.name=custom needs its factory). `ema`: the moving average of the weights instead
    (a run with train.ema_decay > 0).
    """
    from paisoar_jax import trained
    from paisoar_jax.weights import weights_source

    def work() -> Any:
        # As hf-export and generate find it; the run's config says which adapters it has.
        config, where, _ = weights_source(pathlib.Path(path))
        factory = as_factory(model) if model is not None else _zoo_factory(config, path)
        return trained.load(where, factory, config, ema)

    return _run("paisoar_jax.load", work, exit_on_error)


def _zoo_factory(config: Config, path: str | pathlib.Path) -> Callable:
    """The factory of the zoo model `config` names, in the run's precision policy."""
    from paisoar_jax.precision import get_policy
    from paisoar_jax.zoo import build_model, check_model

    if isinstance(config.model, CustomModelConfig):
        raise UserError(
            f"{path} holds a model of your own (model.name=custom): give its factory, "
            f"paisoar_jax.load({str(path)!r}, model=MyModel)"
        )
    check_model(config)
    policy = get_policy(config.precision.policy)
    return lambda rngs: build_model(config.model, policy, "none", rngs)


def plan_fit(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    show: bool = True,
    exit_on_error: bool = True,
    target: str | None = None,
    hosts: int = 1,
    devices_per_host: int = 8,
    **parts: Any,
) -> dict[str, Any]:
    """The plan of what `fit` would run (memory, each parameter's sharding, collectives).

    `parts` are fit's model, loss, optimizer, data and flops_per_example; `show` prints
    the table. Devices: the ones jax sees (set XLA_FLAGS to simulate more on CPU), or with
    `target` ("h200", "h100") `hosts` x `devices_per_host` of that GPU, compiled for
    without one (the gpu-aot extra; `python -m paisoar_jax.plan --target` says more).
    """

    def work() -> dict[str, Any]:
        import jax

        from paisoar_jax.tools import gpu_target
        from paisoar_jax.tools import plan as planning

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
    exit_on_error: bool = True,
    **parts: Any,
) -> dict[str, Any]:
    """The measured speed of what `fit` would run (no checkpoints, no eval), as `bench` does.

    `parts` are fit's model, loss, optimizer, data and flops_per_example. Prints and
    returns one JSON-ready dict: examples/s, step time, MFU, compile time, data wait.
    """

    def work() -> dict[str, Any]:
        import json

        from paisoar_jax.tools.bench import BENCH_OVERRIDES, bench_train

        resolved = resolve_config(config, [*overrides, *BENCH_OVERRIDES])
        if not resolved.run.dir:
            resolved = resolve_config(resolved, [f"run.dir=runs/bench/{resolved.run.name}"])
        timed = {key: value for key, value in parts.items() if key not in ("eval_sets",)}
        resolved, run_workload = build_workload(resolved, **timed)  # eval_data: never due
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
