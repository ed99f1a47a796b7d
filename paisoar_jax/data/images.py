"""Image inputs: `images:<dir>` sources, grain decode and augmentation, device-side transforms.

Sources. `images:<dir>` names a class-per-folder tree (`DIR/CLASS/*.jpg`, read by
`ImageFolder`) or a dataset written by `python -m paisoar_jax.convert images` (a
`manifest.json`, read by `ImageRecords`); both give the same items in the same order. When
`DIR/train` exists beside `DIR/val` (or `DIR/eval`), those two are the splits, each a folder
or a converted dataset. Otherwise `eval_fraction` of the images is held out by a crc32 of
their index: stable for a given dataset, redrawn when images are added or removed.

Host pipeline (grain, in worker processes when workers > 0). Encoded bytes are decoded with
Pillow; training takes a random-resized crop (Inception-style, as torchvision's) and a random
horizontal flip, eval resizes the shorter side to size / 0.875 and takes the centre square
(the standard ImageNet eval). Batches stay uint8: a quarter of the bytes of float32 to move
to the device, where `normalize_on_device` runs inside the jitted step. Random transforms
draw from grain's per-element generator, seeded by (seed, transform) and the element's
position in the endless global stream, so each epoch gets new crops, and a resumed run, on
any topology, replays them exactly. Files that Pillow cannot verify were skipped when the folder
was scanned or converted; one that verifies but cannot be decoded (a truncated JPEG) stops
the run with a UserError naming it.
"""

from __future__ import annotations

import io
import math
import pathlib
import zlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from paisoar_jax import output
from paisoar_jax.data.pipeline import GlobalBatches, batch_dataset, example_stream
from paisoar_jax.data.records import MANIFEST_NAME, ImageFolder, ImageRecords
from paisoar_jax.errors import UserError

# Per-channel statistics of ImageNet in [0, 1]; the grayscale pair weights them as Pillow's
# RGB -> L conversion weights the channels (exact for the mean, close for the deviation).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LUMA_WEIGHTS = (0.299, 0.587, 0.114)
GRAYSCALE_MEAN = (sum(w * m for w, m in zip(LUMA_WEIGHTS, IMAGENET_MEAN, strict=True)),)
GRAYSCALE_STD = (sum(w * s for w, s in zip(LUMA_WEIGHTS, IMAGENET_STD, strict=True)),)
EVAL_SPLIT_NAMES = ("val", "eval")
HASH_BUCKETS = 10_000


class ImageSubset:
    """The items of a dataset at the given indices, each with its "index" in the dataset."""

    def __init__(self, source: ImageFolder | ImageRecords, indices: np.ndarray):
        self.source, self.indices = source, indices
        self.classes, self.directory = source.classes, source.directory

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return {**self.source[int(self.indices[index])], "index": int(self.indices[index])}


ImageSource = ImageFolder | ImageRecords | ImageSubset


def describe_item(source: ImageSource | None, index: int | None) -> str:
    """Where item `index` of an image source lives, for error messages."""
    if source is None or index is None:
        return "an image"
    if isinstance(source, ImageSubset):
        return describe_item(source.source, index)  # ImageSubset items carry the inner index
    if isinstance(source, ImageFolder):  # grain passes epoch * size + index: take it back
        return str(source.files[index % len(source.files)][0])
    where = getattr(source, "directory", type(source).__name__)
    return f"image {index % len(source) if len(source) else index} of {where}"


def open_dataset(directory: pathlib.Path) -> ImageFolder | ImageRecords:
    """A converted dataset when `directory` has a manifest, else a class-per-folder tree."""
    if (directory / MANIFEST_NAME).is_file():
        return ImageRecords(directory)
    return ImageFolder(directory)


def open_image_source(
    spec: str, eval_fraction: float = 0.05
) -> tuple[ImageSource, ImageSource, list[str]]:
    """(train source, eval source, class names) of `images:<dir>` (see the module docstring)."""
    if not spec.startswith("images:") or not spec.removeprefix("images:"):
        raise UserError(f"data.source={spec!r} is not images:<dir>")
    directory = pathlib.Path(spec.removeprefix("images:"))
    if not directory.is_dir():
        raise UserError(f"data.source={spec}: no such directory {directory}")
    eval_names = [name for name in EVAL_SPLIT_NAMES if (directory / name).is_dir()]
    if (directory / "train").is_dir() and eval_names:
        train, held_out = open_dataset(directory / "train"), open_dataset(directory / eval_names[0])
        if held_out.classes != train.classes:  # labels are class positions: they would differ
            differing = sorted(set(train.classes) ^ set(held_out.classes))
            raise UserError(
                f"{held_out.directory} and {train.directory} have different classes "
                f"({', '.join(differing[:3])}{', ...' if len(differing) > 3 else ''}): "
                f"labels would disagree"
            )
        return train, held_out, train.classes
    dataset = open_dataset(directory)
    # The embedded corpus hashes paths; records keep none, so the key is the index in the set.
    buckets = np.array([zlib.crc32(str(i).encode()) % HASH_BUCKETS for i in range(len(dataset))])
    is_eval = buckets < eval_fraction * HASH_BUCKETS
    if eval_fraction > 0 and (is_eval.all() or not is_eval.any()):
        raise UserError(
            f"data.eval_fraction={eval_fraction} of {len(dataset)} images of {directory} "
            f"leaves an empty train or eval split"
        )
    return (
        ImageSubset(dataset, np.flatnonzero(~is_eval)),
        ImageSubset(dataset, np.flatnonzero(is_eval)),
        dataset.classes,
    )


