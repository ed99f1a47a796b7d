"""Sequences split over mesh.context give one device's losses, gradients and steps."""

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import assert_steps_match, assert_trees_close, build_run, task_for, token_batches
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding
from paisoar_jax.parallel.context import balanced_order
from paisoar_jax.tasks.builtin import token_losses

LLAMA = ["model.name=llama", "model.kv_heads=2"]


def loss_and_gradients(overrides, devices):
    """(loss, gradients, compiled HLO text) of TINY + overrides on one fixed batch."""
    config, mesh, layout, state, _ = build_run(overrides, devices)
    task, batch = task_for(config), token_batches(1)[0]

    def loss(params):
        model = nnx.merge(layout.graphdef, params, state.model_state)
        return task.loss(model, batch, jax.random.key(0))[0]

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss)).lower(state.params).compile()
        value, gradients = compiled(state.params)
    return float(value), jax.device_get(gradients), compiled.as_text()


@functools.cache
def one_device(family: tuple[str, ...]):
    return loss_and_gradients(["mesh.data=1", *family], jax.devices()[:1])


@functools.cache
def context_8(family: tuple[str, ...], strategy: str, balanced: bool):
    overrides = ["mesh.data=1", "mesh.context=8", f"model.context_attention={strategy}"]
    overrides += [f"model.context_balance={str(balanced).lower()}", *family]
    return loss_and_gradients(overrides, jax.devices())


CASES = [
    ((), "gather", True),
    ((), "ring", False),
    (tuple(LLAMA), "ring", True),
    (tuple(LLAMA), "gather", True),
]
SLOW_CASES = [
    ((), "gather", False),
    ((), "ring", True),
    (tuple(LLAMA), "gather", False),
    (tuple(LLAMA), "ring", False),
]


@pytest.mark.parametrize(
    "family, strategy, balanced",
    [*CASES, *(pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES)],
    ids=lambda value: {(): "gpt", tuple(LLAMA): "llama"}.get(value, str(value)),
)
def test_context_8_gives_one_devices_loss_and_gradients(family, strategy, balanced, devices):
    """Causal, 32 tokens over 8 devices (4 each): gpt's learned positions, llama's rotary."""
    value, gradients, hlo = context_8(family, strategy, balanced)
    expected_value, expected_gradients, _ = one_device(family)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    assert_trees_close(gradients, expected_gradients, 1e-5, "gradients")
    # Each device holds its 4 tokens of the 16 x 32 batch's stream (width 64), and the
    # keys and values travel by all-gather or by collective-permute round the ring.
    assert "[16,4,64]" in hlo
    assert ("collective-permute" in hlo) == (strategy == "ring")


def test_ring_attention_equals_the_all_gather(devices):
    """The same split either way: llama, balanced, 8 devices (float tolerance: the ring
    folds the slices in another order)."""
    ring_value, ring_gradients, _ = context_8(tuple(LLAMA), "ring", True)
    gather_value, gather_gradients, _ = context_8(tuple(LLAMA), "gather", True)
    np.testing.assert_allclose(ring_value, gather_value, rtol=1e-6)
    assert_trees_close(ring_gradients, gather_gradients, 1e-5, "gradients")


def test_context_composes_with_fsdp_and_tensor(devices):
    """context=2 beside fsdp and tensor (heads split): llama."""
    mesh = ["mesh.data=1", "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2"]
    value, gradients, _ = loss_and_gradients([*mesh, *LLAMA], devices)
    expected_value, expected_gradients, _ = one_device(tuple(LLAMA))
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    assert_trees_close(gradients, expected_gradients, 1e-5, "gradients")


def test_training_steps_over_context_match_one_device(devices):
    """Two AdamW steps with ZeRO-1, remat and grad accumulation: losses and params, on
    data x context and on data x context x stage."""

    def steps(mesh, devices):
        overrides = [*LLAMA, "remat.policy=full", "train.grad_accum=2", "mesh.zero=1", *mesh]
        _, _, _, state, train_step = build_run(overrides, devices)
        initial, losses = jax.device_get(state.params), []
        for batch in token_batches(2):
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, (initial, jax.device_get(state.params))

    single, single_state = steps(["mesh.data=1"], devices[:1])
    split, split_state = steps(["mesh.data=2", "mesh.context=4"], devices)
    np.testing.assert_allclose(split, single, rtol=1e-5)
    assert_steps_match(split_state, single_state)
    # Beside pipeline stages (the step pipelines; its cells gather the keys and values).
    staged, staged_state = steps(["mesh.data=2", "mesh.context=2", "mesh.stage=2"], devices)
    np.testing.assert_allclose(staged, single, rtol=1e-5)
    assert_steps_match(staged_state, single_state)


