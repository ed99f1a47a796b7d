"""The model families (paisoar_jax/models/families/): one slice per Hugging Face architecture.

Each family is found from its module (transformers' class, the zoo decoder, the tensor
table, config.json both ways, the shipped configs), and the registry that hf-import and
hf-export read picks exactly one family for any config.json and any model section.
"""

import dataclasses
import pathlib

import pytest

from paisoar_jax.config import CONFIG_DIR, LanguageModelConfig, load_config
from paisoar_jax.errors import UserError
from paisoar_jax.models import families
from paisoar_jax.tasks import zoo

WHERE = pathlib.Path("config.json")
TINY = dict(vocab_size=64, layers=2, width=32, heads=4, mlp_width=64, seq_len=16, max_positions=16)
LLAMA = dict(TINY, name="llama", kv_heads=2)  # (config.json holds every count it implies)
# A model section each family exports, as small as it goes.
HELD = {
    "gpt2": LanguageModelConfig(name="gpt", **TINY),
    "llama": LanguageModelConfig(**LLAMA),
    "mixtral": LanguageModelConfig(experts=4, **LLAMA),
    "qwen2": LanguageModelConfig(qkv_bias=True, **LLAMA),
    "qwen3": LanguageModelConfig(qk_norm=True, head_width=16, **LLAMA),
    "qwen3_moe": LanguageModelConfig(qk_norm=True, experts=4, expert_mlp_width=24, **LLAMA),
    "mistral": LanguageModelConfig(sliding_window=8, **LLAMA),
    "gemma3_text": LanguageModelConfig(
        **(LLAMA | dict(layers=4, head_width=16, tie_embeddings=True, scan_layers=False)),
        **dict(sliding_window=8, global_every=2, local_rope_theta=1e4, rope_theta=1e6),
        **dict(qk_norm=True, norm_offset=True, post_norms=True, embed_scale=True),
        **dict(mlp_activation="gelu_tanh", query_scale_width=24.0),
    ),
    "gpt_oss": LanguageModelConfig(
        **(LLAMA | dict(scan_layers=False, experts=4, mlp_width=24)),
        **dict(qkv_bias=True, out_bias=True, attention_sinks=True, expert_bias=True),
        **dict(expert_activation="clamped_swiglu", sliding_window=8, global_every=2),
        **dict(rope_scaling="yarn", rope_factor=4.0, rope_original_length=8),
        **dict(rope_truncate=False, router_aux_loss=0.001),
    ),
}


def test_every_family_is_registered_once_with_its_model_and_configs():
    types = [family.hf_type for family in families.FAMILIES]
    assert len(types) == len(set(types)) >= 7
    for family in families.FAMILIES:
        assert family.model_class() is zoo.model_class(family.zoo_name), family.hf_type
        for name in family.configs:
            assert (pathlib.Path(CONFIG_DIR) / f"{name}.yaml").is_file(), name


def test_each_shipped_decoder_config_is_claimed_by_the_family_that_holds_it():
    """A shipped config is found from its family's slice: the one its model section is."""
    claimed = {name: family for family in families.FAMILIES for name in family.configs}
    for path in sorted(pathlib.Path(CONFIG_DIR).glob("*.yaml")):
        model = load_config(path.stem).model
        if not isinstance(model, LanguageModelConfig):
            continue  # the image classifiers are no Hugging Face family here
        assert path.stem in claimed, f"{path.stem}: no family lists it"
        assert claimed[path.stem] is families.family_of(model), path.stem


@pytest.mark.parametrize("hf_type", sorted(HELD))
def test_a_section_goes_to_config_json_and_back_unchanged(hf_type):
    model = HELD[hf_type]
    family = families.family_of(model)
    assert family.hf_type == hf_type
    hf = families.hf_config(model)
    assert hf["model_type"] == hf_type and hf["architectures"] == [family.architecture]
    assert families.family_of_hf(hf, WHERE) is family
    back = families.model_config_from_hf(hf, WHERE)
    assert back == model, {
        field.name: (getattr(back, field.name), getattr(model, field.name))
        for field in dataclasses.fields(model)
        if getattr(back, field.name) != getattr(model, field.name)
    }


def test_a_mistral_imports_and_exports_as_a_llama():
    hf = families.hf_config(HELD["llama"]) | {"model_type": "mistral", "sliding_window": None}
    model = families.model_config_from_hf(hf, WHERE)
    assert model == HELD["llama"] and families.family_of(model).hf_type == "llama"
    # A window as long as the positions never binds: the same logits as full attention.
    assert families.model_config_from_hf(hf | {"sliding_window": 16}, WHERE) == model
    # A shorter one slides on every layer: a Mistral (before: refused in one line).
    sliding = families.model_config_from_hf(hf | {"sliding_window": 8}, WHERE)
    assert sliding == HELD["mistral"] and families.family_of(sliding).hf_type == "mistral"


