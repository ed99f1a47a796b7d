"""Generation prompts tokenized as transformers tokenizes them (Llama 3, ChatML templates),
and paisoar_jax.load of a zoo run, an export or an import without a model factory."""

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY, run_module, trained_bpe
from flax import nnx
from test_hf import llama

import paisoar_jax
from paisoar_jax.inference.generator import Generator
from paisoar_jax.tools import hf

# Meta-Llama-3-8B-Instruct's template: BOS from {{ bos_token }}, which the tokenizer's
# post-processor would add again to the rendered text.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def llama3_tokenizer(directory):
    """A byte-level BPE with Llama 3's special tokens, BOS post-processor and template."""
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    tokenizer = trained_bpe([*specials, "<|end_header_id|>", "<|eot_id|>"])
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", 0)],
            ),
        ]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_models(chat_tokenizer, tmp_path_factory):
    """{name: (transformers model, its tokenizer, our import)}: Llama 3's template, ChatML's."""
    root = tmp_path_factory.mktemp("chat_models")
    found = {}
    for name in ("llama3", "chatml"):
        source = root / name
        if name == "llama3":
            llama3_tokenizer(source)
        else:
            for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                (source / file).parent.mkdir(exist_ok=True)
                (source / file).write_bytes((chat_tokenizer / file).read_bytes())
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        model = llama(vocab_size=300)
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        model.config.update(ids)
        model.generation_config.update(**ids)
        model.save_pretrained(source)
        hf.hf_import(source, root / f"{name}_ours")
        found[name] = (model, tokenizer, root / f"{name}_ours")
    return found


CHATS = [
    [{"role": "user", "content": "what is two plus three"}],
    [
        {"role": "system", "content": "be brief "},
        {"role": "user", "content": " hello how are you"},
        {"role": "assistant", "content": "five"},
        {"role": "user", "content": "the cat"},
    ],
]


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_chats_and_rendered_chats_get_apply_chat_templates_tokens(chat_models, devices, name):
    """Before: a rendered Llama 3 chat was given a second BOS ([0, 0, 2, ...])."""
    model, tokenizer, ours = chat_models[name]
    generator = Generator(ours, devices[:1])
    generator.complete(["the cat"], max_new=1)
    text = generator._text
    for chat in CHATS:
        expected = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.encode_chat(chat) == expected
        assert text.encode(rendered) == expected
    assert text.encode("the cat sat") == tokenizer("the cat sat")["input_ids"]
    # Greedy tokens from a chat, as transformers' (an explicit mask: BOS is id 0 = pad).
    prompt = torch.tensor([text.encode_chat(CHATS[0])])
    with torch.no_grad():
        made = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
    new = made[0, prompt.shape[1] :].tolist()
    assert generator.generate([prompt[0].tolist()], 4, stop_at=()) == [new]
    answers = generator.complete(
        [
            CHATS[0],
            tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False),
        ],
        max_new=4,
        stop_at=(),
    )
    assert answers[0] == answers[1]


def test_the_cli_chat_flag_renders_the_prompt_with_the_template(chat_models, tmp_path):
    _, tokenizer, ours = chat_models["llama3"]
    generate = ["generate", ours, "--max-new", "3", "--greedy", "--json", "--ignore-eos"]
    result = run_module(*generate, "--prompt", "hello how are you", "--chat", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    chat = [{"role": "user", "content": "hello how are you"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    plain = run_module(*generate, "--prompt", rendered, cwd=tmp_path)
    assert plain.stdout.splitlines()[-1] == result.stdout.splitlines()[-1]


def test_a_zoo_run_its_export_and_an_import_load_without_a_factory(chat_models, tmp_path):
    """Before: load needed a factory, and the zoo's own crashed in flax (no mesh)."""
    run = tmp_path / "run"
    trained = run_module(
        "train", *TINY, "train.steps=2", "train.eval_every=0", f"run.dir={run}", cwd=tmp_path
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_module("export", run, "--output", tmp_path / "export", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    tokens = np.arange(10, dtype=np.int32)[None]
    logits = [np.asarray(paisoar_jax.load(where)(tokens)) for where in (run, tmp_path / "export")]
    np.testing.assert_array_equal(*logits)
    model, _, ours = chat_models["chatml"]
    tokens = np.random.default_rng(0).integers(0, 300, (2, 12))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(paisoar_jax.load(ours)(tokens)), theirs, atol=1e-4)


def test_a_factory_of_sharded_params_loads_and_custom_needs_one(tmp_path, capsys):
    import optax

    class Sharded(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.up = nnx.Linear(16, 6, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            return self.up(x)

    def loss(model, batch, rng):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    data = {"x": x, "y": (x[:, :6].argmax(-1)).astype(np.int32)}
    overrides = ["train.global_batch=16", "train.steps=1", "train.eval_every=0"]
    overrides += ["run.progress=false", "run.tensorboard=false", f"run.dir={tmp_path}/run"]
    result = paisoar_jax.fit(None, overrides, model=Sharded, loss=loss, data=data)
    loaded = paisoar_jax.load(tmp_path / "run", model=Sharded)
    np.testing.assert_allclose(loaded(x[:2]), result.model(x[:2]), rtol=1e-6)
    with pytest.raises(paisoar_jax.UserError, match="model.name=custom"):
        paisoar_jax.load(tmp_path / "run")
