"""The `data` section: where examples come from, in what proportions, and how they are read.

`data.mixture` reads several token sources at once (paisoar_jax/data/mixture.py does the
work): `[[source, weight], ...]`, each entry optionally with a name as its third item
(`[arrayrecord:/data/code, 0.25, code]`; by default the source's last path part). Weights
are relative (0.75 and 0.25, or 3 and 1). `data.mixture_stages` changes them from a step on:
`[[step, weight per source, ...], ...]`, steps increasing. A weight may be 0 in a stage (a
source paused, or added later), but every source is read in some stage.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from paisoar_jax.config.checks import check_at_least
from paisoar_jax.errors import UserError

NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: what data.source would name, its weight and its name."""

    source: str
    weight: float
    name: str


def source_name(source: str) -> str:
    """A short name for a source: `embedded`, or the last plain part of its path (`code`)."""
    kind, _, where = source.partition(":")
    parts = [part for part in where.split("/") if part and not set(part) & set("*?[")]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", parts[-1]) if parts else kind


def _loaded(value: Any, key: str) -> Any:
    """A command-line value as YAML (`[[embedded,0.75],[arrayrecord:/d,0.25]]`)."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        raise UserError(f"{key}: not valid YAML: {value!r}") from None


def _weight(value: Any, key: str, what: str) -> float:
    """A finite weight >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"{key}: the weight of {what} must be a number, got {value!r}")
    if value < 0:
        raise UserError(f"{key}: the weight of {what} must be >= 0, got {value}")
    return float(value)


def _entries(value: Any, key: str, second: str, more: tuple[str, ...] = ()) -> list[list]:
    """[[source, <second>, name, *more], ...] of [source, <second>(, name, *more)] entries.

    Mappings of those keys read as lists; name defaults to the source's (source_name), the
    optional items after it to None.
    """
    entries = _loaded(value, key) or []
    if not isinstance(entries, list | tuple):
        raise UserError(f"{key}: expected a list of [source, {second}], got {value!r}")
    width = 3 + len(more)
    lists = []
    for entry in entries:
        if isinstance(entry, dict):
            entry = [entry.get(item) for item in ("source", second, "name", *more)]
        if not isinstance(entry, list | tuple) or not 2 <= len(entry) <= width:
            items = ", ".join(["name", *more])
            raise UserError(
                f"{key}: an entry is [source, {second}] or [source, {second}, {items}], got "
                f"{entry!r}"
            )
        entry = [*entry, *[None] * (width - len(entry))]
        source = entry[0]
        if not isinstance(source, str) or not (
            source in ("embedded", "synthetic") or source.startswith(("arrayrecord:", "hf:"))
        ):
            raise UserError(
                f"{key}: {source!r} is not a token source (embedded, synthetic, "
                f"arrayrecord:DIR, hf:DIR)"
            )
        name = source_name(source) if entry[2] is None else entry[2]
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UserError(
                f"{key}: the name {name!r} of {source} is not made of letters, digits, _ . -"
            )
        lists.append([source, entry[1], name, *entry[3:]])
    names = [entry[2] for entry in lists]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(
            f"{key}: two sources are named {twice[0]}: give each a name of its own as the "
            f"entry's third item ([source, {second}, name])"
        )
    return lists


def parse_mixture(value: Any, key: str = "data.mixture") -> tuple[MixtureSource, ...]:
    """[[source, weight(, name)], ...] (or mappings of those keys) -> MixtureSources."""
    return tuple(
        MixtureSource(source, _weight(weight, key, name), name)
        for source, weight, name in _entries(value, key, "weight")
    )


@dataclass(frozen=True)
class EvalSource:
    """One named eval set beside the default one: a token source and its own cadence."""

    source: str
    every: int  # steps between its evals (and the last step); 0: train.eval_every's
    name: str
    hf_split: str = ""  # hf: its DatasetDict's split; empty: data.eval_hf_split's


