"""What `fit`, `prepare`, `plan_fit` and `bench_fit` are given, made into a run's workload.

The keywords they share are declared once here, as `ModelKeywords` (what plan_fit and
bench_fit take) and `FitKeywords` (what fit and prepare take: those and the eval sets);
each function's signature is `**parts: Unpack[FitKeywords]`, so an editor or mypy sees every
keyword and flags a misspelt one, and `check_keywords` refuses one at run time.
`build_workload` checks their values and makes the Workload a run trains.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, Union

from paisoar_jax.config import (
    Config,
    CustomModelConfig,
    LanguageModelConfig,
    RunConfig,
    config_from_dict,
    to_dict,
)
from paisoar_jax.errors import UserError

if TYPE_CHECKING:
    import grain
    import numpy as np
    import optax
    from flax import nnx


ModelLike = Union["Callable[[nnx.Rngs], nnx.Module]", "nnx.Module"]
OptimizerLike = Union[
    "optax.GradientTransformation", "Callable[[optax.Schedule], optax.GradientTransformation]"
]
LossFunction = Callable[..., tuple[Any, dict[str, Any]]]  # (model, batch, rng) -> (loss, metrics)
DataLike = Union[
    "np.ndarray",
    "Mapping[str, np.ndarray]",
    "tuple[np.ndarray, ...]",
    "grain.MapDataset",
    "grain.IterDataset",
    "Iterable[Any]",
]


class ModelKeywords(TypedDict, total=False):
    """The keywords of a model of one's own, shared by fit, prepare, plan_fit and bench_fit.

    model: `rngs -> nnx.Module` (called abstractly: nothing full-size on one device), or
        an nnx.Module instance whose weights are the start (placed with the shardings).
        None (left out): the config's zoo model.
    loss: `(model, batch, rng) -> (scalar loss, {name: scalar})`, taken in fp32.
    optimizer: an optax GradientTransformation, or a function of the config's lr
        schedule that returns one; left out: the config's optim section. It runs as
        given: clipped only when optim.clip_norm is set; the loss scaler (fp16) and grad
        accumulation wrap it.
    data: examples (a grain MapDataset, a random-access source, a numpy array, a dict or
        an (x, y) tuple of arrays) or batches (a grain IterDataset or a re-iterable of
        per-process batches), checked against the loss before the first step.
    flops_per_example: training FLOPs per example, for MFU (left out: no MFU).
    """

    model: ModelLike | None
    loss: LossFunction | None
    optimizer: OptimizerLike | None
    data: DataLike | None
    flops_per_example: float | None


class FitKeywords(ModelKeywords, total=False):
    """ModelKeywords and the eval sets: what fit and prepare take.

    eval_data: held-out data as `data` takes it: the default eval set, reported as
        eval_loss, ... every train.eval_every steps; left out: no default eval set.
    eval_sets: more eval sets, {name: data or Eval(data, every=STEPS)}, each evaluated on
        its own cadence (default train.eval_every) and reported as eval_<name>_loss, ...
    """

    eval_data: DataLike | None
    eval_sets: dict[str, DataLike | Eval] | None


def check_keywords(parts: Mapping[str, Any], keywords: type, function: str) -> None:
    """Refuses a keyword `keywords` (a TypedDict of them) does not declare, in one line."""
    import difflib

    known = list(keywords.__annotations__)
    for name in parts:
        if name in FitKeywords.__annotations__ and name not in known:
            raise UserError(f"{function}() takes no {name}=: fit and prepare evaluate, it does not")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}=?" if close else f"; it takes {', '.join(known)}"
            raise UserError(f"{function}() got an unexpected keyword {name}={hint}")


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
    from paisoar_jax.data.user_data import open_user_data
    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.custom import CustomTask
    from paisoar_jax.tasks.workload import Workload
    from paisoar_jax.tasks.zoo import zoo_workload

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
    """An eval set of fit's `eval_sets` with a cadence of its own: `Eval(data, every=500)`.

    Args:
        data: the set's examples, in any form fit's `eval_data` takes.
        every: steps between its evals; 0: every train.eval_every steps. Each set is also
            evaluated at the last step.

    Example:
        ```python
        import numpy as np
        import optax
        from flax import nnx

        import paisoar_jax


        def loss(model, batch, rng):
            logits = model(batch["x"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return losses.mean(), {}


        x = np.random.default_rng(0).normal(size=(2048, 2)).astype(np.float32)
        data = {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}
        held_out = {name: column[:256] for name, column in data.items()}
        result = paisoar_jax.fit(
            None,
            ["train.steps=40", "train.eval_every=10", "run.dir=runs/two-evals"],
            model=lambda rngs: nnx.Linear(2, 2, rngs=rngs),
            loss=loss,
            data=data,
            eval_sets={"often": held_out, "rarely": paisoar_jax.Eval(held_out, every=40)},
        )
        ```

    """

    data: Any  # what eval_data takes
    every: int = 0  # steps between its evals (and the last step); 0: train.eval_every's


def user_eval_sets(eval_data: Any, eval_sets: dict[str, Any], eval_every: int) -> tuple:
    """The default eval set (eval_data) and the named ones, as evaluation.EvalSets, checked."""
    from paisoar_jax.config.data import NAME, check_every
    from paisoar_jax.data.user_data import open_user_data
    from paisoar_jax.engine.evaluation import EvalSet

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
