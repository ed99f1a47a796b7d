"""Muon (optim.name=muon): the hidden matrices orthogonalised, everything else by AdamW.

Muon (momentum orthogonalised by Newton-Schulz; optax.contrib.muon) steps each weight matrix
by the orthogonal factor of its momentum. Which parameters are matrices, and which of their
axes are the matrix's rows and columns, comes from the parameters' logical axes (the
sharding rules' names), as the model declares them:

- the stacked axes are batch axes, each slice its own matrix: `layers` (a scanned stack)
  and `experts` (a mixture's);
- the input is the first axis when it is a width the activations come in with (`embed`,
  `latent`: x @ W with W = D x ...), else every axis but the last (the attention's output
  heads x head_dim -> D, an expert's mlp -> D); the output is the rest;
- AdamW keeps the embeddings and the output head (`vocab`), the router (`router`), norms,
  biases, a convolution's kernel, anything with fewer than two axes of its own, and
  parameters declared without names (a model of one's own: its 2-D ones go to Muon).

Muon's updates are scaled to an RMS of optim.muon_consistent_rms (0.2: AdamW's typical
update RMS, so one learning rate serves both halves; 0: optax's shape scaling), weight decay
is decoupled on both halves and never on norms and biases (optim.decay_mask's rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers

from paisoar_jax.config import OptimConfig

STACKED = ("layers", "experts")  # batch axes of a parameter: each slice one matrix
INPUT_WIDTHS = ("embed", "latent")  # a first axis of these names is the matrix's input
ADAMW_NAMES = ("vocab", "router", "norm", "classes", "conv_in", "conv_out")
NOT_MATRICES = ("bias", "scale")  # by the parameter's own name: norms' scales and biases


@dataclasses.dataclass(frozen=True)
class NeedsAxes:
    """An optimizer built from the parameters' logical axes (state_layout builds it).

    `build(logical_specs, shapes)`: the chain, given the trained parameters'
    PartitionSpecs of logical names and their shapes (trees of the parameters).
    """

    build: Callable[[Any, Any], optax.GradientTransformation]


def matrix_axes(names: tuple, ndim: int, leaf_name: str) -> MuonDimensionNumbers | None:
    """A parameter's matrix axes for Muon from its logical names; None: AdamW's."""
    if leaf_name.endswith(NOT_MATRICES) or any(name in ADAMW_NAMES for name in names):
        return None
    if not any(names):  # declared without names: a 2-D parameter is a matrix
        return MuonDimensionNumbers(0, 1) if ndim == 2 else None
    own = [axis for axis, name in enumerate(names) if name not in STACKED]
    if len(own) < 2:
        return None
    if names[own[0]] in INPUT_WIDTHS:
        return MuonDimensionNumbers(tuple(own[:1]), tuple(own[1:]))
    return MuonDimensionNumbers(tuple(own[:-1]), tuple(own[-1:]))


def muon_axes_tree(logical_specs, shapes) -> Any:
    """The tree of `matrix_axes` (None for AdamW's) for trained params and their specs."""

    def one(path, spec, shape) -> MuonDimensionNumbers | None:
        last = path[-1]
        leaf_name = str(getattr(last, "key", getattr(last, "name", last)))
        names = tuple(spec) if isinstance(spec, PartitionSpec) else ()
        names += (None,) * (len(shape.shape) - len(names))
        return matrix_axes(names, len(shape.shape), leaf_name)

    return jax.tree_util.tree_map_with_path(
        one, logical_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
    )


def build_muon(
    optim_config: OptimConfig,
    lr_schedule: optax.Schedule,
    axes_tree,
    adamw: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """optax.contrib.muon over the matrices of `axes_tree`, `adamw` (the config's) the rest."""
    labels = jax.tree.map(
        lambda axes: "adamw" if axes is None else "muon",
        axes_tree,
        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers),
    )
    rms = optim_config.muon_consistent_rms or None
    muon = optax.contrib.muon(
        lr_schedule,
        beta=optim_config.muon_momentum,
        weight_decay=optim_config.weight_decay,
        # (None where AdamW's half holds the parameter: masked out of Muon's)
        muon_weight_dimension_numbers=axes_tree,
        consistent_rms=rms,
    )
    return optax.multi_transform({"muon": muon, "adamw": adamw}, labels)