def check_every(what: str, every: Any) -> int:
    """An eval set's cadence: steps >= 0 (0: train.eval_every's), else a UserError."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UserError(
            f"{what}: every is the steps between its evals (0: train.eval_every's), got {every!r}"
        )
    return every


def parse_eval_sets(value: Any, key: str = "data.eval_sets") -> tuple[EvalSource, ...]:
    """[[source, every(, name, hf_split)], ...] (or mappings of those keys) -> EvalSources."""
    sets = []
    for source, every, name, hf_split in _entries(value, key, "every", ("hf_split",)):
        if hf_split is not None and not isinstance(hf_split, str):
            raise UserError(f"{key}: {name}'s hf_split is a split's name, got {hf_split!r}")
        sets.append(EvalSource(source, check_every(f"{key}: {name}", every), name, hf_split or ""))
    return tuple(sets)


def parse_stages(
    value: Any, key: str = "data.mixture_stages"
) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """[[step, weight, ...], ...] (or [[step, [weight, ...]], ...]) -> ((step, weights), ...)."""
    entries = _loaded(value, key) or []
    if not isinstance(entries, list | tuple):
        raise UserError(f"{key}: expected a list of [step, weight per source, ...], got {value!r}")
    stages = []
    for entry in entries:
        if (
            isinstance(entry, list | tuple)
            and len(entry) == 2
            and isinstance(entry[1], list | tuple)
        ):
            entry = [entry[0], *entry[1]]
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise UserError(f"{key}: a stage is [step, weight per source, ...], got {entry!r}")
        step = entry[0]
        if isinstance(step, bool) or not isinstance(step, int) or step < 2:
            raise UserError(
                f"{key}: a stage's first item is the step it starts at (>= 2), got {step!r}"
            )
        weights = tuple(
            _weight(weight, key, f"stage {step}'s source {index + 1}")
            for index, weight in enumerate(entry[1:])
        )
        stages.append((step, weights))
    return tuple(stages)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are loaded."""

    # gpt: embedded | synthetic | arrayrecord:<dir or glob> | hf:<datasets dir or data files>;
    # image models: images:<dir> | digits (scikit-learn's, no download) | synthetic
    source: str = "embedded"
    # Several token sources at once, in proportions: [[source, weight], ...] (a third item
    # names a source); each global batch holds each source's share of its rows
    mixture: tuple[MixtureSource, ...] = field(default=(), metadata={"parse": parse_mixture})
    # From a step on, other mixture weights: [[step, weight per source, ...], ...]
    mixture_stages: tuple[tuple[int, tuple[float, ...]], ...] = field(
        default=(), metadata={"parse": parse_stages}
    )
    # The model's tokenizer: byte, a tokenizer.json (or a directory with one; hf-import pins
    # its copy here) or a tokenizer's name. When set, an arrayrecord dataset must have been
    # converted with it (the file's sha256), and the byte-level embedded corpus is refused.
    tokenizer: str = ""
    hf_split: str = "train"  # hf:<path>: the split of a DatasetDict
    # hf:<path>: how a row reads: text (its hf_field), instruction (prompt and response
    # columns, the prompt masked from the loss) or chat (messages, in the chat template)
    hf_format: Literal["text", "instruction", "chat"] = "text"
    # hf:<path>: the text's column, the chat's messages' or the instruction's two (prompt,
    # response); empty: text, messages or prompt,response
    hf_field: str = ""
    # Where hf:<path> sources are tokenized once (process 0 writes; every process must see
    # it); empty: ~/.cache/paisoar_jax/hf
    cache_dir: str = ""
    # How a converted dataset's documents become windows (data/documents.py): stream (cut
    # anywhere, as pre-training reads), documents (whole ones packed, attention and positions
    # per document) or padding (one per window). Under train.objective=dpo a row holds one
    # preference pair (stream, padding) or pairs packed (documents)
    packing: Literal["stream", "documents", "padding"] = "stream"
    # The targets the loss learns: all, or response (those `convert text --format
    # instruction|chat` marked: the prompt is context); the loss averages over them alone
    loss_on: Literal["all", "response"] = "all"
    workers: int = 0  # grain worker processes (0: read in the main process)
    prefetch: int = 2  # global batches in flight on the devices
    # Stop at a batch whose floating arrays hold nan or inf (false: a loss that masks them)
    check_finite: bool = True
    eval_fraction: float = 0.05  # share of the data held out for eval (no data.eval_source)
    # A separate eval set, any token source data.source takes (arrayrecord:, hf:, embedded,
    # synthetic): eval reads all of it (embedded, synthetic: their eval split) and
    # data.source is trained on whole (data.eval_fraction unused); empty: held out as above
    eval_source: str = ""
    eval_hf_split: str = ""  # hf: the eval sets' split of a DatasetDict; empty: hf_split
    # More eval sets, each evaluated on its own cadence (and at the last step): [[source,
    # every, name, hf_split], ...] (name and hf_split optional), any token source, read as
    # data.eval_source is; every 0: train.eval_every's; hf_split: a DatasetDict's split
    # (default data.eval_hf_split's). metrics.jsonl reports each as eval_<name>_loss (and
    # perplexity) beside eval_loss.
    eval_sets: tuple[EvalSource, ...] = field(default=(), metadata={"parse": parse_eval_sets})
    min_crop_scale: float = 0.08  # images: smallest area share of a random-resized crop
    mixup_alpha: float = 0.0  # images: mixup's Beta(alpha, alpha); 0 turns mixup off
    # a resume onto data of another size or fingerprint: refuse it, or start the new data
    # from its first example
    on_change: Literal["refuse", "restart"] = "refuse"

    def __post_init__(self):
        check_at_least("data", self, {"prefetch": 1, "workers": 0})
        sources = [self.source, *(entry.source for entry in self.mixture), self.eval_source]
        sources += [entry.source for entry in self.eval_sets]
        for source in filter(None, sources):
            if (
                source.startswith(("hf:", "arrayrecord:", "images:"))
                and not source.partition(":")[2]
            ):
                raise UserError(f"data.source={source} names no path: {source}DIR")
        if self.hf_format == "instruction" and self.hf_field and self.hf_field.count(",") != 1:
            raise UserError(
                f"data.hf_field={self.hf_field}: an instruction has two columns, "
                f"data.hf_field=PROMPT,RESPONSE"
            )
        if not 0 <= self.eval_fraction < 1:
            raise UserError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0 < self.min_crop_scale <= 1:
            raise UserError(f"data.min_crop_scale must be in (0, 1], got {self.min_crop_scale}")
        if not (math.isfinite(self.mixup_alpha) and self.mixup_alpha >= 0):
            raise UserError(
                f"data.mixup_alpha must be a finite number >= 0, got {self.mixup_alpha}"
            )
        self._check_mixture()

    def eval_side(self, source: str = "", hf_split: str = "") -> DataConfig:
        """The data section an eval set is read with: it as the one source, whole.

        data.eval_source's, or `source`'s (one of data.eval_sets, read from its own
        `hf_split` when given); embedded and synthetic sources give their eval split.
        """
        source = source or self.eval_source
        return dataclasses.replace(
            self,
            source=source,
            hf_split=hf_split or self.eval_hf_split or self.hf_split,
            mixture=(),
            mixture_stages=(),
            eval_source="",
            eval_hf_split="",
            eval_sets=(),
            eval_fraction=0.0 if source.startswith(("arrayrecord:", "hf:")) else 0.05,
        )

    def train_side(self) -> DataConfig:
        """The data section data.source (or the mixture) is read with: whole with eval_source."""
        return dataclasses.replace(self, eval_fraction=0.0) if self.eval_source else self

    def _check_mixture(self) -> None:
        """Stages need a mixture, name one weight per source, in step order; all are read."""
        if not self.mixture:
            if self.mixture_stages:
                raise UserError("data.mixture_stages changes the weights of data.mixture: set it")
            return
        if self.source != "embedded":
            raise UserError(
                f"data.mixture replaces data.source (here {self.source}): name that source in "
                f"the mixture instead"
            )
        count, previous = len(self.mixture), 1
        for step, weights in self.mixture_stages:
            if step <= previous:
                raise UserError(
                    f"data.mixture_stages: the stage at step {step} comes after the one at "
                    f"step {previous}: give the stages in increasing step order"
                )
            if len(weights) != count:
                raise UserError(
                    f"data.mixture_stages: the stage at step {step} has {len(weights)} weights "
                    f"for the mixture's {count} sources"
                )
            previous = step
        for label, weights in self.weight_table():
            if not sum(weights) > 0:
                raise UserError(
                    f"data.mixture: the weights {label} are all 0: no source would be read"
                )
        for index, entry in enumerate(self.mixture):
            if not any(weights[index] > 0 for _, weights in self.weight_table()):
                raise UserError(
                    f"data.mixture: {entry.name} has weight 0 in every stage, so it is never "
                    f"read: give it a positive weight or remove it"
                )

    def weight_table(self) -> list[tuple[str, tuple[float, ...]]]:
        """(`from step N`, the weights) of the mixture's first stage and each later one."""
        first = ("from step 1", tuple(entry.weight for entry in self.mixture))
        return [first, *((f"from step {step}", weights) for step, weights in self.mixture_stages)]

    def image_keys_changed(self) -> list[str]:
        """The image augmentation keys set away from their defaults."""
        defaults = DataConfig()
        keys = ("min_crop_scale", "mixup_alpha")
        return [key for key in keys if getattr(self, key) != getattr(defaults, key)]
