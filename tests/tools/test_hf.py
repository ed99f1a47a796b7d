"""Hugging Face checkpoints in and out, checked against transformers itself (no hub).

Tiny random models are built with transformers' own classes and saved with
save_pretrained; our forward pass on the imported params must give transformers' logits.
"""

import json
import subprocess

import jax
import numpy as np
import pytest
import torch  # the [test] extra's reference implementation (never imported by the library)
import transformers
from conftest import PYTHON, subprocess_env
from flax import nnx

from paisoar_jax.checkpointing.weights import load_weights
from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.zoo import zoo_workload
from paisoar_jax.tools import hf

ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# Wavelengths below 64 / 4 are kept, above 64 / 1 slowed, between blended: all three occur.
ROPE |= {"original_max_position_embeddings": 64, "rope_type": "llama3"}
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 24))


# The attention every tiny decoder below shares: 2 layers of width 64, 4 query heads over 2
# key/value heads, 64 positions.
ATTENTION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def built(model_class, config, decisive_routers=False, random_head_norms=False):
    """`model_class(config)` from torch seed 0, in eval mode, its weights then adjusted.

    `decisive_routers`: the routers scaled up so each token's top experts are clear choices
    (a near tie would be broken by the last bit of float rounding, differently in torch and
    XLA). `random_head_norms`: the query and key norms' scales randomised (they start at
    one, which would hide a mapping that drops them).
    """
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if decisive_routers and hasattr(layer.mlp, "gate"):  # (not a dense layer between)
                layer.mlp.gate.weight.mul_(20.0)
            if random_head_norms:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    return model


def llama(tied=False, vocab_size=96):
    """A 2-layer Llama with grouped-query attention (4 query heads over 2) and Llama-3 rope."""
    config = transformers.LlamaConfig(
        **ATTENTION,
        vocab_size=vocab_size,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={**ROPE, "rope_theta": 5000.0},
    )
    return built(transformers.LlamaForCausalLM, config)


