"""The image half of the input pipeline: sources, decode and augmentation, device transforms."""

import io
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from paisoar_jax.data.images import (
    GRAYSCALE_MEAN,
    GRAYSCALE_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    DecodeImage,
    RandomResizedCrop,
    channel_statistics,
    image_batches,
    label_smoothing_targets,
    mixup,
    normalize_on_device,
    open_image_source,
)
from paisoar_jax.data.records import ImageFolder
from paisoar_jax.errors import UserError
from paisoar_jax.tools import convert

CLASSES = ["ant", "bee", "cow"]
PER_CLASS = 6  # 18 images, a few per batch of 4


def write_image(path, pixels, format=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=format)


def make_tree(root, seed=0):
    """Random-noise images of varied sizes and kinds (JPEG, PNG, grayscale, RGBA) per class."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        for index in range(PER_CLASS):
            height, width = rng.integers(12, 30, 2)
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            kind = index % 4
            if kind == 2:
                pixels = pixels[..., 0]  # mode L
            if kind == 3:
                pixels = np.dstack([pixels, np.full((height, width), 200, np.uint8)])  # RGBA
            suffix = ".jpg" if kind == 0 else ".png"
            write_image(root / name / f"{label}_{index}{suffix}", pixels)
    (root / "bee" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")  # skipped by the scan
    return root


def uniform_tree(root, count, size=(10, 14)):
    """Images of one grey level each (10, 20, ...): any crop of image i is all 10 * (i + 1)."""
    for index in range(count):
        pixels = np.full((*size, 3), 10 * (index + 1), np.uint8)
        write_image(root / CLASSES[index % 3] / f"{index:03d}.png", pixels)
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("images") / "folder")


@pytest.fixture(scope="module")
def converted(tree):
    output = tree.parent / "converted"
    status = convert.main(
        ["images", "--input", str(tree), "--output", str(output), "--shards", "2", "--no-progress"]
    )
    assert status == 0
    return output


def take(dataset, count):
    iterator = iter(dataset)
    batches = list(itertools.islice(iterator, count))
    if hasattr(iterator, "close"):
        iterator.close()
    return batches


def batches_of(source, count, **options):
    options = {"global_batch": 4, "seed": 0, "image_size": 8, "train": True} | options
    return take(image_batches(source, **options), count)


def assert_same(one, other):
    assert len(one) == len(other)
    for first, second in zip(one, other, strict=True):
        assert first.keys() == second.keys() == {"image", "label"}
        for key in first:
            np.testing.assert_array_equal(first[key], second[key])


@pytest.mark.parametrize("train", [True, False])
def test_folder_and_its_converted_records_give_identical_batches(tree, converted, train):
    folder_train, folder_eval, classes = open_image_source(f"images:{tree}", eval_fraction=0.2)
    records_train, records_eval, same = open_image_source(f"images:{converted}", eval_fraction=0.2)
    assert classes == same == CLASSES
    assert len(folder_train) + len(folder_eval) == 3 * PER_CLASS
    assert_same(batches_of(folder_train, 6, train=train), batches_of(records_train, 6, train=train))
    assert_same(batches_of(folder_eval, 2, train=train), batches_of(records_eval, 2, train=train))


def test_batches_are_uint8_images_and_int32_labels(tree):
    source = ImageFolder(tree)
    for channels in (3, 1):
        for train in (True, False):
            batch = batches_of(source, 1, channels=channels, train=train, image_size=9)[0]
            assert batch["image"].shape == (4, 9, 9, channels) and batch["image"].dtype == np.uint8
            assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    labels = np.concatenate([b["label"] for b in batches_of(source, 9, train=False)])
    assert labels[: 3 * PER_CLASS].tolist() == sorted(labels[: 3 * PER_CLASS].tolist())


def test_random_crops_stay_inside_the_image():
    crop = RandomResizedCrop(16)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        height, width = (int(side) for side in rng.integers(1, 60, 2))
        if rng.random() < 0.1:
            height = width * 7  # extreme aspects reach the central fallback
        top, left, crop_height, crop_width = crop.crop_box(height, width, rng)
        assert 0 <= top and top + crop_height <= height and crop_height > 0
        assert 0 <= left and left + crop_width <= width and crop_width > 0
    # A crop of a uniform image is uniform: no pixel comes from outside the image.
    pixels = np.full((12, 30, 3), 77, np.uint8)
    for index in range(50):
        out = crop.random_map({"image": pixels, "label": 0}, np.random.default_rng(index))
        assert out["image"].shape == (16, 16, 3) and (out["image"] == 77).all()


def test_center_crop_is_the_middle_after_resizing_the_shorter_side():
    pixels = np.random.default_rng(0).integers(0, 256, (32, 40, 3), dtype=np.uint8)
    # size 28 / 0.875 = 32: no resize, so the crop is exactly the central 28 x 28.
    out = CenterCrop(28).map({"image": pixels, "label": 0})["image"]
    np.testing.assert_array_equal(out, pixels[2:30, 6:34])
    reference = np.asarray(Image.fromarray(pixels).resize((80, 64), Image.Resampling.BILINEAR))
    out = CenterCrop(56).map({"image": pixels, "label": 0})["image"]
    assert np.abs(out.astype(int) - reference[4:60, 12:68]).max() <= 2  # resize-then-crop


def test_train_augmentation_is_deterministic_per_seed_and_new_each_epoch(tree):
    source = ImageFolder(tree)  # 18 images: one epoch is 4.5 batches of 4
    first, again = batches_of(source, 9, seed=1), batches_of(source, 9, seed=1)
    assert_same(first, again)
    other = batches_of(source, 9, seed=2)
    assert not np.array_equal(first[0]["image"], other[0]["image"])
    # One image repeated: every element differs only by its crop and flip.
    one_image = [source[0]] * 8
    crops = np.concatenate([b["image"] for b in batches_of(one_image, 4, seed=1)])
    assert len({crop.tobytes() for crop in crops}) == len(crops)


def test_eval_batches_are_deterministic_and_in_order(tree):
    source = ImageFolder(tree)
    first = batches_of(source, 5, train=False, seed=1)
    assert_same(first, batches_of(source, 5, train=False, seed=7))
    decoded = DecodeImage(3).map(source[5])
    expected = CenterCrop(8).map(decoded)["image"]
    np.testing.assert_array_equal(first[1]["image"][1], expected)  # item 5, second batch
    # Batch 4 holds items 16, 17, then the second epoch's 0, 1: the same crops as batch 0.
    np.testing.assert_array_equal(first[4]["image"][2:], first[0]["image"][:2])


def pixel_levels(batches):
    return [int(image[0, 0, 0]) for batch in batches for image in batch["image"]]


def test_two_processes_read_their_rows_of_the_same_global_batches(tmp_path):
    source = ImageFolder(uniform_tree(tmp_path, 16))
    whole = batches_of(source, 4, global_batch=8, seed=3)  # crops and flips included
    shares = [
        batches_of(source, 4, global_batch=8, process_index=index, process_count=2, seed=3)
        for index in range(2)
    ]
    joined = [
        {key: np.concatenate([share[step][key] for share in shares]) for key in whole[step]}
        for step in range(4)
    ]
    assert_same(joined, whole)
    levels = pixel_levels(whole)
    assert sorted(levels[:16]) == sorted(levels[16:]) == [10 * (i + 1) for i in range(16)]


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_iterator_state_resumes_at_exactly_the_next_batch(tree, workers):
    source = ImageFolder(tree)
    options = dict(global_batch=4, seed=5, image_size=8, train=True)
    uninterrupted = take(image_batches(source, **options), 9)
    iterator = iter(image_batches(source, workers=workers, **options))
    consumed = [next(iterator) for _ in range(6)]  # past the first epoch (4.5 batches)
    state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint holds it
    if hasattr(iterator, "close"):
        iterator.close()
    resumed = iter(image_batches(source, workers=workers, **options))
    resumed.set_state(state)
    rest = [next(resumed) for _ in range(3)]
    if hasattr(resumed, "close"):
        resumed.close()
    assert_same(consumed + rest, uninterrupted)


def test_split_folders_and_the_hash_held_out_split(tree, converted, tmp_path):
    (tmp_path / "train").symlink_to(tree, target_is_directory=True)
    (tmp_path / "val").symlink_to(converted, target_is_directory=True)
    train, held_out, classes = open_image_source(f"images:{tmp_path}")
    assert (type(train).__name__, type(held_out).__name__) == ("ImageFolder", "ImageRecords")
    assert classes == CLASSES and len(train) == len(held_out) == 3 * PER_CLASS
    train, held_out, _ = open_image_source(f"images:{tree}", eval_fraction=0.3)
    again, _, _ = open_image_source(f"images:{tree}", eval_fraction=0.3)
    assert set(train.indices) == set(again.indices)  # stable
    assert not set(train.indices) & set(held_out.indices)
    assert len(train) + len(held_out) == 3 * PER_CLASS and 0 < len(held_out) < 3 * PER_CLASS
    assert held_out[0]["image"] == ImageFolder(tree)[int(held_out.indices[0])]["image"]


def test_undecodable_image_is_a_user_error_naming_its_file(tmp_path):
    uniform_tree(tmp_path, 3)
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="JPEG")
    truncated = tmp_path / "bee" / "cut.jpg"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) * 2 // 3])
    source = ImageFolder(tmp_path)  # Pillow's verify() passes a truncated JPEG
    assert truncated in [path for path, _ in source.files]
    with pytest.raises(UserError, match=f"cannot decode {truncated}: image file is truncated"):
        batches_of(source, 2, train=False)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("arrayrecord:/data", "data.source='arrayrecord:/data' is not images:<dir>"),
        ("images:", "data.source='images:' is not images:<dir>"),
        ("images:/no/such/dir", "data.source=images:/no/such/dir: no such directory"),
        ("images:{empty}", "has no class subfolders"),
        ("images:{unreadable}", "has no readable .jpg/.jpeg/.png images"),
        ("images:{mismatch}", "labels would disagree"),
    ],
)
def test_bad_sources_are_one_line_user_errors(tmp_path, spec, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "unreadable" / "cat").mkdir(parents=True)
    (tmp_path / "unreadable" / "cat" / "x.jpg").write_bytes(b"junk")
    uniform_tree(tmp_path / "mismatch" / "train", 3)
    uniform_tree(tmp_path / "mismatch" / "val", 2)  # lacks the third class
    with pytest.raises(UserError, match=message) as raised:
        names = ("empty", "unreadable", "mismatch")
        open_image_source(spec.format(**{name: tmp_path / name for name in names}))
    assert "\n" not in str(raised.value)


def test_normalisation_matches_numpy():
    images = np.random.default_rng(0).integers(0, 256, (2, 5, 4, 3), dtype=np.uint8)
    got = jax.jit(normalize_on_device)(images)
    expected = (images / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    gray = images[..., :1]
    mean, std = channel_statistics(1)
    assert (mean, std) == (GRAYSCALE_MEAN, GRAYSCALE_STD) and 0.45 < mean[0] < 0.47
    got = normalize_on_device(gray, mean, std, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == gray.shape
    np.testing.assert_allclose(
        np.asarray(got, np.float32), (gray / 255.0 - mean[0]) / std[0], rtol=1e-2, atol=1e-2
    )


def test_label_smoothing_and_mixup_keep_distributions():
    labels = jnp.array([0, 2, 4], jnp.int32)
    targets = label_smoothing_targets(labels, 5, 0.1)
    np.testing.assert_allclose(targets.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(targets[1], [0.02, 0.02, 0.92, 0.02, 0.02], rtol=1e-6)
    images = jax.random.normal(jax.random.key(0), (3, 4, 4, 3))
    mixed, mixed_targets = jax.jit(mixup, static_argnums=3)(images, targets, jax.random.key(1), 0.4)
    np.testing.assert_allclose(mixed_targets.sum(axis=1), 1.0, rtol=1e-6)
    weight = (float(mixed_targets[0, 0]) - 0.02) / 0.9  # example 0 (label 0) meets example 2
    assert 0 <= weight <= 1
    np.testing.assert_allclose(mixed[0], weight * images[0] + (1 - weight) * images[2], atol=1e-5)
    unchanged = mixup(images, targets, jax.random.key(1), 0.0)
    assert unchanged[0] is images and unchanged[1] is targets
