"""Several token sources in one run, in set proportions that may change by stage.

`data.mixture=[[embedded,0.75],[arrayrecord:/data/code,0.25]]`, optionally with
`data.mixture_stages=[[step, weights...], ...]`. Global batch b (trained at step b + 1) is a
pure function of the seed, b and the mixture:

    counts      source i's rows in batch b: D_i(B (k + 1)) - D_i(B k), with k the batches
                since the stage began and D the D'Hondt apportionment of that many rows by
                the stage's weights. D'Hondt is house-monotone (a count never goes down as
                rows are added) and gives each source at least floor(w_i n) of n rows, so
                over any stretch of batches a source's share is its weight to within a few
                rows, not a rounding error per batch.
    positions   source i's examples read before batch b: its position when the stage began
                plus D_i(B k). Each source has its own endless stream, in the order one
                source alone would be read (`stream_indices`: train.seed, a new shuffle each
                epoch); a source that runs out goes on with its next epoch.
    rows        the B rows are shuffled together by a hash of (seed, b), and process p reads
                its own slice, so any process or device count sees the same global batch.

A checkpoint keeps each source's position, by name, with its size and fingerprint, and the
mixture it was read with. A resume with the same mixture goes on exactly. One with other
weights, stages, sources or batch size goes on from every source's saved position (a new
source from its first example), and reads the new mixture from the next step as if its stage
in effect there began then: what an uninterrupted run with that change as a stage reads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from fractions import Fraction
from typing import Any

import grain
import jax
import numpy as np

from paisoar_jax.config import DataConfig
from paisoar_jax.data.pipeline import (
    ENDLESS,
    GlobalBatches,
    changed_data,
    dataset_identity,
    saved_identity,
    stream_indices,
)
from paisoar_jax.data.sources import splitmix64
from paisoar_jax.errors import UserError


def apportion(weights: tuple[Fraction, ...], rows: int) -> list[int]:
    """D'Hondt's split of `rows` by `weights` (summing to 1); ties go to the earlier source.

    Each source's lower quota floor(w n) first, then the rest one at a time to the largest
    w / (seats + 1): the `rows` largest of all quotients w / m, so a split of n rows lies
    within the split of n + 1.
    """
    seats = [math.floor(weight * rows) for weight in weights]
    for _ in range(rows - sum(seats)):
        best = max(range(len(weights)), key=lambda i: (weights[i] / (seats[i] + 1), -i))
        seats[best] += 1
    return seats


def weight_stages(data_config: DataConfig) -> list[tuple[int, tuple[Fraction, ...]]]:
    """(first batch, weights summing to 1) of each stage of the mixture, in order."""
    stages = [(0, tuple(entry.weight for entry in data_config.mixture))]
    stages += [(step - 1, weights) for step, weights in data_config.mixture_stages]
    return [
        (first, tuple(Fraction(weight) / sum(map(Fraction, weights)) for weight in weights))
        for first, weights in stages
    ]


@dataclasses.dataclass(frozen=True)
class MixtureSchedule:
    """How many examples of each source are read before any batch, from `origin` on.

    `stages`: (first batch, weights), the first beginning at `origin`, where the sources had
    read `origin_positions` examples.
    """

    stages: tuple[tuple[int, tuple[Fraction, ...]], ...]
    global_batch: int
    origin: int = 0
    origin_positions: tuple[int, ...] = ()

    @classmethod
    def of(cls, data_config: DataConfig, global_batch: int, origin=0, positions=None):
        """The mixture's schedule, counted from batch `origin` where `positions` were read."""
        stages = weight_stages(data_config)
        # the stage in effect at the origin begins there; those before it are history
        later = [first for first, _ in stages[1:]] + [ENDLESS]
        kept = [
            (max(first, origin), weights)
            for (first, weights), end in zip(stages, later, strict=True)
            if end > origin
        ]
        positions = positions or (0,) * len(data_config.mixture)
        return cls(tuple(kept), global_batch, origin, tuple(positions))

    def positions(self, batch: int) -> np.ndarray:
        """Examples of each source read before global batch `batch` (>= origin)."""
        total = np.array(self.origin_positions, dtype=np.int64)
        for index, (first, weights) in enumerate(self.stages):
            if batch <= first:
                break
            end = self.stages[index + 1][0] if index + 1 < len(self.stages) else batch
            total += apportion(weights, self.global_batch * (min(batch, end) - first))
        return total


