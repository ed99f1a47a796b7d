"""Generation with a key/value cache: the full forward's logits, transformers' greedy tokens."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import run_module, run_modules
from flax import nnx
from test_hf import gpt2, llama, mixtral, qwen3_moe

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.models.decoding import empty_cache
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.tasks.zoo import build_model
from paisoar_jax.tools import hf

PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([], marks=pytest.mark.slow),
        pytest.param(["model.position=rotary", "model.scan_layers=false"], marks=pytest.mark.slow),
        ["model.name=llama", "model.kv_heads=2", "model.rope_scaling=llama3"],
        ["model.name=llama", "model.experts=4", "model.experts_per_token=2"],
        # Rings of 4 slots, a prompt of 5 (more than a ring holds) then a token at a time:
        # on every block (stacked), and on every other block beside global ones (a tuple).
        ["model.name=llama", "model.sliding_window=4"],
        [
            "model.name=llama",
            "model.sliding_window=4",
            "model.global_every=2",
            "model.scan_layers=false",
        ],
    ],
)
def test_the_cache_gives_the_full_forward_logits(overrides):
    config = load_config(None, ["model.layers=2", "model.width=32", "model.seq_len=16", *overrides])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)
    full = np.asarray(model(tokens))
    cache = empty_cache(config.model, 2, 12, jnp.float32)
    logits, cache = model.decode(tokens[:, :5], cache, 0)
    stepped = [np.asarray(logits)]
    for index in range(5, 12):
        logits, cache = model.decode(tokens[:, index : index + 1], cache, jnp.int32(index))
        stepped.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(stepped, axis=1), full, atol=2e-5)


def test_a_sliding_block_holds_only_its_window():
    """Gemma's local blocks keep a ring of their window's slots; the global ones all."""
    config = load_config(
        None,
        ["model.name=llama", "model.layers=4", "model.sliding_window=4", "model.global_every=2"]
        + ["model.scan_layers=false", "model.kv_heads=2", "model.width=32"],
    )
    keys, values = empty_cache(config.model, 3, 20, jnp.float32)
    head = config.model.head_size
    assert [array.shape for array in keys] == [(3, slots, 2, head) for slots in (4, 20, 4, 20)]
    assert [array.shape for array in values] == [array.shape for array in keys]
    every_block = dataclasses.replace(config.model, global_every=0, scan_layers=True)
    assert empty_cache(every_block, 3, 20, jnp.float32)[0].shape == (4, 3, 4, 2, head)
    assert empty_cache(every_block, 3, 3, jnp.float32)[0].shape == (4, 3, 3, 2, head)


@pytest.mark.parametrize("window", [[], ["model.sliding_window=4"]])
def test_left_padded_rows_decode_as_each_prompt_alone(window):
    """Prompts of several lengths in one batch: each row's logits are its own prompt's."""
    config = load_config(None, ["model.name=llama", "model.layers=2", "model.width=32", *window])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
    prompts = [np.arange(1, 8), np.arange(20, 23)]  # 7 and 3 tokens
    starts = np.array([0, 4], np.int32)
    tokens = np.zeros((2, 7), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, starts[row] :] = prompt
    cache = empty_cache(config.model, 2, 9, jnp.float32)
    logits, cache = model.decode(tokens, cache, 0, starts)
    next_logits, _ = model.decode(np.array([[5], [6]], np.int32), cache, jnp.int32(7), starts)
    for row, prompt in enumerate(prompts):
        alone = empty_cache(config.model, 1, 9, jnp.float32)
        own, alone = model.decode(prompt[None].astype(np.int32), alone, 0)
        np.testing.assert_allclose(logits[row, -1], own[0, -1], atol=2e-5)
        own_next, _ = model.decode(np.array([[5 + row]], np.int32), alone, jnp.int32(len(prompt)))
        np.testing.assert_allclose(next_logits[row], own_next[0], atol=2e-5)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{name: (HF model, our export)} for a GQA Llama with Llama-3 rope and a GPT-2."""
    root = tmp_path_factory.mktemp("generate")
    models = {}
    for name, model in (("llama", llama()), ("gpt2", gpt2())):
        model.save_pretrained(root / name)
        hf.hf_import(root / name, root / f"{name}_ours")
        models[name] = (model, root / f"{name}_ours")
    return models


