"""What `fit` returns: the run's summary, readable as a mapping and by name, and the model."""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class FitResult(Mapping[str, Any]):
    """What `fit` returns: the run's summary and the trained module.

    The summary reads as a mapping (`result["final_loss"]`, `dict(result)`) and by name:
    `steps`, `first_loss`, `final_loss`, `eval_loss`, `run_dir`, `resumed_from`,
    `stopped_by` (None, or "SIGTERM" for a run a scheduler stopped: it is not finished).
    `.model` is the trained module as the factory builds it, holding the trained weights
    (`.ema_model` the same with their moving average, under train.ema_decay > 0), for
    inference in plain Python (paisoar_jax/tasks/trained.py). It is built when first read,
    gathering the weights whole onto one device (under several processes, every process
    must read it). None for a zoo model (`python -m paisoar_jax.export` writes its weights).

    Args:
        summary: the run's summary fields (fit makes it; not constructed by hand).
        build_model: builds `.model` when first read; None for a zoo model.
        build_ema_model: builds `.ema_model`; None without a moving average.

    Example:
        ```python
        import paisoar_jax

        overrides = ["model.layers=2", "train.steps=20", "run.dir=runs/tiny"]
        result = paisoar_jax.fit(None, overrides)  # fit's example's run: resumed, finished
        assert result["final_loss"] == result.final_loss  # a mapping and named fields
        print(dict(result)["run_dir"], result.stopped_by)  # runs/tiny None
        ```

    """

    def __init__(
        self,
        summary: Mapping[str, Any],
        build_model: Callable[[], Any] | None = None,
        build_ema_model: Callable[[], Any] | None = None,
    ):
        self._summary = dict(summary)
        self._build_model = build_model
        self._build_ema_model = build_ema_model

    def __getitem__(self, key: str) -> Any:
        return self._summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._summary)

    def __len__(self) -> int:
        return len(self._summary)

    def __repr__(self) -> str:
        return f"FitResult({self._summary!r})"

    @property
    def steps(self) -> int:
        """The steps the run has done (those of a checkpoint it resumed included)."""
        return self._summary["steps"]

    @property
    def first_loss(self) -> float | None:
        """The loss of this process's first logged step (None: no step was taken)."""
        return self._summary.get("first_loss")

    @property
    def final_loss(self) -> float | None:
        """The loss of the last logged step (None: no step was taken)."""
        return self._summary.get("final_loss")

    @property
    def eval_loss(self) -> float | None:
        """The last eval's loss on the default eval set (None: none ran)."""
        return self._summary.get("eval_loss")

    @property
    def run_dir(self) -> pathlib.Path:
        """Where the run's files are: config.yaml, metrics.jsonl, checkpoints/."""
        return pathlib.Path(self._summary["run_dir"])

    @property
    def resumed_from(self) -> int:
        """The checkpoint step the run started from (0: a fresh start)."""
        return self._summary.get("resumed_from", 0)

    @property
    def stopped_by(self) -> str | None:
        """The signal that stopped the run after saving, or None for a finished one."""
        return self._summary.get("stopped_by")

    @functools.cached_property
    def model(self) -> Any:
        """The trained module (built on first read); None for a zoo model."""
        return self._build_model() if self._build_model is not None else None

    @functools.cached_property
    def ema_model(self) -> Any:
        """The module holding the weights' moving average (train.ema_decay > 0), or None."""
        return self._build_ema_model() if self._build_ema_model is not None else None
