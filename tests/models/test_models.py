import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.models.gpt import GPT
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.tasks.zoo import build_model, model_class


def make(overrides=(), policy="fp32"):
    config = load_config(
        None, ["model.seq_len=16", "model.layers=2", "model.width=32", "model.heads=4", *overrides]
    )
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy(policy), config.remat.policy, nnx.Rngs(0))
    return config, model


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.scan_layers=false"],
        ["model.position=rotary"],
        ["model.tie_embeddings=false"],
        ["remat.policy=full"],
        ["remat.policy=minimal", "model.scan_layers=false"],
    ],
)
def test_forward_shape_and_causality(overrides):
    config, model = make(overrides)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 256
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    changed = tokens.at[:, 10].set(7)
    # Positions before the change see nothing of it; the changed one and later do.
    np.testing.assert_allclose(model(changed)[:, :10], logits[:, :10], atol=1e-5)
    assert not np.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_every_param_has_logical_axis_names():
    for overrides in ([], ["model.scan_layers=false", "model.tie_embeddings=false"]):
        _, model = make(overrides)
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        for path, spec in jax.tree_util.tree_leaves_with_path(
            nnx.to_pure_dict(specs), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        ):
            values = params_of(model)
            for key in path:
                values = values[key.key]
            assert len(spec) == values.ndim, jax.tree_util.keystr(path)


def test_scanned_params_are_stacked_on_a_layers_axis():
    _, model = make()
    kernel = nnx.state(model, nnx.Param)["blocks"]["qkv_kernel"]
    assert kernel.shape == (2, 32, 3, 4, 8)
    assert kernel.get_metadata()["out_sharding"][0] == "layers"


def test_tied_embeddings_share_the_table():
    _, tied = make()
    _, untied = make(["model.tie_embeddings=false"])
    count = lambda m: sum(x.size for x in jax.tree.leaves(params_of(m)))
    assert count(untied) - count(tied) == 32 * 256


def test_bf16_policy_runs_matmuls_in_bf16_and_returns_fp32_logits():
    _, model = make(policy="bf16")
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 16), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params))
    assert "bf16" in jaxpr
    assert model(tokens).dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params_of(model)))


def test_flops_per_token_formula():
    config, model = make()
    n = sum(x.size for x in jax.tree.leaves(params_of(model)))
    assert GPT.flops_per_token(config.model, n) == 6 * n + 12 * 2 * 32 * 16


def test_unknown_model_name():
    with pytest.raises(UserError, match="model.name='resnet7' is not one of gpt"):
        model_class("resnet7")


def test_auto_attention_takes_xla_where_cudnn_cannot_run(capsys):
    from paisoar_jax.models.attention import cudnn_attention_compiles, resolve_attention

    bf16, fp32 = get_policy("bf16"), get_policy("fp32")
    assert resolve_attention("auto", bf16, 64) == "xla"  # a CPU: no cuDNN
    assert resolve_attention("xla", bf16, 64) == "xla"
    with pytest.raises(UserError, match="model.attention=cudnn needs an NVIDIA GPU"):
        resolve_attention("cudnn", fp32, 64)
    # The probe itself (run once per process on a GPU): here the cuDNN kernel cannot
    # compile, so it answers False and says why in one line.
    assert cudnn_attention_compiles.__wrapped__("bfloat16", 64) is False
    message = capsys.readouterr().err
    assert message.startswith("paisoar_jax: cuDNN attention unavailable (")
    assert message.count("\n") == 1