def transformers_greedy(model, prompt, count):
    model.generation_config.eos_token_id = None  # as many tokens as asked, as ours
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.checks("greedy", families=["llama", "gpt2"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_generation_gives_transformers_tokens(imported, name, tmp_path):
    model, ours = imported[name]
    tokens = ",".join(map(str, PROMPT))
    result = run_module(
        "generate",
        ours,
        *("--tokens", tokens, "--max-new", "10", "--greedy", "--json", "--ignore-eos"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "tokens": transformers_greedy(model, PROMPT, 10)
    }


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_batch_of_prompts_gives_transformers_tokens_for_each_compiled_once(
    imported, name, devices
):
    """Before: one prompt at a time, recompiled at every call, a host sync per token."""
    model, ours = imported[name]
    generator = Generator(ours, devices[:2])
    prompts = [list(range(3, 3 + length)) for length in (5, 2, 9, 3, 7)]
    first = generator.generate(prompts, 6, batch_size=4)
    again = generator.generate(prompts[::-1], 6, batch_size=4)[::-1]
    assert first == again == [transformers_greedy(model, prompt, 6) for prompt in prompts]
    assert generator.generate([], 6) == []
    (compiled,) = generator._compiled.values()
    # Rows of 4: the 4 longest (padded to 16 tokens), then the last alone (filled to 4 rows).
    assert compiled._cache_size() == 2


@pytest.mark.checks("greedy", families=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("build", [mixtral, qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_generates_transformers_greedy_tokens(devices, tmp_path, build):
    """A mixture of experts decodes token by token through its router, as transformers does."""
    model = build()
    model.save_pretrained(tmp_path / "hf")
    hf.hf_import(tmp_path / "hf", tmp_path / "ours")
    ours = Generator(tmp_path / "ours", devices[:1])
    assert ours.generate([PROMPT], 10)[0] == transformers_greedy(model, PROMPT, 10)


BAD_REQUESTS = [
    (["--prompt", "hello"], "no tokenizer is known for this model"),
    (["--tokens", "1,2,500"], "token 500 is outside the vocabulary (0..95)"),
    (["--tokens", "1,x"], "--tokens '1,x' is not a comma-separated list of token ids"),
    (["--tokens", "1,2", "--max-new", "40"], "need 41 positions, more than the model's 32"),
    (["--tokens", "1,2", "--max-new", "4", "--top-k", "97"], "--top-k 97 is more than"),
    (["--tokens", ",".join(["1"] * 33), "--max-new", "1"], "the prompt has 33 tokens, more than"),
    (["--tokens", "1,2", "--top-p", "0"], "--top-p in (0, 1]"),
]


@pytest.fixture(scope="module")
def refused_requests(imported, tmp_path_factory):
    """Each bad request's run, all started at once: {arguments: CompletedProcess}."""
    commands = [("generate", imported["gpt2"][1], *arguments) for arguments, _ in BAD_REQUESTS]
    results = run_modules(commands, cwd=tmp_path_factory.mktemp("refused"))
    return {
        tuple(arguments): result
        for (arguments, _), result in zip(BAD_REQUESTS, results, strict=True)
    }


@pytest.mark.parametrize("arguments, message", BAD_REQUESTS)
def test_bad_requests_get_one_line_and_exit_2(refused_requests, arguments, message):
    result = refused_requests[tuple(arguments)]
    assert result.returncode == 2
    assert result.stderr.strip().startswith("paisoar_jax.generate: error: ")
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_run_over_more_devices_is_placed_whole_here():
    from paisoar_jax.inference.generator import placement

    assert "mesh.fsdp=2" in placement(load_config(None, ["mesh.fsdp=2", "mesh.data=1"]).mesh, 8)
    for mesh in (["mesh.fsdp=-1", "mesh.data=1"], ["mesh.fsdp=8", "mesh.data=1"]):
        overrides = placement(load_config(None, mesh).mesh, 2)
        assert {"mesh.fsdp=1", "mesh.tensor=1", "model.attention=auto"} <= set(overrides)
        load_config(None, [*mesh, *overrides])  # a valid config


def test_a_missing_source_is_refused(tmp_path):
    with pytest.raises(UserError, match="no such run, checkpoint step or export directory"):
        Generator(tmp_path / "nowhere")


def test_generation_stops_at_the_end_of_sequence_token_as_transformers_does(imported, devices):
    """Before: greedy output ran past the end-of-sequence token transformers stops at."""
    import shutil

    model, ours = imported["gpt2"]
    copy = ours.parent / "gpt2_eos"
    if not copy.exists():
        shutil.copytree(ours, copy)
    going_on = Generator(ours, devices[:1]).generate([PROMPT], 10)[0]  # no stop ids: all 10
    end = going_on[2]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    stopping = Generator(copy, devices[:1])
    assert stopping.end_ids == (end,)
    expected = going_on[: going_on.index(end) + 1]  # the end token itself is the last
    assert stopping.generate([PROMPT], 10, stop_at=stopping.end_ids)[0] == expected
    model.generation_config.eos_token_id = end
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert out[0, len(PROMPT) :].tolist() == expected
    # --temperature 0 is greedy (it was refused).
    assert stopping.generate([PROMPT], 5, greedy=False, temperature=0.0)[0] == going_on[:5]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 5, 1.0), (1.0, 0, 0.8), (0.5, 10, 0.9), (1.3, 0, 0.3)]
)
def test_sampling_filters_give_transformers_probabilities(temperature, top_k, top_p):
    """top-k, top-p and temperature leave the probabilities transformers' warpers leave."""
    from transformers.generation import logits_process as warpers

    from paisoar_jax.models.decoding import filtered_logits

    logits = np.random.default_rng(1).normal(size=(3, 96)).astype(np.float32) * 3
    ours = np.asarray(
        jax.nn.softmax(filtered_logits(jnp.asarray(logits), temperature, top_k, top_p))
    )
    scores = torch.tensor(logits)
    chain = [warpers.TemperatureLogitsWarper(temperature)]
    chain += [warpers.TopKLogitsWarper(top_k)] if top_k else []
    chain += [warpers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    for warper in chain:
        scores = warper(None, scores)
    theirs = torch.softmax(scores, dim=-1).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    assert ((ours > 0) == (theirs > 0)).all()
