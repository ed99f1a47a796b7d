"""The closing sample (paisoar_jax/tasks/sample.py): the cached decoder, window after window."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import build_run
from flax import nnx

from paisoar_jax.tasks.sample import generate


def test_the_closing_sample_is_the_full_forwards_greedy_text_window_by_window(devices):
    """At temperature 0 the sample is the likeliest byte after each window, as the model's
    plain forward gives it: 40 bytes after a 2-byte prompt take four 16-position windows
    (15 new bytes, then 9 after each last 8), decoded with rows split over data x fsdp."""
    overrides = ["model.seq_len=16", "mesh.data=2", "mesh.fsdp=2"]
    config, mesh, layout, state, _ = build_run(overrides, devices[:4])
    prompt, length, positions = b"ab", 40, config.model.positions
    text = generate(
        layout,
        state.params,
        state.model_state,
        mesh,
        prompt,
        length,
        config.model,
        jnp.float32,
        temperature=0.0,
    )
    # The plain forward over a window padded to the positions (a causal model's logits at a
    # position see nothing after it), one row per batch shard as the sample has.
    forward = jax.jit(
        lambda params, tokens: nnx.merge(layout.graphdef, params, state.model_state)(tokens)
    )
    with jax.set_mesh(mesh):
        expected, made, windows = list(prompt), 0, 0
        while made < length:
            window = expected[-positions:] if made == 0 else expected[-(positions // 2) :]
            new = min(length - made, positions - len(window) + 1)
            for _ in range(new):
                padded = np.zeros((4, positions), np.int32)
                padded[:, : len(window)] = window
                logits = forward(state.params, padded)[0, len(window) - 1]
                window.append(int(np.argmax(np.asarray(logits))))
                expected.append(window[-1])
            made, windows = made + new, windows + 1
    assert windows == 4 and len(text) == len(prompt) + length
    assert text == bytes(expected)


def test_a_window_of_one_position_samples_a_byte_at_a_time(devices):
    """model.seq_len=1: each window is the last byte alone, and the sample is still whole."""
    config, mesh, layout, state, _ = build_run(["model.seq_len=1", "mesh.data=1"], devices[:1])
    text = generate(
        layout, state.params, state.model_state, mesh, b"def", 5, config.model, jnp.float32
    )
    assert len(text) == 8 and text.startswith(b"def")
