"""The slow tier beside tests/inference/test_generate.py: longer runs, more settings.

Generation with a key/value cache: the full forward's logits, transformers' greedy tokens.
"""

from conftest import TINY, run_module
from test_generate import (
    PROMPT,
    imported,  # noqa: F401 (fixtures)
    transformers_greedy,
)
from test_hf import gpt2

from paisoar_jax.config import dump_yaml, load_config
from paisoar_jax.inference.generator import Generator
from paisoar_jax.tools import hf


def test_a_sharded_model_generates_what_one_device_does(imported, devices, tmp_path):
    _, ours = imported["llama"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "params").symlink_to(ours / "params")
    config = load_config(str(ours / "config.yaml"), ["mesh.fsdp=2", "mesh.tensor=2"])
    (sharded / "config.yaml").write_text(dump_yaml(config))
    many = Generator(sharded, devices)
    whole = {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert dict(many.mesh.shape) == whole
    one = Generator(ours, devices[:1])
    assert many.generate([PROMPT], 8) == one.generate([PROMPT], 8)
    sampled = dict(greedy=False, temperature=0.8, top_k=5, seed=3)
    assert many.generate([PROMPT], 8, **sampled) == one.generate([PROMPT], 8, **sampled)


def test_prompts_are_text_through_the_tokenizer_or_bytes(tmp_path):
    import tokenizers

    words = ["<eos>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    vocabulary = {word: index for index, word in enumerate(words)}
    vocabulary |= {f"w{index}": index for index in range(len(words), 96)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<eos>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    model = gpt2()
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    hf.hf_import(tmp_path / "hf", tmp_path / "ours")
    result = run_module(
        "generate",
        tmp_path / "ours",
        "--prompt",
        "the cat sat",
        "--max-new",
        "4",
        "--greedy",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = tokenizer.decode([1, 2, 3, *transformers_greedy(model, [1, 2, 3], 4)])
    assert result.stdout.strip().splitlines()[-1] == expected

    # A byte-level model trained on the embedded corpus: its checkpoint step continues text.
    run = tmp_path / "run"
    trained = run_module(
        "train", *TINY, "train.steps=2", "train.eval_every=0", f"run.dir={run}", cwd=tmp_path
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = run_module(
        "generate", run / "checkpoints" / "2", "--prompt", "def ", "--max-new", "6", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("def ")