@pytest.mark.parametrize("strategy", ["gather", "ring"])
def test_packed_documents_over_context_give_each_documents_own_losses(strategy, devices):
    """Three documents and padding in a row, split over 4 devices: each target's loss is
    that of its document run alone on one device (padding excluded)."""
    overrides = ["mesh.data=1", "mesh.context=4", "data.packing=documents", *LLAMA]
    overrides += [f"model.context_attention={strategy}"]
    _, mesh, layout, state, _ = build_run(overrides, devices[:4])
    rng = np.random.default_rng(0)
    lengths = [9, 13, 6]  # then 4 tokens of padding (segment 0)
    segments = np.repeat([1, 2, 3, 0], [*lengths, 4]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in [*lengths, 4]]).astype(np.int32)
    tokens = rng.integers(0, 256, (2, 33), dtype=np.int32)
    batch = {
        "tokens": tokens,
        "loss_mask": np.broadcast_to(segments > 0, (2, 32)),
        "segments": np.broadcast_to(segments, (2, 32)),
        "positions": np.broadcast_to(positions, (2, 32)),
    }

    def losses_of(params, batch):
        return token_losses(nnx.merge(layout.graphdef, params, state.model_state), batch)[0]

    with jax.set_mesh(mesh):
        packed = np.array(jax.jit(losses_of)(state.params, batch))
    packed[:, balanced_order(32, 4)] = packed.copy()  # back from the balanced layout
    model = nnx.merge(layout.graphdef, jax.device_get(state.params), state.model_state)
    start = 0
    for length in lengths:
        alone = tokens[:, start : start + length + 1]
        logits = model(alone[:, :-1])
        expected = optax.softmax_cross_entropy_with_integer_labels(logits, alone[:, 1:])
        np.testing.assert_allclose(packed[:, start : start + length], expected, rtol=2e-5)
        start += length


def test_decoding_runs_unsplit_on_a_context_mesh(devices):
    """The cached decoder on a context=4 mesh gives the full forward's next-token logits."""
    from paisoar_jax.models.decoding import empty_cache

    _, mesh, layout, state, _ = build_run(["mesh.data=2", "mesh.context=4", *LLAMA], devices)
    tokens = token_batches(1, batch=2)[0][:, :12]
    model = nnx.merge(layout.graphdef, state.params, state.model_state)

    @jax.jit
    def prefill_then_one(tokens):
        cache = empty_cache(model.config, 2, 16, np.float32)
        _, cache = model.decode(tokens[:, :11], cache, 0)
        return model.decode(tokens[:, 11:], cache, 11)[0][:, 0]

    with jax.set_mesh(mesh):
        decoded = np.asarray(prefill_then_one(tokens))
    whole = nnx.merge(layout.graphdef, jax.device_get(state.params), state.model_state)
    np.testing.assert_allclose(decoded, whole(tokens)[:, 11], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "settings, message",
    [
        (["mesh.context=4", "model.seq_len=36"], "does not cut into 2 x 4 equal pieces"),
        (
            ["mesh.context=4", "model.seq_len=34", "model.context_balance=false"],
            "does not cut into 4 equal pieces",
        ),
        (["mesh.context=2", "model.name=resnet"], "splits the sequences of the zoo's decoders"),
        (
            ["mesh.context=2", "model.attention=cudnn", "model.context_attention=ring"],
            "model.attention=cudnn does not run in ring attention's hops",
        ),
        (["mesh.context=2", "mesh.expert=2", "model.experts=4"], "do not combine yet"),
        (["mesh.context=0"], "mesh.context must be a positive size"),
        (["model.context_attention=ulysses"], "model.context_attention"),
    ],
)
def test_context_settings_that_cannot_work_are_refused_in_one_line(settings, message):
    with pytest.raises(UserError, match=message) as refused:
        load_config(None, settings)
    assert "\n" not in str(refused.value)


