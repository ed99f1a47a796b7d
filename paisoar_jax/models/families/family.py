"""What a model family is: one Hugging Face architecture, in one slice of the models wing.

A `Family` says everything that is particular to one architecture: transformers' names for
it, the zoo decoder that runs it (its model code), each tensor's HF name and layout
(`Tensor`s), the config.json it reads and writes, and the shipped configs of its shape. The
shared pieces stay where every family finds them: attention with its sliding window
(models/attention.py), rotary positions with their scalings (models/rotary.py), the norms
(models/layers.py), the decoder block and stack (models/gpt.py), the llama block with its
options (models/llama.py), the router and experts (models/moe.py). Adding a family is one
module beside this one and one line in the registry (families/__init__.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from collections.abc import Callable

import numpy as np

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError

Convert = Callable[[np.ndarray, LanguageModelConfig], np.ndarray]
# The training window (model.seq_len) an import starts with, at most; the model keeps all
# its positions (model.max_positions), which the export writes back.
MAX_TRAINING_WINDOW = 2048


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: our dotted path, HF's name, and the two conversions.

    In HF's name {i} is the layer and {j} the expert; the conversions take one HF tensor
    (a layer's, or a layer's expert's). HF's Linear stores out x in, GPT-2's Conv1D in x
    out; our kernels are in x out, with heads as an axis of their own.
    """

    ours: str
    theirs: str
    to_ours: Convert = lambda array, config: array  # noqa: E731
    to_theirs: Convert = lambda array, config: array  # noqa: E731
    # Which blocks hold it, where they differ (model.scan_layers=false): Qwen3-MoE's experts
    # on every decoder_sparse_step-th, its dense MLP on the others.
    on_layer: Callable[[LanguageModelConfig, int], bool] = lambda config, layer: True  # noqa: E731
    # (index, count): ours is every count-th feature of HF's last axis from index (GPT-OSS's
    # gate and up interleaved in one gate_up_proj); the export adds the parts into one.
    interleaved: tuple[int, int] | None = None
    # Model state, not a parameter (no gradient moves it): DeepSeek-V3's router bias, which
    # bias balancing moves (models/moe.py); an import writes it as the export's model state.
    state: bool = False


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face architecture and how a zoo decoder holds it."""

    hf_type: str  # config.json's model_type
    architecture: str  # transformers' class, config.json's architectures
    model: str  # the zoo decoder's class that runs it, dotted (its model.name is zoo_name)
    zoo_name: str  # model.name of that decoder
    tensors: Callable[[LanguageModelConfig], tuple[Tensor, ...]]
    from_hf: Callable[[dict, pathlib.Path], LanguageModelConfig]  # config.json -> model
    # model section -> config.json; None: it exports as another family (a Mistral as a Llama)
    to_hf: Callable[[LanguageModelConfig], dict] | None
    # whether a model section is this family's export form (the registry asks each in turn)
    holds: Callable[[LanguageModelConfig], bool]
    configs: tuple[str, ...] = ()  # the shipped configs of its shapes (configs/NAME.yaml)

    def model_class(self) -> type:
        """The zoo decoder's class (imported when asked: the tables need no jax)."""
        module, _, name = self.model.rpartition(".")
        return getattr(importlib.import_module(module), name)


def refuse_settings(
    refused: dict[str, bool], hf: dict, where: pathlib.Path, name: str, hints: dict | None = None
) -> None:
    """One line for the first config.json setting in `refused` that is true.

    Each is a setting of a `name` whose logits the zoo's decoder would not give; `hints`
    add a way out, by setting.
    """
    for key, bad in refused.items():
        if bad:
            hint = (hints or {}).get(key, "")
            raise UserError(f"{where}: {key}={hf[key]} is not a {name} this model reads{hint}")


def refuse_differences(
    model: LanguageModelConfig, differences: dict[str, bool], holds: str
) -> None:
    """One line for the first model key in `differences` that is true.

    Each is what the HF class `holds` (a phrase) has no form for: its export would compute
    otherwise.
    """
    for key, differs in differences.items():
        if differs:
            value = getattr(model, key.removeprefix("model."))
            raise UserError(f"{holds}: this model has {key}={value}")


def transposed(ours: str, theirs: str) -> Tensor:
    """An HF Linear (out, in) as our (in, out) kernel."""
    return Tensor(ours, theirs, lambda array, config: array.T, lambda array, config: array.T)


def norm(ours: str, theirs: str) -> tuple[Tensor, Tensor]:
    """A LayerNorm's scale and bias."""
    return Tensor(f"{ours}.scale", f"{theirs}.weight"), Tensor(f"{ours}.bias", f"{theirs}.bias")


def interleaved(ours: str, theirs: str, index: int, count: int) -> Tensor:
    """One of `count` tensors interleaved on HF's last axis, ours from feature `index` on."""

    def to_theirs(array, model):  # (the model section, unused)
        import jax.numpy as jnp  # (traced for the shape check, numpy arrays at export)

        whole = jnp.zeros((*array.shape[:-1], array.shape[-1] * count), array.dtype)
        return whole.at[..., index::count].set(array)

    return Tensor(
        ours,
        theirs,
        lambda array, config: array[..., index::count],
        to_theirs,
        interleaved=(index, count),
    )