def mixtral():
    """A 2-layer Mixtral: 4 experts, 2 per token, over the Llama above's attention."""
    config = transformers.MixtralConfig(
        **ATTENTION,
        vocab_size=96,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    return built(transformers.MixtralForCausalLM, config, decisive_routers=True)


def qwen3_moe(sparse_step=1):
    """A 2-layer Qwen3-MoE: heads wider than width / heads, normed queries and keys, 4
    experts of their own width, 2 per token with the weights not renormalised.
    `sparse_step` 2: four layers, experts on the second and fourth, dense MLPs between."""
    layers = {"num_hidden_layers": 4, "decoder_sparse_step": 2} if sparse_step == 2 else {}
    config = transformers.Qwen3MoeConfig(
        **(ATTENTION | layers),
        vocab_size=96,
        intermediate_size=96,
        moe_intermediate_size=48,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    model_class = transformers.Qwen3MoeForCausalLM
    return built(model_class, config, decisive_routers=True, random_head_norms=True)


def qwen3():
    """A 2-layer dense Qwen3, tied: heads of width 32 over a width of 64, queries and keys
    normed."""
    config = transformers.Qwen3Config(
        **ATTENTION,
        vocab_size=96,
        intermediate_size=96,
        head_dim=32,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return built(transformers.Qwen3ForCausalLM, config, random_head_norms=True)


def qwen2():
    """A 2-layer Qwen2, tied as the small Qwen2.5s: biases on queries, keys and values
    (randomised: they start at zero, which would hide a mapping that drops them)."""
    config = transformers.Qwen2Config(
        **ATTENTION, vocab_size=96, intermediate_size=96, tie_word_embeddings=True
    )
    model = built(transformers.Qwen2ForCausalLM, config)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, projection).bias.normal_(0, 0.5)
    return model


def mistral():
    """A 2-layer Mistral with no sliding window (v0.2 on): a Llama to this import."""
    config = transformers.MistralConfig(
        **ATTENTION, vocab_size=96, intermediate_size=96, head_dim=16, sliding_window=None
    )
    return built(transformers.MistralForCausalLM, config)


def gpt2(tied=True):
    config = transformers.GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def torch_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(export_dir, devices, mesh=("mesh.data=1",)):
    """Our forward pass on an export, placed as the config and `mesh` say (as init_from)."""
    config = load_config(str(export_dir / "config.yaml"), [*mesh, "train.global_batch=4"])
    run = setup(config, zoo_workload(config), devices)
    with jax.set_mesh(run.mesh):
        params, model_state = load_weights(export_dir, run.layout.abstract_state)
        forward = jax.jit(lambda p, t: nnx.merge(run.layout.graphdef, p, model_state or {})(t))
        return np.asarray(forward(params, TOKENS)), params


def imported_copy(model, root):
    """(`model` saved by transformers in root/hf, our hf-import of it in root/ours)."""
    model.save_pretrained(root / "hf")
    hf.hf_import(root / "hf", root / "ours")
    return root / "hf", root / "ours"


def exported_with_its_weights(model, ours, output):
    """transformers' model of our hf-export of `ours`, every weight equal to `model`'s."""
    hf.hf_export(ours, output)
    back = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
    for name, weight in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], weight), name
    return back


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{name: (HF model, HF dir, our export dir)}: a GQA Llama, a GPT-2, a Mixtral, a Qwen3-MoE."""
    root = tmp_path_factory.mktemp("hf")
    models = {}
    builders = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral, "qwen3_moe": qwen3_moe}
    builders |= {"qwen2": qwen2, "mistral": mistral}
    for name, build in builders.items():
        model = build()
        model.save_pretrained(root / name)
        hf.hf_import(root / name, root / f"{name}_ours")
        models[name] = (model, root / name, root / f"{name}_ours")
    return models


ARCHITECTURES = ["llama", "gpt2", "mixtral", "qwen3_moe", "qwen2", "mistral"]


@pytest.mark.checks("import", "logits", families=ARCHITECTURES)
@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("mesh", [["mesh.data=1"], ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_imported_logits_match_transformers(imported, devices, name, mesh):
    model, _, ours = imported[name]
    count = 1 if len(mesh) == 1 else 4
    logits, _ = our_logits(ours, devices[:count], mesh)
    expected = torch_logits(model)
    difference = np.abs(logits - expected).max()
    assert difference < 1e-4, difference


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_imported_experts_split_over_expert_x_fsdp_give_transformers_logits(
    imported, devices, name
):
    model, _, ours = imported[name]
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"]
    logits, params = our_logits(ours, devices[:4], mesh)
    assert params["blocks"]["moe"]["gate_kernel"].sharding.spec[1] in ("expert", ("expert",))
    assert np.abs(logits - torch_logits(model)).max() < 1e-4


def test_the_import_writes_a_config_that_fine_tunes(imported):
    config = load_config(str(imported["llama"][2] / "config.yaml"))
    assert (config.model.name, config.model.kv_heads, config.model.rope_scaling) == (
        "llama",
        2,
        "llama3",
    )
    assert config.model.rope_theta == 5000.0 and config.model.rope_original_length == 64
    assert config.checkpoint.init_from == str(imported["llama"][2].absolute())


def test_both_spellings_of_rope_scaling_are_read(imported):
    written = json.loads((imported["llama"][1] / "config.json").read_text())
    rope = dict(written.get("rope_parameters") or written["rope_scaling"])
    theta = rope.pop("rope_theta", written.get("rope_theta"))
    spelled_4x = {**written, "rope_theta": theta, "rope_scaling": rope}
    spelled_4x.pop("rope_parameters", None)
    spelled_5x = {**written, "rope_parameters": {**rope, "rope_theta": theta}}
    spelled_5x.pop("rope_scaling", None)
    where = imported["llama"][1]
    assert hf.model_config_from_hf(spelled_4x, where) == hf.model_config_from_hf(spelled_5x, where)
    assert hf.model_config_from_hf(spelled_4x, where).rope_factor == 8.0


@pytest.mark.checks("export", "logits", families=ARCHITECTURES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_export_loads_in_transformers_and_reimports_bit_for_bit(imported, devices, tmp_path, name):
    _, _, ours = imported[name]
    logits, params = our_logits(ours, devices[:1])
    hf.hf_export(ours, tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert np.abs(torch_logits(loaded) - logits).max() < 1e-4
    hf.hf_import(tmp_path / "hf", tmp_path / "again")
    _, again = our_logits(tmp_path / "again", devices[:1])
    for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


@pytest.mark.checks("import", "export", "logits", families=["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("build", [lambda: llama(tied=True), lambda: gpt2(tied=False), qwen3])
def test_tied_llama_and_untied_gpt2_round_trip_with_their_token_ids(build, devices, tmp_path):
    model = build()
    model.save_pretrained(tmp_path / "hf")
    hf.hf_import(tmp_path / "hf", tmp_path / "ours")
    logits, _ = our_logits(tmp_path / "ours", devices[:1])
    assert np.abs(logits - torch_logits(model)).max() < 1e-4
    hf.hf_export(tmp_path / "ours", tmp_path / "back")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert np.abs(torch_logits(loaded) - logits).max() < 1e-4
    for key in ("bos_token_id", "eos_token_id"):  # kept, so HF's generate stops where it did
        assert getattr(loaded.config, key) == getattr(model.config, key)


def fine_tune(export_dir, run_dir, steps, *extra):
    """`python -m paisoar_jax.train` from the import's config.yaml; the losses it logged."""
    command = [PYTHON, "-m", "paisoar_jax.train", "--config", str(export_dir / "config.yaml")]
    command += [f"train.steps={steps}", "train.log_every=1", "train.eval_every=0"]
    command += ["mesh.data=2", "mesh.fsdp=4"]
    command += ["train.global_batch=8", "model.seq_len=32", "train.sample_bytes=0"]
    command += ["run.progress=false", "run.tensorboard=false", "optim.warmup_steps=0"]
    command += ["checkpoint.every=10", "data.source=synthetic", f"run.dir={run_dir}", *extra]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def rewrite_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_checkpoints_get_one_line_naming_the_tensor(imported, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = imported["llama"][1]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    with pytest.raises(UserError, match="BertModel is not an architecture this imports") as error:
        hf.hf_import(other, tmp_path / "a")
    for name in ("GPT2LMHeadModel", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(error.value)  # every architecture that imports is named

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(UserError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        hf.hf_import(missing, tmp_path / "b")

    rewrite_config(missing, intermediate_size=80)
    save_file(load_file(source / "model.safetensors"), missing / "model.safetensors")
    with pytest.raises(
        UserError, match=r"gate_proj.weight has shape \[96, 64\], .* needs \[80, 64\]"
    ):
        hf.hf_import(missing, tmp_path / "c")


def convert(*args):
    """`python -m paisoar_jax.convert args...` as a user runs it."""
    command = [PYTHON, "-m", "paisoar_jax.convert", *map(str, args)]
    return subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )


def test_the_command_line_gives_one_line_and_exit_2(imported, tmp_path):
    result = convert("hf-import", "--input", tmp_path, "--output", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"paisoar_jax.convert: error: {tmp_path} has no config.json: not a Hugging Face model "
        "directory"
    )
    result = convert("hf-export", imported["gpt2"][2], "--output", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "exported export" in result.stdout and "GPT2LMHeadModel" in result.stdout


def test_a_gpt_with_rotary_positions_has_no_gpt2_form(tmp_path):
    from paisoar_jax.checkpointing.weights import export_weights
    from paisoar_jax.config import Config, LanguageModelConfig, dump_yaml

    model = LanguageModelConfig(position="rotary", layers=1, width=32, heads=4, seq_len=16)
    shapes = hf.abstract_params(model)
    params = jax.tree.map(lambda leaf: np.zeros(leaf.shape, np.float32), shapes)
    export_weights(params, {}, tmp_path / "ours")
    (tmp_path / "ours" / "config.yaml").write_text(dump_yaml(Config(model=model)))
    with pytest.raises(
        UserError, match="an HF GPT-2 has learned positions: this model has model.position=rotary"
    ):
        hf.hf_export(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_import_builds_each_device_shard_on_its_own(imported, devices):
    """No host holds the whole model: each param is split over the devices as FSDP splits it."""
    from paisoar_jax.config import load_config as load

    model = load(str(imported["llama"][2] / "config.yaml")).model
    _, shardings = hf.placed_params(model, devices)
    embedding = shardings["token_embedding"]
    assert embedding.shard_shape((96, 64)) == (96, 8)  # embed split 8 ways
    assert shardings["blocks"]["q_kernel"].shard_shape((2, 64, 4, 16)) == (2, 8, 4, 16)


def test_two_processes_import_what_one_does(imported, devices, tmp_path):
    """Under the launcher each process builds and writes only its devices' shards."""
    command = [PYTHON, "-m", "paisoar_jax.launch", "--nproc", "2", "--devices-per-proc", "4"]
    command += ["--module", "paisoar_jax.convert", "--", "hf-import"]
    command += ["--input", str(imported["llama"][1]), "--output", str(tmp_path / "two")]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("imported ") == 1  # process 0 speaks for both
    _, one = our_logits(imported["llama"][2], devices[:1])
    _, two = our_logits(tmp_path / "two", devices[:1])
    for before, after in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


def test_a_sharded_checkpoint_imports_as_one_file_does(imported, devices, tmp_path):
    model, _, ours = imported["llama"]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    hf.hf_import(tmp_path / "sharded", tmp_path / "ours")
    _, one = our_logits(ours, devices[:1])
    _, sharded = our_logits(tmp_path / "ours", devices[:1])
    for before, after in zip(jax.tree.leaves(one), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


def readme_fine_tuning_commands():
    """The fine-tuning sequence of the Hugging Face page (docs/how-to), one argv per line."""
    from doc_blocks import argv, command_lines, doc_block

    return [argv(line)[1] for line in command_lines(doc_block("hf-sequence"))]


def test_gpt2_with_256_positions_trains_on_32_and_exports_256(tmp_path):
    """Before: the learned table was sized by the window (an imported GPT-2 could not train
    on shorter windows), and the export wrote the window as the model's positions."""
    from conftest import train

    model = gpt2()
    model.config.n_positions = 256
    model = transformers.GPT2LMHeadModel(model.config).eval()
    model.save_pretrained(tmp_path / "hf")
    hf.hf_import(tmp_path / "hf", tmp_path / "ours")
    overrides = ["model.seq_len=32", "data.source=synthetic", "train.steps=2", "mesh.data=8"]
    overrides += ["train.global_batch=8", "train.eval_every=0", f"run.dir={tmp_path}/run"]
    config = load_config(str(tmp_path / "ours" / "config.yaml"), overrides)
    assert (config.model.seq_len, config.model.max_positions) == (32, 256)
    train(config)
    hf.hf_export(tmp_path / "run", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["n_positions"] == 256
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert loaded.transformer.wpe.weight.shape == (256, 64)
    with pytest.raises(UserError, match="model.seq_len=512 is longer than the model's"):
        load_config(str(tmp_path / "ours" / "config.yaml"), ["model.seq_len=512"])


def test_data_of_another_tokenizer_is_refused_for_an_import(imported, tmp_path):
    """Before: the import pinned no tokenizer, so bytes trained the model as its token ids."""
    import shutil

    import tokenizers

    from paisoar_jax.tools import convert

    shutil.copytree(imported["llama"][1], tmp_path / "hf")
    vocabulary = {"<eos>": 0, "the": 1, "cat": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<eos>"))
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    hf.hf_import(tmp_path / "hf", tmp_path / "ours")
    config = load_config(str(tmp_path / "ours" / "config.yaml"))
    assert config.data.tokenizer == str((tmp_path / "ours" / "tokenizer.json").absolute())
    (tmp_path / "text.txt").write_text("the cat sat on the mat\n" * 200)
    output = tmp_path / "bytes"  # converted with the default --tokenizer byte
    assert (
        convert.main(["text", "--input", str(tmp_path / "text.txt"), "--output", str(output)]) == 0
    )
    config = load_config(
        str(tmp_path / "ours" / "config.yaml"), [f"data.source=arrayrecord:{output}"]
    )
    with pytest.raises(UserError, match=r"was tokenized with byte: convert the text again with"):
        zoo_workload(config).task.open_sources()


def readme_supervised_fine_tuning_commands():
    """The two command lines of the supervised fine-tuning page's block, as argv lists."""
    from doc_blocks import argv, command_lines, doc_block

    return [argv(line)[1] for line in command_lines(doc_block("sft-sequence"))]