def warn_of_skipped_files(*sources: ImageSource) -> None:
    """One warning per image folder whose scan skipped files Pillow could not read."""
    folders = {id(folder): folder for folder in (getattr(s, "source", s) for s in sources)}
    for folder in folders.values():
        skipped = getattr(folder, "skipped", [])
        if skipped:
            output.warning(
                f"skipped {len(skipped)} unreadable image file(s) in "
                f"{folder.directory} (the first: {skipped[0]})"
            )


class TagIndex(grain.transforms.MapWithIndex):
    """Records each item's index in the source, so a decode error can name its file."""

    def map_with_index(self, index: int, element: dict) -> dict:
        """The element with an "index" key."""
        return {"index": index, **element}  # an ImageSubset's own (inner) index wins


class DecodeImage(grain.transforms.Map):
    """Encoded bytes -> {"image": uint8 (H, W, channels), "label": int32}."""

    def __init__(self, channels: int = 3, source: ImageSource | None = None):
        self.channels, self.source = channels, source

    def map(self, element: dict) -> dict:
        """The decoded element; UserError naming the file when Pillow cannot decode it."""
        if isinstance(element["image"], np.ndarray):  # an in-memory source: already pixels
            pixels = element["image"]
            if pixels.shape[-1] != self.channels:  # grey -> RGB or RGB -> grey, as Pillow does
                mode = "RGB" if self.channels == 3 else "L"
                image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
                pixels = np.asarray(image.convert(mode))
            return self._item(pixels, element["label"])
        try:
            with Image.open(io.BytesIO(element["image"])) as image:
                if image.mode.startswith("I;16"):  # Pillow's convert clips 16 bits to 255
                    image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
                pixels = np.asarray(image.convert("RGB" if self.channels == 3 else "L"))
        except Exception as error:  # Pillow raises many types for damaged data
            where = describe_item(self.source, element.get("index"))
            raise UserError(f"cannot decode {where}: {error}") from None
        return self._item(pixels, element["label"])

    def _item(self, pixels: np.ndarray, label: int) -> dict:
        """The output element: HWC uint8 pixels and an int32 label."""
        return {"image": pixels.reshape(*pixels.shape[:2], self.channels), "label": np.int32(label)}


def resize(pixels: np.ndarray, size: int, box: tuple[float, float, float, float]) -> np.ndarray:
    """The (left, top, right, bottom) box of an HWC uint8 image resized to size x size."""
    image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    resized = np.asarray(image.resize((size, size), Image.Resampling.BILINEAR, box=box))
    return resized.reshape(size, size, pixels.shape[-1])


