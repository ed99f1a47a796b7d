"""The train step compiled per batch signature: a changed batch shape warns and is counted."""

import jax
import numpy as np
from conftest import build_run, token_batches

from paisoar_jax.engine.compilation import CompiledStep, describe_change, signature
from paisoar_jax.parallel import sharding


def test_describe_change_names_the_input_and_how_it_changed():
    before = signature({"image": np.zeros((16, 8, 8, 3), np.uint8), "label": np.zeros(16)})
    after = signature({"image": np.zeros((8, 8, 8, 3), np.uint8), "label": np.zeros(8, np.int32)})
    text = describe_change(before, after)
    assert "['image'] shape (16, 8, 8, 3) -> (8, 8, 8, 3)" in text
    assert "['label'] shape (16,) -> (8,)" in text and "dtype float64 -> int32" in text


def test_a_new_batch_shape_recompiles_with_a_warning(devices, capsys):
    """A real step: the same shape runs the compiled program; a new one compiles, once."""
    config, mesh, layout, state, train_step = build_run(["mesh.data=8"], devices)
    long_batch, short_batch = token_batches(1)[0], token_batches(1, seq_len=16)[0]
    place = lambda batch: jax.device_put(batch, sharding.batch_sharding(mesh))  # noqa: E731
    with jax.set_mesh(mesh):
        step = CompiledStep(train_step, state, place(long_batch))
        state, _ = step(state, place(long_batch))
        assert step.recompiles == 0 and "compiling again" not in capsys.readouterr().err
        state, metrics = step(state, place(short_batch))
        assert np.isfinite(metrics["loss"]) and step.recompiles == 1
        warning = capsys.readouterr().err
        assert "compiling again because the batch changed: batch shape (16, 33) -> (16, 17)" in (
            warning
        )
        state, _ = step(state, place(short_batch))  # compiled already: no second warning
        state, _ = step(state, place(long_batch))
        assert step.recompiles == 1 and "compiling again" not in capsys.readouterr().err
    assert step.compile_s > 0 and step.compiled.memory_analysis() is not None