def weights_at(data_config: DataConfig, step: int) -> tuple[float, ...]:
    """The mixture's weights (summing to 1) at training step `step` (from 1)."""
    begun = [weights for first, weights in weight_stages(data_config) if first < max(step, 1)]
    return tuple(float(weight) for weight in begun[-1])


class Mixture:
    """The train splits of a mixture's sources, by name (a dataset of all their examples)."""

    def __init__(self, names: tuple[str, ...], sources: tuple[Any, ...], specs: tuple[str, ...]):
        self.names, self.sources, self.specs = names, sources, specs

    def __len__(self) -> int:
        return sum(len(source) for source in self.sources)

    @functools.cached_property
    def identities(self) -> dict[str, dict[str, Any]]:
        """Each source's size and fingerprint (read once, when first asked for)."""
        return {name: dataset_identity(s) for name, s in zip(self.names, self.sources, strict=True)}

    @property
    def fingerprint(self) -> str:
        """One fingerprint of every source's (what tells one process's data from another's)."""
        text = repr(
            sorted((name, i["size"], i["fingerprint"]) for name, i in self.identities.items())
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class MixtureEval:
    """The held-out splits of a mixture's sources, by name; each is evaluated on its own."""

    def __init__(self, parts: dict[str, Any], data_config: DataConfig):
        self.parts, self.data_config = parts, data_config

    def __len__(self) -> int:
        return sum(len(source) for source in self.parts.values())

    def weights_at(self, step: int) -> dict[str, float]:
        """The mixture's weights at `step`, of the sources with eval data."""
        names = [entry.name for entry in self.data_config.mixture]
        weights = dict(zip(names, weights_at(self.data_config, step), strict=True))
        return {name: weights[name] for name in self.parts}

    @property
    def fingerprint(self) -> str:
        """One fingerprint of every part's."""
        return Mixture(tuple(self.parts), tuple(self.parts.values()), ()).fingerprint


ALONE = {"mixture": (), "mixture_stages": ()}  # one source of a mixture, as data.source


def open_mixture(data_config: DataConfig, open_one) -> tuple[Mixture, MixtureEval | None]:
    """(train, eval) of the mixture; `open_one(data_config)`: one source's (train, eval)."""
    opened = {}
    for entry in data_config.mixture:
        try:
            opened[entry.name] = open_one(
                dataclasses.replace(data_config, source=entry.source, **ALONE)
            )
        except UserError as error:
            raise UserError(f"data.mixture's {entry.name}: {error}") from None
    shapes = {name: _example_shape(train) for name, (train, _) in opened.items()}
    first = next(iter(shapes))
    for name, shape in shapes.items():
        if shape != shapes[first]:
            raise UserError(
                f"data.mixture: {name}'s examples are {shape}, {first}'s {shapes[first]}: every "
                f"source must give examples of one kind (the same model.seq_len, data.packing "
                f"and data.loss_on)"
            )
    names = tuple(opened)
    train = Mixture(
        names,
        tuple(pair[0] for pair in opened.values()),
        tuple(entry.source for entry in data_config.mixture),
    )
    held_out = {name: pair[1] for name, pair in opened.items() if pair[1] is not None}
    return train, (MixtureEval(held_out, data_config) if held_out else None)


def _example_shape(source: Any) -> Any:
    """The shapes and dtypes of a source's first example."""
    return jax.tree.map(lambda leaf: (np.shape(leaf), np.asarray(leaf).dtype.name), source[0])


class MixedRows(grain.transforms.Map):
    """Batch number -> the rows of that global batch one process reads.

    A module-level class: grain workers receive it pickled.
    """

    def __init__(self, sources, schedule: MixtureSchedule, seed: int, slot: int, slots: int):
        self.sources, self.schedule, self.seed = sources, schedule, seed
        self.slot, self.slots = slot, slots

    def map(self, batch: int) -> Any:
        """The rows of global batch `batch` this process reads, source by source."""
        width = self.schedule.global_batch
        starts = self.schedule.positions(batch)
        counts = self.schedule.positions(batch + 1) - starts
        source_B = np.repeat(np.arange(len(counts)), counts)
        position_B = starts[source_B] + np.arange(width) - (np.cumsum(counts) - counts)[source_B]
        keys = np.uint64(batch) * np.uint64(width) + np.arange(width, dtype=np.uint64)
        shuffled = np.argsort(splitmix64(keys ^ np.uint64(self.seed % 2**63)), kind="stable")
        rows = width // self.slots
        mine = shuffled[self.slot * rows : (self.slot + 1) * rows]
        pieces, taken = [], []
        for index in np.unique(source_B[mine]):
            picked = np.flatnonzero(source_B[mine] == index)
            source = self.sources[index]
            indices = stream_indices(position_B[mine][picked], len(source), self.seed, True)
            pieces.append(_read(source, indices))
            taken.append(picked)
        order = np.argsort(np.concatenate(taken))
        return jax.tree.map(lambda *parts: np.concatenate(parts)[order], *pieces)


def _read(source: Any, indices: np.ndarray) -> Any:
    """The examples at `indices`, stacked: at once where the source can."""
    if hasattr(source, "read_batch"):
        return source.read_batch(indices)
    return jax.tree.map(lambda *examples: np.stack(examples), *(source[int(i)] for i in indices))


class MixtureReads:
    """The global sampler's reads for a mixture (what `GlobalBatches` asks of its `reads`)."""

    def __init__(self, mixture: Mixture, schedule: MixtureSchedule, seed: int):
        self.mixture, self.schedule, self.seed = mixture, schedule, seed

    def batches(self, start: int, rows: int, process_index: int, process_count: int):
        """The rows of each global batch from example `start` (a whole batch) on, of a process."""
        read = MixedRows(
            self.mixture.sources, self.schedule, self.seed, process_index, process_count
        )
        return grain.MapDataset.range(start // self.schedule.global_batch, ENDLESS).map(read)


class MixtureBatches(GlobalBatches):
    """A mixture's global batches from a position on: `GlobalBatches` with per-source places.

    `get_state()` holds each source's position and identity, the mixture it was read with
    and where its schedule began; `continue_from` resumes from one (see the module docstring).
    """

    def __init__(
        self, mixture: Mixture, data_config: DataConfig, *, global_batch: int, seed: int, **options
    ):
        self.data_config = data_config
        schedule = MixtureSchedule.of(data_config, global_batch)
        super().__init__(
            MixtureReads(mixture, schedule, seed),
            source=mixture,
            global_batch=global_batch,
            seed=seed,
            **options,
        )
        self.mixture = mixture

    @property
    def batches_read(self) -> int:
        """Global batches read so far."""
        return self.examples // self.global_batch

    def spec(self) -> dict[str, Any]:
        """What the schedule depends on besides its origin: a changed one starts a new origin."""
        data = self.data_config
        return {
            "sources": [[entry.name, entry.weight] for entry in data.mixture],
            "stages": [[step, list(weights)] for step, weights in data.mixture_stages],
            "global_batch": self.global_batch,
            "seed": self.seed,
        }

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch read: the same on every process."""
        schedule, names = self.reads.schedule, self.mixture.names
        positions = schedule.positions(self.batches_read)
        return {
            "sampler": "mixture",
            "batches": self.batches_read,
            "positions": {name: int(n) for name, n in zip(names, positions, strict=True)},
            "sources": {
                name: {"source": spec, **self.mixture.identities[name]}
                for name, spec in zip(names, self.mixture.specs, strict=True)
            },
            "mixture": self.spec(),
            "origin": {
                "batch": schedule.origin,
                "positions": dict(zip(names, map(int, schedule.origin_positions), strict=True)),
            },
            "seed": self.seed,
        }

    def continue_from(self, saved: dict[str, Any] | None, step: int, on_change: str) -> str | None:
        """Moves to after `step` batches from a saved position; a line to print, or None.

        `saved`: a mixture's state, a single source's (`"sampler": "global"`: the source of
        the same identity goes on from it) or None (nothing to go on from).
        """
        self.close()
        self.examples = step * self.global_batch
        saved = saved or {}
        saved_positions, saved_sources = _saved_places(saved, self.mixture.identities)
        positions, news, notes = [], [], []
        renamed = _renamed(saved_sources, self.mixture.identities)
        for name in self.mixture.names:
            if name in renamed:  # the same data under another name: its place is kept
                saved_positions[name] = saved_positions[renamed[name]]
                saved_sources[name] = saved_sources.pop(renamed[name])
                notes.append(f"{name} was {renamed[name]}")
            identity, old = self.mixture.identities[name], saved_sources.get(name)
            if old is None:
                positions.append(0)
                news.append(name)
                continue
            if saved_identity(old) != identity:
                change = (
                    f"data.mixture: {name} had {old.get('size')} examples (fingerprint "
                    f"{old.get('fingerprint')}) at checkpoint step {step} and now has "
                    f"{identity['size']} ({identity['fingerprint']})"
                )
                notes.append(changed_data(change, on_change))
                positions.append(0)
                continue
            positions.append(int(saved_positions[name]))
        if (
            saved.get("sampler") == "mixture"
            and saved.get("mixture") == self.spec()
            and not (news or notes)
        ):
            origin = saved["origin"]
            names = self.mixture.names
            schedule = MixtureSchedule.of(
                self.data_config,
                self.global_batch,
                origin["batch"],
                tuple(origin["positions"][name] for name in names),
            )
            if list(schedule.positions(step)) == positions:  # the same mixture: go on exactly
                self.reads.schedule = schedule
                return None
        self.reads.schedule = MixtureSchedule.of(
            self.data_config, self.global_batch, step, tuple(positions)
        )
        places = ", ".join(
            f"{name} at example {n}"
            for name, n in zip(self.mixture.names, positions, strict=True)
            if name not in news
        )
        dropped = sorted(set(saved_sources) - set(self.mixture.names))
        if saved_sources:
            opening = f"the input changed since checkpoint step {step}: every source goes on "
            opening += f"from where it was{f' ({places})' if places else ''}"
        else:
            opening = f"checkpoint step {step} holds no position of these sources"
        said = [
            opening,
            *(f"{name} is new and starts from its first example" for name in news),
            *(f"{name} is no longer read" for name in dropped),
            *notes,
        ]
        return (
            "; ".join(said)
            + f"; the mixture's weights from step {step + 1} are {self._weights_line(step + 1)}"
        )

    def _weights_line(self, step: int) -> str:
        """`web 0.75, code 0.25`: the weights at `step`, and the stage they are of."""
        weights = weights_at(self.data_config, step)
        line = ", ".join(
            f"{name} {weight:.3g}" for name, weight in zip(self.mixture.names, weights, strict=True)
        )
        begun = [first for first, _ in self.data_config.mixture_stages if first <= step]
        return line + (f" (data.mixture_stages' stage from step {begun[-1]})" if begun else "")


def _renamed(saved_sources: dict[str, dict], identities: dict[str, dict]) -> dict[str, str]:
    """{name: its saved name} of the sources saved under another name (same size and data)."""
    unclaimed = {
        old: saved_identity(info) for old, info in saved_sources.items() if old not in identities
    }
    renamed = {}
    for name, identity in identities.items():
        if name in saved_sources:
            continue
        match = [old for old, seen in unclaimed.items() if seen == identity]
        if match:
            renamed[name] = match[0]
            del unclaimed[match[0]]
    return renamed


def _saved_places(saved: dict[str, Any], identities: dict[str, dict]) -> tuple[dict, dict]:
    """(position by name, identity by name) of a saved input position.

    One source's position (`"sampler": "global"`) belongs to the mixture's source of the same
    size and fingerprint, if any.
    """
    if saved.get("sampler") == "mixture":
        return dict(saved["positions"]), dict(saved["sources"])
    if saved.get("sampler") == "global":
        identity = saved_identity(saved)
        for name, own in identities.items():
            if own == identity:
                return {name: int(saved["examples"])}, {name: identity}
    return {}, {}


def examples_by_source(state: dict[str, Any] | None) -> dict[str, int]:
    """{"examples/<name>": examples read} of a mixture's position, for metrics.jsonl."""
    if not state or state.get("sampler") != "mixture":
        return {}
    return {f"examples/{name}": count for name, count in state["positions"].items()}
