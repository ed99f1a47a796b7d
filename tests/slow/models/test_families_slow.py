"""The slow tier beside tests/models/test_families.py: the real-size configs' shapes."""

import pytest

from paisoar_jax.config import load_config
from paisoar_jax.models import families


@pytest.mark.parametrize(
    "config_name, architecture, billions",
    [
        ("gemma3_27b", "Gemma3ForCausalLM", 27.0),
        ("gpt_oss_20b", "GptOssForCausalLM", 20.9),
        ("gpt_oss_120b", "GptOssForCausalLM", 116.8),
        ("deepseek_v3_671b", "DeepseekV3ForCausalLM", 671.0),
        ("deepseek_v2_lite_16b", "DeepseekV2ForCausalLM", 15.7),
    ],
)
def test_a_shipped_real_size_config_has_the_parameters_transformers_builds(
    config_name, architecture, billions
):
    """Its export form, built by transformers on the meta device: the same count as ours."""
    import jax
    import torch
    import transformers

    from paisoar_jax.tools.hf.checkpoints import abstract_params

    model = load_config(config_name).model
    settings = families.hf_config(model)
    config = transformers.AutoConfig.for_model(**settings)
    with torch.device("meta"):
        built = getattr(transformers, architecture)(config)
    theirs = sum(weight.numel() for weight in built.parameters())
    ours = sum(leaf.size for leaf in jax.tree.leaves(abstract_params(model)))
    assert ours == theirs and round(ours / 1e9, 1) == billions