def test_the_mesh_reads_the_context_axis_and_splits_the_weights_over_it(devices):
    config = load_config(None, ["mesh.data=2", "mesh.context=4"])
    mesh = sharding.build_mesh(config.mesh, devices)
    assert sharding.mesh_sizes(mesh) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    assert sharding.batch_shards(mesh) == 2  # the context devices read the same rows
    _, _, layout, _, _ = build_run(["mesh.data=2", "mesh.context=2", "mesh.fsdp=2"], devices)
    embedding = layout.shardings.params["token_embedding"].spec  # vocab x embed
    assert tuple(embedding[1]) == ("fsdp", "context")


def run_plan(*arguments, status=0):
    """The --json plan of `plan --devices 8 TINY ...` in this process (or its error line)."""
    import contextlib
    import io
    import json

    from conftest import TINY

    from paisoar_jax.tools.plan import command as plan_command

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        found = plan_command.main(["--devices", "8", "--json", *TINY, *arguments])
    assert found == status, err.getvalue()
    if status:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and out.getvalue() == "", lines
        return lines[0]
    return json.loads(out.getvalue())


def test_plan_shows_the_split_and_proposes_a_context_size(devices):
    """The split's tokens and K/V bytes by hand; --context-for compiles each size."""
    from paisoar_jax.tools.plan.table import format_table

    result = run_plan(*LLAMA, "mesh.data=2", "mesh.context=4", "--context-for", "128")
    split = result["context"]
    assert split["tokens_per_device"] == 8 and split["context_shards"] == 4
    # A slice: 8 rows per device x (K, V) x 8 tokens x 2 kv heads of 16, fp32 on CPU; a
    # step: 2 layers x 2 passes (forward, backward; no remat) x 3 slices received.
    hop = 8 * 2 * 8 * 2 * 16 * 4
    assert split["kv_bytes_per_hop"] == hop
    assert split["kv_bytes_per_step"] == 2 * 2 * 3 * hop
    sizes = result["context_sizes"]["sizes"]
    assert [row["context"] for row in sizes] == [1, 2, 4, 8]
    whole, *split_sizes = [row["bytes"] for row in sizes]
    assert max(split_sizes) < whole  # a split device holds less than a whole sequence's
    assert result["context_sizes"]["proposal"] is None  # no limit: nothing to fit
    table = format_table(result)
    assert "context: mesh.context=4, 8 tokens per device, gather attention, balanced" in table
    assert "no limit to fit: give --target or train.memory_limit_gb" in table
    # Under a limit the whole sequence misses, the smallest split that fits is proposed.
    limit = f"train.memory_limit_gb={(whole - 1) / 2**30}"
    result = run_plan(*LLAMA, "mesh.data=2", "mesh.context=4", "--context-for", "128", limit)
    assert [row["fits"] for row in result["context_sizes"]["sizes"]] == [False] + [True] * 3
    assert result["context_sizes"]["proposal"] == [
        "model.seq_len=128",
        "mesh.context=2",
        "mesh.data=4",
    ]
    assert "propose: model.seq_len=128 mesh.context=2 mesh.data=4" in format_table(result)


def test_context_sizes_a_window_cannot_take_are_listed_with_the_reason(devices):
    sizes = run_plan(*LLAMA, "mesh.data=8", "--context-for", "24")["context_sizes"]["sizes"]
    assert [row["context"] for row in sizes] == [1, 2, 4, 8]
    assert sizes[3] == {"context": 8, "skipped": "24 tokens do not cut into 16 equal pieces"}
    assert all("bytes" in row for row in sizes[:3])


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--context-for", "0"], "--context-for '0' is not a number of tokens >= 1"),
        (["--context-for", "abc"], "--context-for 'abc' is not a number of tokens >= 1"),
    ],
)
def test_context_for_refuses_in_one_line(arguments, message, devices):
    assert message in run_plan(*arguments, status=2)


def test_context_for_refuses_an_image_model_in_one_line(devices):
    import contextlib
    import io

    from conftest import TINY_RESNET

    from paisoar_jax.tools.plan import command as plan_command

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan_command.main(["--devices", "8", *TINY_RESNET, "--context-for", "64"])
    lines = err.getvalue().strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert "--context-for plans a decoder's window" in lines[0]