class RandomResizedCrop(grain.transforms.RandomMap):
    """A crop of random area fraction `scale` and aspect `ratio`, resized to size x size."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ):
        self.size, self.scale, self.ratio = size, scale, ratio

    def crop_box(self, height: int, width: int, rng: np.random.Generator) -> tuple[int, ...]:
        """(top, left, crop height, crop width), always inside the image."""
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):  # torchvision's rejection sampling, then its central fallback
            area = height * width * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            crop_width = round(math.sqrt(area * aspect))
            crop_height = round(math.sqrt(area / aspect))
            if 0 < crop_width <= width and 0 < crop_height <= height:
                top = int(rng.integers(0, height - crop_height + 1))
                return top, int(rng.integers(0, width - crop_width + 1)), crop_height, crop_width
        aspect = width / height
        crop_height, crop_width = height, width
        if aspect < self.ratio[0]:
            crop_height = round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            crop_width = round(height * self.ratio[1])
        return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width

    def random_map(self, element: dict, rng: np.random.Generator) -> dict:
        """The element with its image cropped and resized."""
        pixels = element["image"]
        top, left, height, width = self.crop_box(*pixels.shape[:2], rng)
        box = (left, top, left + width, top + height)
        return {**element, "image": resize(pixels, self.size, box)}


class RandomFlip(grain.transforms.RandomMap):
    """A left-right mirror with probability one half."""

    def random_map(self, element: dict, rng: np.random.Generator) -> dict:
        """The element, mirrored or not."""
        if rng.random() < 0.5:
            return {**element, "image": element["image"][:, ::-1]}
        return element


class CenterCrop(grain.transforms.Map):
    """Shorter side resized to size / resize_ratio, then the central size x size square."""

    def __init__(self, size: int, resize_ratio: float = 0.875):
        self.size, self.resize_ratio = size, resize_ratio

    def map(self, element: dict) -> dict:
        """The element with its image centre-cropped to size x size."""
        height, width = element["image"].shape[:2]
        if height == width == self.size and self.resize_ratio == 1:
            return element
        # One resize of the matching source box equals resize-then-crop, for half the work.
        side = self.size * min(height, width) / round(self.size / self.resize_ratio)
        box = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
        return {**element, "image": resize(element["image"], self.size, box)}


def transform_seed(seed: int, transform: int) -> int:
    """A 32-bit seed per (run seed, transform): no two transforms draw the same numbers."""
    sequence = np.random.SeedSequence([seed % 2**63, transform])
    return int(sequence.generate_state(1)[0])


def image_stream(
    source: ImageSource,
    *,
    seed: int,
    image_size: int,
    train: bool,
    channels: int = 3,
    min_crop_scale: float = 0.08,
) -> grain.MapDataset:
    """The endless stream of decoded {"image", "label"} examples `image_batches` batches.

    Training shuffles by `seed` anew each epoch and augments (a random-resized crop, a
    random flip); eval keeps the order and centre-crops. A source whose `augment` attribute
    is False (digits, synthetic) is never augmented nor cropped, only resized.
    """
    augment = getattr(source, "augment", True)
    if channels not in (1, 3):
        raise UserError(f"images have 1 (grayscale) or 3 (RGB) channels, not {channels}")
    tagged = grain.MapDataset.source(source).map_with_index(TagIndex())
    # Decode and random transforms after repeat: their generator follows the position in
    # the endless global stream, so every epoch crops and flips each image anew, and the
    # crops of an example are the same whichever process reads it.
    stream = example_stream(tagged, seed, shuffle=train).map(DecodeImage(channels, source))
    if train and augment:
        crop_seed, flip_seed = (transform_seed(seed, op) for op in (0, 1))
        crop = RandomResizedCrop(image_size, scale=(min_crop_scale, 1.0))
        stream = stream.random_map(crop, seed=crop_seed)
        return stream.random_map(RandomFlip(), seed=flip_seed)
    return stream.map(CenterCrop(image_size, resize_ratio=0.875 if augment else 1.0))


def image_batches(
    source: ImageSource,
    *,
    global_batch: int,
    seed: int,
    image_size: int,
    train: bool,
    channels: int = 3,
    workers: int = 0,
    min_crop_scale: float = 0.08,
    process_index: int | None = None,
    process_count: int | None = None,
) -> GlobalBatches:
    """The {"image": uint8 (b, size, size, C), "label": int32 (b,)} batches this process reads.

    The global sampler's order (`pipeline`): training shuffles the whole source by `seed`,
    anew each epoch, and augments; eval keeps the order and centre-crops. A source whose
    `augment` attribute is False (digits, synthetic) is never augmented nor cropped: its
    whole images are resized to image_size, for training and eval alike.
    """
    stream = image_stream(
        source,
        seed=seed,
        image_size=image_size,
        train=train,
        channels=channels,
        min_crop_scale=min_crop_scale,
    )
    return batch_dataset(
        source,
        global_batch=global_batch,
        seed=seed,
        workers=workers,
        process_index=process_index,
        process_count=process_count,
        stream=stream,
    )


def channel_statistics(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) of ImageNet for RGB (3 channels) or grayscale (1 channel) images."""
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GRAYSCALE_MEAN, GRAYSCALE_STD)


def normalize_on_device(
    images: jax.Array, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=jnp.float32
) -> jax.Array:
    """uint8 NHWC images -> (images / 255 - mean) / std per channel, in `dtype`."""
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    # One multiply-add per pixel: the division by 255 and by std folded into one scale.
    scaled = images.astype(jnp.float32) * (1 / (255 * std)) - mean / std
    return scaled.astype(dtype)


def label_smoothing_targets(labels: jax.Array, num_classes: int, smoothing: float) -> jax.Array:
    """Soft float32 targets: 1 - smoothing on the label plus smoothing spread over all classes."""
    one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    return one_hot * (1 - smoothing) + smoothing / num_classes


def mixup(
    images: jax.Array, targets: jax.Array, key: jax.Array, alpha: float
) -> tuple[jax.Array, jax.Array]:
    """Mixup (Zhang et al. 2018): each example blended with the batch reversed, one lambda.

    Takes normalised float images and soft targets (B, classes); a lambda ~ Beta(alpha,
    alpha) mixes both. Normalisation is affine, so mixing before or after it is the same.
    alpha <= 0 turns mixup off.
    """
    if alpha <= 0:
        return images, targets
    weight = jax.random.beta(key, alpha, alpha)
    mixed_images = weight * images + (1 - weight) * images[::-1]
    return mixed_images.astype(images.dtype), weight * targets + (1 - weight) * targets[::-1]
