"""Image classification through the trainer: global BatchNorm, statistics in the state,
accumulation, eval with running statistics, resume, the digits run and bad input."""

import jax
import numpy as np
import pytest
from conftest import (
    TINY,
    TINY_RESNET,
    build_run,
    run_modules,
    run_records,
    task_for,
    train,
)
from PIL import Image

from paisoar_jax.config import load_config
from paisoar_jax.parallel import sharding
from paisoar_jax.tasks.builtin import ImageClassification, LanguageModelling


def image_batch(batch=16, size=16, seed=0):
    """A fixed batch of random uint8 images and labels."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
        "label": rng.integers(0, 10, (batch,), dtype=np.int32),
    }


def one_step(overrides, devices, batch):
    """(metrics, state) after one train step on `devices` from the seed's initial state."""
    config, mesh, layout, state, train_step = build_run(overrides, devices, base=TINY_RESNET)
    with jax.set_mesh(mesh):
        state, metrics = train_step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    return jax.device_get(metrics), jax.device_get(state)


def test_tasks_follow_the_model():
    assert isinstance(task_for(load_config(None, TINY_RESNET)), ImageClassification)
    assert isinstance(task_for(load_config(None, [])), LanguageModelling)


def image_folder(root, classes, files=2, size=20, corrupt=False):
    """DIR/CLASS/*.png with random images (or files that are not images)."""
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(files):
            path = root / name / f"{index}.png"
            if corrupt:
                path.write_bytes(b"not an image")
            else:
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(path)
    return root


BAD_IMAGE_INPUTS = {
    "embedded": "model.name=resnet reads images: use images:<dir>, digits or synthetic",
    "vgg_size": "model.image_size=40 does not suit VGG: it must be a multiple of 32",
    "vit_variant": "model.variant='vit_b16' is not a resnet model",
    "token_key": "unknown config key model.vocab_size",
    "no_classes": "has no class subfolders",
    "unreadable": "has no readable .jpg/.jpeg/.png images",
    "too_many_classes": "has 3 classes, more than model.num_classes=2",
    "smoothing": "model.label_smoothing must be in [0, 1), got 1.5",
}


def bad_image_arguments(case, folder):
    """The overrides of one bad input, with the folder it reads made as the case needs."""
    args = {
        "embedded": ["data.source=embedded"],
        "vgg_size": ["model.name=vgg", "model.variant=vgg11", "model.image_size=40"],
        "vit_variant": ["model.variant=vit_b16"],
        "token_key": ["model.vocab_size=256"],
        "smoothing": ["model.label_smoothing=1.5"],
    }.get(case, [f"data.source=images:{folder}"])
    if case == "no_classes":
        folder.mkdir()
    elif case == "unreadable":
        image_folder(folder, ["a", "b"], corrupt=True)
    elif case == "too_many_classes":
        image_folder(folder, ["a", "b", "c"], files=4)
        args.append("model.num_classes=2")
    return args


@pytest.fixture(scope="module")
def image_refusals(tmp_path_factory):
    """Each bad input's run, all started at once: {case: CompletedProcess}."""
    root = tmp_path_factory.mktemp("image-refusals")
    commands = [
        # TINY_RESNET's own name comes first, so a later model.name wins.
        ("train", *TINY_RESNET, *bad_image_arguments(case, root / f"images-{case}"), "run.dir=out")
        for case in BAD_IMAGE_INPUTS
    ]
    results = run_modules(commands, cwd=root, timeout=180)
    return dict(zip(BAD_IMAGE_INPUTS, results, strict=True))


@pytest.mark.parametrize("case, message", BAD_IMAGE_INPUTS.items())
def test_bad_image_input_gets_one_line_and_exit_2(image_refusals, case, message):
    result = image_refusals[case]
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("paisoar_jax.train: error: ") and message in lines[0], lines[0]


def test_named_eval_sets_of_a_zoo_model_run_on_their_cadence(tmp_path):
    """data.eval_sets: `text` is the default set's own source (the embedded held-out split),
    so its numbers are eval_loss's; `noise` is evaluated at its steps and the last."""
    overrides = [*TINY, "train.steps=4", "train.eval_every=3", f"run.dir={tmp_path}"]
    overrides += ["data.eval_sets=[[synthetic,2,noise],[embedded,0,text]]"]
    config = load_config(None, overrides)
    summary = train(config)
    records = {record["step"]: record for record in run_records(tmp_path) if "step" in record}
    assert set(records[2]) & {"eval_loss", "eval_text_loss"} == set()
    assert "eval_noise_loss" in records[2] and "eval_noise_perplexity" in records[2]
    assert {"eval_loss", "eval_text_loss"} <= set(records[3]) and "eval_noise_loss" not in records[
        3
    ]
    assert {"eval_loss", "eval_text_loss", "eval_noise_loss"} <= set(records[4])
    assert summary["eval_text_loss"] == summary["eval_loss"]
    assert summary["eval_noise_loss"] > summary["eval_loss"]  # random tokens: nothing to learn
    assert load_config(tmp_path / "config.yaml").data.eval_sets == config.data.eval_sets
