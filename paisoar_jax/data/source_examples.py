"""`paisoar_jax.source_examples`: what `data.source` reads, as examples for `fit`.

The command line's zoo models read `data.source=images:DIR`, `arrayrecord:DIR`, `hf:PATH`
or `embedded`; a model of one's own gets the same examples, the same splits and the same
augmentation from one call, and hands them to `fit(data=train, eval_data=held_out)`:

    train, held_out = paisoar_jax.source_examples("images:photos", image_size=64)
    train, held_out = paisoar_jax.source_examples("arrayrecord:data/mine", seq_len=512)

Images are {"image": uint8 (size, size, channels), "label": int32}: training examples take a
new random-resized crop and flip each epoch (drawn from the example's position in the
run's stream, so a resumed run, on any topology, sees the same crops), held-out ones the
centre crop; the model scales the uint8 pixels itself. Token sources give what
`token_windows` gives: int32 windows of seq_len + 1 tokens, or dicts with loss masks and
document segments under data.packing / data.loss_on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grain

from paisoar_jax.config import DataConfig
from paisoar_jax.config.models import LanguageModelConfig
from paisoar_jax.data import images
from paisoar_jax.data.sources import open_source
from paisoar_jax.errors import UserError, one_line_errors


class ImageExamples:
    """Random-access decoded images of an `images:` source, with their epoch-wise stream.

    `examples[i]` is image i decoded and centre-cropped (what eval reads, and what a first
    look or a fingerprint reads); `example_stream(seed, shuffle)` is the endless stream the
    global sampler reads, augmented when shuffled for training and `augment` is on.
    """

    def __init__(
        self,
        source: images.ImageSource,
        *,
        image_size: int,
        channels: int,
        augment: bool,
        min_crop_scale: float,
    ):
        self.source, self.image_size, self.channels = source, image_size, channels
        self.augment, self.min_crop_scale = augment, min_crop_scale
        self.classes = source.classes

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        return self._in_order[index]

    @functools.cached_property
    def _in_order(self) -> grain.MapDataset:
        """The eval stream, built once (its first epoch: the source in order, as eval reads it)."""
        return self.example_stream(seed=0, shuffle=False)

    def example_stream(self, seed: int, shuffle: bool) -> grain.MapDataset:
        """The endless stream of examples, reshuffled and augmented each epoch when training."""
        return images.image_stream(
            self.source,
            seed=seed,
            image_size=self.image_size,
            train=shuffle and self.augment,
            channels=self.channels,
            min_crop_scale=self.min_crop_scale,
        )


@one_line_errors("paisoar_jax.source_examples")
def source_examples(
    source: str,
    *,
    seq_len: int = 0,
    image_size: int = 0,
    channels: int = 3,
    augment: bool = True,
    seed: int = 0,
    **data: Any,
) -> tuple[Any, Any]:
    """(train, held-out) examples of a `data.source` value, for `fit(data=..., eval_data=...)`.

    `source`: `images:DIR` (a class-per-folder tree or a `convert images` dataset; DIR/train
    beside DIR/val are the splits, else data.eval_fraction of the images is held out), then
    `image_size` (and `channels`, 3 or 1) are required; or a token source, `arrayrecord:DIR`,
    `hf:PATH` (tokenized once into data.cache_dir, as a run does) or `embedded`, then
    `seq_len` is. `data`: any other key of the config's data section (`eval_fraction`,
    `packing`, `loss_on`, `tokenizer`, `hf_field`, `min_crop_scale`, ...). The held-out
    examples are None when data.eval_fraction is 0 for a token source. Several processes:
    call `paisoar_jax.initialize()` first (process 0 tokenizes an hf: source while the
    others wait).

    Args:
        source: a data.source value (see above).
        seq_len: tokens per window, for a token source.
        image_size: pixels per side, for an image source.
        channels: 3 (RGB) or 1 (grayscale), for an image source.
        augment: random crops and flips of the training images (per epoch, exact on resume).
        seed: the seed of the augmentation.
        **data: other keys of the data section.

    Returns:
        (train, held-out) examples, as fit's data and eval_data take them. For an
            `images:` source each is an ImageExamples: `examples[i]` is image i decoded and
            centre-cropped, {"image": uint8 (size, size, channels), "label": int}.

    Example:
        ```python
        import pathlib

        import numpy as np
        from PIL import Image

        import paisoar_jax

        for label in ("dark", "light"):  # a class-per-folder tree of images
            folder = pathlib.Path("pictures", label)
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(4):
                shade = np.full((40, 40, 3), 30 * index + 120 * (label == "light"), np.uint8)
                Image.fromarray(shade).save(folder / f"{index}.png")
        train, held_out = paisoar_jax.source_examples(
            "images:pictures", image_size=32, eval_fraction=0.25
        )
        example = held_out[0]  # decoded and centre-cropped, as eval reads it
        print(len(train), example["image"].shape, example["label"])  # 6 (32, 32, 3) ...
        ```

    """
    data_config = _data_section(source, data)
    if source.startswith("images:"):
        return _image_examples(data_config, image_size, channels, augment)
    if not (source.startswith(("arrayrecord:", "hf:")) or source == "embedded"):
        raise UserError(
            f"source_examples: {source!r} is not images:DIR, arrayrecord:DIR, hf:PATH or embedded"
        )
    if seq_len <= 0:
        raise UserError(f"source_examples({source!r}) reads tokens: give seq_len > 0")
    if source.startswith("hf:"):
        from paisoar_jax.data import hf_sources  # datasets and tokenizers load only for hf:

        hf_sources.prepare(data_config)
    # The largest vocab: the dataset's own is checked against a model only when fit runs.
    model_config = LanguageModelConfig(seq_len=seq_len, vocab_size=2**31 - 1)
    train, held_out = open_source(data_config, model_config, seed)
    return train, held_out if data_config.eval_fraction > 0 else None


def _data_section(source: str, data: dict[str, Any]) -> DataConfig:
    """The data section of `source` and the other keys given (an unknown one is one line)."""
    known = {field.name for field in dataclasses.fields(DataConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(
            f"source_examples: {', '.join(unknown)} is not a key of the data section "
            f"(known: {', '.join(sorted(known - {'source'}))})"
        )
    return DataConfig(source=source, **data)


def _image_examples(
    data_config: DataConfig, image_size: int, channels: int, augment: bool
) -> tuple[ImageExamples, ImageExamples]:
    """The train (augmented) and held-out (centre-cropped) images of an images: source."""
    if image_size <= 0:
        raise UserError(f"source_examples({data_config.source!r}) reads images: give image_size")
    if channels not in (1, 3):
        raise UserError(f"source_examples: channels is 1 (grayscale) or 3 (RGB), not {channels}")
    train, held_out, _ = images.open_image_source(data_config.source, data_config.eval_fraction)
    images.warn_of_skipped_files(train, held_out)  # as a run warns (each process here)
    settings = {"image_size": image_size, "channels": channels}
    settings |= {"min_crop_scale": data_config.min_crop_scale}
    return (
        ImageExamples(train, augment=augment, **settings),
        ImageExamples(held_out, augment=False, **settings),
    )
