"""`paisoar_jax.source_examples`: a data.source as fit's examples, read as a run reads it."""

import re

import datasets
import numpy as np
import optax
import pytest
from conftest import losses
from flax import nnx
from test_images import make_tree

import paisoar_jax
from paisoar_jax.config import DataConfig
from paisoar_jax.config.models import LanguageModelConfig
from paisoar_jax.data.images import image_batches, open_image_source
from paisoar_jax.data.sources import hf_cache_directory, open_source, token_windows
from paisoar_jax.data.user_data import open_user_data
from paisoar_jax.errors import UserError
from paisoar_jax.tools import convert


def first_batches(batches, count):
    return [next(batches) for _ in range(count)]


def test_an_image_folder_gives_the_batches_a_run_reads_with_new_crops_each_epoch(tmp_path):
    folder = make_tree(tmp_path / "photos")
    train, held_out = paisoar_jax.source_examples(f"images:{folder}", image_size=8, seed=0)
    run_train, run_held_out, classes = open_image_source(f"images:{folder}")
    assert train.classes == classes and (len(train), len(held_out)) == (
        len(run_train),
        len(run_held_out),
    )
    assert train[0]["image"].shape == (8, 8, 3) and train[0]["image"].dtype == np.uint8
    # Through fit's sampler, the same batches as the zoo's images:DIR pipeline: same order,
    # same crops and flips (training) and the same centre crops (eval).
    for examples, source, training in ((train, run_train, True), (held_out, run_held_out, False)):
        ours = open_user_data(examples, "data").batches(4, seed=3, shuffle=training, workers=0)
        theirs = image_batches(source, global_batch=4, seed=3, image_size=8, train=training)
        for mine, run in zip(first_batches(ours, 3), first_batches(theirs, 3), strict=True):
            np.testing.assert_array_equal(mine["image"], run["image"])
            np.testing.assert_array_equal(mine["label"], run["label"])
    # Each epoch draws new crops: an example's first and second epoch differ.
    stream = train.example_stream(seed=3, shuffle=True)
    epoch = len(train)
    firsts = [stream[i]["image"] for i in range(epoch)]
    seconds = [stream[epoch + i]["image"] for i in range(epoch)]
    repeated = sum(any(np.array_equal(a, b) for b in seconds) for a in firsts)
    assert repeated < epoch // 4, repeated
    # Held out: the centre crop, the same whatever the seed.
    np.testing.assert_array_equal(
        held_out.example_stream(0, False)[0]["image"], held_out.example_stream(9, False)[0]["image"]
    )


class Pixels(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(8 * 8 * 3, 3, rngs=rngs)

    def __call__(self, image):
        return self.out(image.reshape(image.shape[0], -1).astype("float32") / 255)


def pixel_loss(model, batch, rng):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), {}


def test_fit_trains_on_an_image_folder_and_resumes_exactly(tmp_path):
    folder = make_tree(tmp_path / "photos")
    train, held_out = paisoar_jax.source_examples(f"images:{folder}", image_size=8)

    def fit(run_dir, steps):
        settings = [f"run.dir={run_dir}", f"train.steps={steps}", "train.global_batch=8"]
        settings += ["train.log_every=1", "checkpoint.every=2", "run.progress=false"]
        settings += ["run.tensorboard=false", "optim.schedule=constant", "optim.warmup_steps=0"]
        paisoar_jax.fit(
            None,
            settings,
            model=Pixels,
            loss=pixel_loss,
            optimizer=optax.sgd(0.1),
            data=train,
            eval_data=held_out,
        )
        return losses(run_dir, steps)

    whole = fit(tmp_path / "whole", 4)
    fit(tmp_path / "cut", 2)
    resumed = fit(tmp_path / "cut", 4)
    assert resumed == whole  # the crops of steps 3 and 4 drawn as in the uncut run


def test_token_sources_give_the_windows_a_run_reads(tmp_path):
    rows = [{"text": f"def f_{i}(x):\n    return x * {i}\n"} for i in range(200)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "functions"))
    cache = tmp_path / "cache"
    train, held_out = paisoar_jax.source_examples(
        f"hf:{tmp_path / 'functions'}", seq_len=16, cache_dir=str(cache), eval_fraction=0.1
    )
    data = DataConfig(source=f"hf:{tmp_path / 'functions'}", cache_dir=str(cache))
    directory = hf_cache_directory(data, str(tmp_path / "functions"))
    # Plain text: its defaults are data.packing's and data.loss_on's (stream, all).
    windows, eval_windows = token_windows(str(directory), 16)
    assert held_out is not None and (len(train), len(held_out)) != (0, 0)
    assert len(train) + len(held_out) == len(windows) + len(eval_windows)
    np.testing.assert_array_equal(train[0], windows[0])
    arrayrecord, none = paisoar_jax.source_examples(
        f"arrayrecord:{directory}", seq_len=16, eval_fraction=0.0
    )
    assert none is None and len(arrayrecord) == len(train) + len(held_out)
    embedded, embedded_eval = paisoar_jax.source_examples("embedded", seq_len=32)
    run = open_source(DataConfig(), LanguageModelConfig(seq_len=32), seed=0)
    np.testing.assert_array_equal(embedded[5], run[0][5])
    assert len(embedded_eval) == len(run[1])


@pytest.mark.parametrize(
    ("source", "settings", "message"),
    [
        ("images:{folder}", {}, "reads images: give image_size"),
        ("images:{folder}", {"image_size": 8, "channels": 2}, "channels is 1 (grayscale) or 3"),
        ("images:{folder}", {"image_size": 8, "eval_fractio": 0.1}, "eval_fractio is not a key"),
        ("images:{folder}/nowhere", {"image_size": 8}, "no such directory"),
        ("embedded", {}, "reads tokens: give seq_len > 0"),
        ("digits", {"seq_len": 8}, "is not images:DIR, arrayrecord:DIR, hf:PATH or embedded"),
        ("arrayrecord:", {"seq_len": 8}, "names no path"),
        ("embedded", {"seq_len": 8, "packing": "documents"}, "data.packing=documents reads"),
    ],
)
def test_bad_input_is_one_line(tmp_path, source, settings, message):
    folder = make_tree(tmp_path / "photos")
    with pytest.raises(UserError, match=re.escape(message)) as raised:
        paisoar_jax.source_examples(source.format(folder=folder), **settings)
    assert "\n" not in str(raised.value)


def test_a_converted_image_dataset_reads_as_its_folder(tmp_path):
    folder = make_tree(tmp_path / "photos")
    convert.main(["images", "--input", str(folder), "--output", str(tmp_path / "records")])
    records, _ = paisoar_jax.source_examples(f"images:{tmp_path / 'records'}", image_size=8)
    files, _ = paisoar_jax.source_examples(f"images:{folder}", image_size=8)
    assert len(records) == len(files)
    np.testing.assert_array_equal(records[3]["image"], files[3]["image"])


def test_an_unreadable_image_is_skipped_with_the_runs_warning(tmp_path, capsys):
    folder = make_tree(tmp_path / "photos")  # holds bee/broken.jpg, which Pillow cannot read
    paisoar_jax.source_examples(f"images:{folder}", image_size=8)
    assert "skipped 1 unreadable image file(s)" in capsys.readouterr().err