def transformers_config(model_type: str, **settings) -> dict:
    """config.json as transformers writes it for `model_type` (its defaults, then ours)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**settings).to_dict()


def test_sliding_windows_import_where_every_layer_or_every_but_the_nth_slides():
    """Before: Mistral and Qwen2 with any sliding_window set were refused."""
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64)
    small |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    off = transformers_config("qwen2", sliding_window=16, use_sliding_window=False, **small)
    assert families.model_config_from_hf(off, WHERE).qkv_bias
    # Qwen2 slides the layers from max_window_layers on: none here, every one with 0.
    on = dict(sliding_window=16, use_sliding_window=True, **small)
    assert families.model_config_from_hf(transformers_config("qwen2", **on), WHERE).qkv_bias
    every = families.model_config_from_hf(
        transformers_config("qwen2", max_window_layers=0, **on), WHERE
    )
    assert (every.sliding_window, every.global_every, every.qkv_bias) == (16, 0, True)
    back = families.hf_config(every)
    assert (back["use_sliding_window"], back["max_window_layers"]) == (True, 0)
    assert families.model_config_from_hf(back, WHERE) == every
    whole = transformers_config("mistral", sliding_window=64, **small)
    assert families.model_config_from_hf(whole, WHERE).name == "llama"
    # Qwen2 sliding from its second layer on: no pattern the zoo's llama has.
    later = transformers_config("qwen2", max_window_layers=1, **on | {"num_hidden_layers": 3})
    with pytest.raises(UserError, match=r"sliding_window=16 on layers \[1, 2\] of 3: the zoo"):
        families.model_config_from_hf(later, WHERE)


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("gemma2", "soft-capping"),
        ("gemma3", "vision tower"),
        ("llama4", "chunked attention"),
        ("phi3", "fused query-key-value"),
        ("olmo2", "norms after attention"),
        ("smollm3", "NoPE"),
        ("qwen3_5_text", "DeltaNet"),
    ],
)
def test_an_architecture_not_imported_yet_is_one_line_with_the_reason(model_type, reason):
    hf = transformers_config(model_type)
    with pytest.raises(UserError, match=f"does not import yet: .*{reason}"):
        families.model_config_from_hf(hf, WHERE)


def test_every_section_has_one_family_or_one_line():
    for qk_norm in (False, True):
        for qkv_bias in (False, True):
            for experts in (0, 4):
                model = LanguageModelConfig(
                    name="llama", qk_norm=qk_norm, qkv_bias=qkv_bias, experts=experts, **TINY
                )
                if qkv_bias and (qk_norm or experts):
                    with pytest.raises(UserError, match="no Hugging Face architecture has"):
                        families.family_of(model)
                else:
                    assert families.family_of(model).hf_type in HELD


def test_a_section_no_architecture_holds_is_one_line_naming_its_settings():
    """Gemma's window pattern without Gemma's norms, some of Gemma's norms alone, a Gemma
    with GPT-OSS's sinks, a GPT-OSS with Llama 3's rotary scaling."""
    pattern = dict(sliding_window=8, global_every=2, scan_layers=False)
    for settings in (pattern, dict(post_norms=True), dict(norm_offset=True, sliding_window=8)):
        model = LanguageModelConfig(**LLAMA, **settings)
        first = next(iter(settings))
        with pytest.raises(UserError, match=f"no Hugging Face .* with .*model.{first}="):
            families.family_of(model)
    gemma = dataclasses.replace(HELD["gemma3_text"], attention_sinks=True)
    oss = dataclasses.replace(HELD["gpt_oss"], rope_scaling="llama3")
    for model in (gemma, oss):
        with pytest.raises(UserError, match="no Hugging Face architecture exported here"):
            families.family_of(model)


def test_configs_transformers_4_wrote_import_as_transformers_5_reads_them():
    """Gemma 3 without layer_types (every sliding_window_pattern-th global) and with its
    rotary keys at the top level; GPT-OSS without layer_types (sliding first, alternating)."""
    shape = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shape |= dict(intermediate_size=64, vocab_size=64, num_hidden_layers=12)
    gemma = transformers_config("gemma3_text", sliding_window=8, **shape)
    for key in ("layer_types", "rope_parameters"):
        gemma.pop(key)
    gemma |= dict(sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4)
    gemma |= dict(rope_scaling={"rope_type": "linear", "factor": 8.0})
    model = families.model_config_from_hf(gemma, WHERE)
    assert (model.sliding_window, model.global_every, model.scan_layers) == (8, 6, False)
    assert (model.rope_scaling, model.rope_factor, model.local_rope_theta) == ("linear", 8, 1e4)
    oss = transformers_config("gpt_oss", sliding_window=8, num_local_experts=4, **shape)
    oss.pop("layer_types")
    assert families.model_config_from_hf(oss, WHERE).global_every == 2
    # A Gemma 3 scaled by its head width exports (the scale is written as a number).
    plain = dataclasses.replace(HELD["gemma3_text"], query_scale_width=0.0)
    assert families.hf_config(plain)["query_pre_attn_scalar"] == 16


def test_an_architecture_of_no_family_is_one_line_naming_those_that_import():
    hf = {"model_type": "falcon", "architectures": ["FalconForCausalLM"]}
    with pytest.raises(UserError, match="FalconForCausalLM is not an architecture this imports"):
        families.model_config_from_hf(hf, WHERE)


@pytest.mark.parametrize("hf_type", sorted(HELD))
def test_a_familys_table_names_each_tensor_once(hf_type):
    tensors = families.tensors_of(HELD[hf_type])
    ours = [tensor.ours for tensor in tensors]
    # (GPT-OSS's gate and up are two of ours interleaved in one of HF's: a part each)
    theirs = [(tensor.theirs, tensor.interleaved) for tensor in tensors]
    assert len(set(ours)) == len(ours) and len(set(theirs)) == len(theirs)
