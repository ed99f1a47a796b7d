"""The MoE feed-forward against a token-by-token reference: routing, seats, drops, losses."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paisoar_jax.models import moe
from paisoar_jax.models.moe import MoeFeedForward, MoeShape, balance_loss, route, seats, z_loss
from paisoar_jax.numerics.precision import get_policy

WIDTH, B, T = 8, 2, 6


def layer(shape: MoeShape, seed: int = 0) -> MoeFeedForward:
    with nnx.use_eager_sharding(False):  # its logical axis names, without a mesh
        return MoeFeedForward(WIDTH, shape, get_policy("fp32"), 0.5, nnx.Rngs(seed))


def silu(x):
    return x / (1 + np.exp(-x))


def reference(module: MoeFeedForward, h_BxTxD: np.ndarray):
    """Token by token, in numpy: the output, and the (row, token, rank) choices dropped."""
    shape = module.shape
    weights, chosen, _ = (np.asarray(a) for a in route(_logits(module, h_BxTxD), shape))
    gate, up, down = (
        np.asarray(k[...]) for k in (module.gate_kernel, module.up_kernel, module.down_kernel)
    )
    capacity = shape.capacity(h_BxTxD.shape[1])
    y = np.zeros_like(h_BxTxD)
    dropped = set()
    for row in range(h_BxTxD.shape[0]):
        taken = [0] * shape.experts
        for rank in range(shape.experts_per_token):  # every first choice before any second
            for token in range(h_BxTxD.shape[1]):
                expert = chosen[row, token, rank]
                if taken[expert] == capacity:
                    dropped.add((row, token, rank))
                    continue
                taken[expert] += 1
                x = h_BxTxD[row, token]
                hidden = silu(x @ gate[expert]) * (x @ up[expert])
                y[row, token] += weights[row, token, rank] * (hidden @ down[expert])
    if shape.shared_experts:
        x = h_BxTxD
        hidden = silu(x @ np.asarray(module.shared_gate_kernel[...]))
        hidden = hidden * (x @ np.asarray(module.shared_up_kernel[...]))
        y = y + hidden @ np.asarray(module.shared_down_kernel[...])
    return y, dropped


def _logits(module, h_BxTxD):
    return jnp.einsum("btd,dx->btx", h_BxTxD, module.router_kernel[...])


def inputs(seed=1):
    return np.random.default_rng(seed).normal(size=(B, T, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared_experts", [0, 1])
def test_dropless_output_is_the_weighted_sum_of_each_tokens_experts(router, shared_experts):
    shape = MoeShape(4, 2, mlp_width=16, router=router, shared_experts=shared_experts)
    module, h = layer(shape), inputs()
    y, statistics = jax.jit(lambda module, h: module(h))(module, h)
    expected, dropped = reference(module, h)
    assert not dropped and float(statistics["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)


def test_a_tight_capacity_drops_exactly_the_choices_the_reference_drops():
    shape = MoeShape(3, 2, mlp_width=16, capacity_factor=0.5)  # 2 seats per expert and row
    module, h = layer(shape, seed=3), inputs(seed=4)
    assert shape.capacity(T) == 2
    y, statistics = jax.jit(lambda module, h: module(h))(module, h)
    expected, dropped = reference(module, h)
    _, chosen, _ = route(_logits(module, h), shape)
    _, kept = seats(chosen, shape.experts, shape.capacity(T))
    assert dropped == {tuple(index) for index in np.argwhere(~np.asarray(kept))}
    assert float(statistics["dropped_fraction"]) == pytest.approx(len(dropped) / (B * T * 2))
    assert dropped  # the capacity really bit
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)


def test_first_choices_are_seated_before_second_choices():
    # Three tokens all choose expert 0 first and 1 second; expert 0 has two seats.
    chosen = jnp.array([[[0, 1], [0, 1], [0, 1]]])
    seat, kept = seats(chosen, experts=2, capacity=2)
    assert np.asarray(seat).tolist() == [[[0, 0], [1, 1], [2, 2]]]
    assert np.asarray(kept).tolist() == [[[True, True], [True, True], [False, False]]]
    # Token 0's second choice of expert 0 waits for token 2's first choice of it.
    seat, kept = seats(jnp.array([[[1, 0], [0, 1], [0, 1]]]), experts=2, capacity=2)
    assert np.asarray(seat).tolist() == [[[0, 2], [0, 1], [1, 2]]]
    assert np.asarray(kept).tolist() == [[[True, False], [True, True], [True, False]]]


def test_the_balance_loss_and_z_loss_equal_their_formulas_on_a_hand_made_routing():
    # Four tokens, two experts, one choice each: three go to expert 0.
    probabilities = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]]])
    chosen = jnp.array([[[0], [0], [0], [1]]])
    share, mean_probability = np.array([0.75, 0.25]), np.array([0.65, 0.35])
    expected = 2 * np.sum(share * mean_probability)
    assert float(balance_loss(chosen, probabilities)) == pytest.approx(expected)
    balanced = balance_loss(jnp.array([[[0], [1]]]), jnp.full((1, 2, 2), 0.5))
    assert float(balanced) == pytest.approx(1.0)  # K = 1 when balanced
    logits = jnp.array([[[0.0, math.log(3.0)]]])  # logsumexp = log 4
    assert float(z_loss(logits)) == pytest.approx(math.log(4.0) ** 2)


def test_renormalised_weights_sum_to_one_and_sigmoid_scores_need_not():
    logits = jnp.asarray(inputs()[..., :4])
    for router in ("softmax", "sigmoid"):
        weights, chosen, probabilities = route(logits, MoeShape(4, 2, router=router))
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(probabilities.sum(-1)), 1.0, rtol=1e-6)
    weights, _, _ = route(logits, MoeShape(4, 2, router="sigmoid", renormalize=False))
    np.testing.assert_allclose(
        np.asarray(weights), np.asarray(jax.nn.sigmoid(jax.lax.top_k(logits, 2)[0])), rtol=1e-6
    )


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_group_limited_routing_chooses_within_the_best_groups_as_the_reference(router):
    """8 experts in 4 groups, the best 2 groups: DeepSeek-V3's rank (sum of two best scores,
    sigmoid) and V2's (best score, softmax); the weights scaled."""
    logits = np.random.default_rng(3).normal(0, 2, (2, 5, 8)).astype(np.float32)
    shape = MoeShape(8, 2, router=router, groups=4, top_groups=2, scale=2.5, renormalize=False)
    weights, chosen, _ = (np.asarray(a) for a in route(jnp.asarray(logits), shape))
    for row, token in np.ndindex(2, 5):
        x = logits[row, token].astype(np.float64)
        scores = 1 / (1 + np.exp(-x)) if router == "sigmoid" else np.exp(x) / np.exp(x).sum()
        groups = np.sort(scores.reshape(4, 2), axis=1)[:, ::-1]
        rank = groups[:, :2].sum(1) if router == "sigmoid" else groups[:, 0]
        allowed = np.repeat(np.isin(np.arange(4), np.argsort(rank)[-2:]), 2)
        best = np.argsort(np.where(allowed, scores, -np.inf))[-2:][::-1]
        assert list(chosen[row, token]) == list(best)
        np.testing.assert_allclose(weights[row, token], 2.5 * scores[best], rtol=1e-5)


def test_the_router_learns_through_the_weights_of_the_kept_choices():
    module, h = layer(MoeShape(4, 2, mlp_width=16)), inputs()
    graphdef, params = nnx.split(module)

    def loss(params):
        y, statistics = nnx.merge(graphdef, params)(h)
        return jnp.mean(y**2) + 0.01 * statistics["balance_loss"]

    grads = jax.jit(jax.grad(loss))(params)
    for name in ("router_kernel", "gate_kernel", "up_kernel", "down_kernel"):
        assert float(jnp.abs(grads[name][...]).sum()) > 0, name


# The layer in the decoders: config keys, the loss, the metrics, the mesh.

MOE = ["model.experts=4", "model.experts_per_token=2", "model.mlp_width=64"]
LLAMA = ["model.name=llama", "model.kv_heads=2"]


def decoder(overrides):
    """(config, model, task) of TINY + MOE + overrides, built eagerly on one device."""
    from conftest import TINY, task_for

    from paisoar_jax.config import load_config
    from paisoar_jax.tasks.zoo import build_model

    config = load_config(None, [*TINY, *MOE, *overrides])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
    return config, model, task_for(config)


@pytest.mark.parametrize("family", [[], LLAMA], ids=["gpt", "llama"])
def test_the_loss_adds_the_routers_weighted_losses_and_reports_them(family):
    weights = ["model.router_aux_loss=0.5", "model.router_z_loss=0.1"]
    config, model, task = decoder([*family, *weights])
    tokens = np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32)
    loss, metrics = task.loss(model, tokens, jax.random.key(0))
    logits, statistics = model.logits_and_statistics(tokens[:, :-1])
    assert statistics["balance_loss"].shape == (config.model.layers,)  # one per MoE layer
    log_probabilities = jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(log_probabilities), tokens[:, 1:, None], axis=-1)
    cross_entropy = -picked.mean()
    balance, z = np.mean(statistics["balance_loss"]), np.mean(statistics["z_loss"])
    np.testing.assert_allclose(loss, cross_entropy + 0.5 * balance + 0.1 * z, rtol=1e-5)
    summary = {"moe_balance_loss", "moe_z_loss", "moe_expert_load", "moe_dropped_fraction"}
    summary |= {"moe_router_entropy"}
    kinds = ("load", "dropped", "entropy")
    per_layer = {f"moe_layer_{kind}/{layer}" for kind in kinds for layer in (0, 1)}
    assert set(metrics) == set(task.metric_names) == summary | per_layer
    np.testing.assert_allclose(metrics["moe_layer_load/1"], statistics["expert_load"][1])
    np.testing.assert_allclose(metrics["moe_balance_loss"], balance, rtol=1e-6)
    entropy = np.asarray(statistics["router_entropy"])
    np.testing.assert_allclose(metrics["moe_router_entropy"], entropy.min(), rtol=1e-6)
    assert 0 < entropy.min() <= entropy.max() <= 1
    # Dropless: nothing dropped; the busiest expert is at least the mean one.
    assert metrics["moe_dropped_fraction"] == 0 and metrics["moe_expert_load"] >= 1


def test_every_kth_layer_has_experts_and_only_they_report():
    config, model, _ = decoder(["model.layers=4", "model.moe_every=2", "model.scan_layers=false"])
    assert [block.moe is not None for block in model.blocks] == [False, True, False, True]
    dense_mlps = [hasattr(block, "mlp_in_kernel") for block in model.blocks]
    assert dense_mlps == [True, False, True, False]
    tokens = np.zeros((2, 32), np.int32)
    _, statistics = model.logits_and_statistics(tokens)
    assert statistics["z_loss"].shape == (2,)
    names = [name for name in moe.metric_names(config.model) if "/" in name]
    kinds = ("load", "dropped", "entropy")
    expected = [f"moe_layer_{kind}/{layer}" for kind in kinds for layer in (1, 3)]
    assert names == expected  # the model's own layer numbers


def test_flops_count_the_active_parameters():
    """6 x N per token counts the experts a token uses (K of X), not every expert."""
    config, model, task = decoder(["model.expert_mlp_width=48"])
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    expert_parameters = config.model.layers * 4 * 3 * 64 * 48  # layers x X x (gate, up, down)
    attention = 12 * config.model.layers * config.model.width * config.model.seq_len
    active = total - expert_parameters // 2  # 2 of the 4 experts
    assert task.flops_per_unit(total) == 6 * active + attention


@pytest.mark.checks("sharded", families=["zoo:llama + experts"])
def test_a_sharded_moe_step_matches_one_device(devices):
    """data x fsdp x tensor against one device, with a capacity that drops choices."""
    from conftest import assert_steps_match, build_run, token_batches

    def losses(mesh, devices):
        overrides = [*MOE, *LLAMA, "model.expert_capacity_factor=1.0", *mesh]
        _, _, _, state, train_step = build_run(overrides, devices)
        initial, values, dropped = jax.device_get(state.params), [], []
        for batch in token_batches(2):
            state, metrics = train_step(state, batch)
            values.append(float(metrics["loss"]))
            dropped.append(float(metrics["moe_dropped_fraction"]))
        return values, dropped, (initial, jax.device_get(state.params))

    single, single_dropped, single_state = losses(["mesh.data=1"], devices[:1])
    sharded, sharded_dropped, sharded_state = losses(
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], devices
    )
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    np.testing.assert_allclose(sharded_dropped, single_dropped, atol=1e-7)
    assert max(single_dropped) > 0  # the capacity did drop some choices
    assert_steps_match(sharded_state, single_state)


def test_expert_parallelism_matches_one_device(devices):
    """Experts split over mesh.expert=2 (tokens there and back by all-to-all) x data x fsdp."""
    from conftest import assert_steps_match, build_run, token_batches

    def losses(mesh, devices):
        overrides = [*MOE, *LLAMA, "model.expert_capacity_factor=1.0", *mesh]
        _, mesh_used, layout, state, train_step = build_run(overrides, devices)
        initial, values = jax.device_get(state.params), []
        for batch in token_batches(2):
            state, metrics = train_step(state, batch)
            values.append(float(metrics["loss"]))
        return values, (initial, jax.device_get(state.params)), layout

    single, single_state, _ = losses(["mesh.data=1"], devices[:1])
    split = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"]
    sharded, sharded_state, layout = losses(split, devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)
    experts = layout.shardings.params["blocks"]["moe"]["gate_kernel"].spec
    assert experts[1] in ("expert", ("expert",))  # each device holds 2 of the 4 experts


def test_bias_balancing_moves_each_experts_bias_toward_the_even_load():
    """DeepSeek-V3's loss-free balancing: the bias shifts the choice, never the weights."""
    shape = MoeShape(experts=4, experts_per_token=2, bias_rate=0.1)
    module = layer(shape)
    module.router_bias[...] = jnp.array([0.0, 0.0, 0.0, 5.0])  # expert 3 chosen by all
    h = np.random.default_rng(1).normal(size=(B, T, WIDTH)).astype(np.float32)
    logits = _logits(module, h)
    weights, chosen, _ = route(logits, shape, module.router_bias[...])
    assert np.all(np.any(np.asarray(chosen) == 3, axis=-1))  # the bias chose it for every token
    scores = np.asarray(jax.nn.softmax(logits, axis=-1))
    picked = np.take_along_axis(scores, np.asarray(chosen), axis=-1)
    np.testing.assert_allclose(weights, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    _, statistics = module(h)
    counts = np.bincount(np.asarray(chosen).ravel(), minlength=4)
    expected = module.router_bias[...] + 0.1 * np.sign(counts.mean() - counts)
    np.testing.assert_allclose(statistics["router_bias"], expected, rtol=1e-6)
    assert float(statistics["router_bias"][3]) == pytest.approx(4.9)  # the busiest: down


def test_bias_balancing_is_model_state_the_step_moves(devices):
    """A train step writes every layer's next bias into the state; the loss is unaffected."""
    from conftest import build_run, token_batches

    overrides = [*MOE, *LLAMA, "model.router=sigmoid", "model.router_bias_rate=0.01"]
    mesh = ["mesh.data=2", "mesh.expert=2"]
    _, _, _, state, train_step = build_run([*overrides, *mesh], devices[:4])
    assert np.all(np.asarray(state.model_state["blocks"]["moe"]["router_bias"]) == 0)
    state, _ = train_step(state, token_batches(1)[0])
    bias = np.asarray(state.model_state["blocks"]["moe"]["router_bias"])
    assert bias.shape == (2, 4)  # layers x experts
    assert np.all(np.isclose(np.abs(bias), 0.01) | (bias == 0)) and np.any(bias != 0)


def test_packed_documents_route_through_the_experts(devices):
    """Packed rows (data.packing=documents) carry their segments past the MoE blocks."""
    from conftest import build_run

    overrides = [*MOE, *LLAMA, "data.packing=documents", "mesh.data=2", "mesh.expert=2"]
    _, _, _, state, train_step = build_run(overrides, devices[:4])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (16, 33), dtype=np.int32)
    segments = np.repeat([[0] * 12 + [1] * 20], 16, axis=0).astype(np.int32)
    positions = np.concatenate([np.arange(12), np.arange(20)])[None].repeat(16, 0)
    batch = {
        "tokens": tokens,
        "loss_mask": np.ones((16, 32), bool),
        "segments": segments,
        "positions": positions.astype(np.int32),
    }
    state, metrics = train_step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["moe_balance_loss"]) > 0


def test_a_model_of_ones_own_trains_its_moe_layer_through_fit(devices, tmp_path):
    """The README's way for `fit`: the layer's statistics go into one's own loss."""
    import optax

    import paisoar_jax

    class Classifier(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(2, 16, rngs=rngs)
            shape = MoeShape(experts=4, experts_per_token=2, mlp_width=16)
            self.experts = MoeFeedForward(16, shape, get_policy("fp32"), 0.1, rngs)
            self.out = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, x):
            h = self.embed(x)[:, None, :]  # one token per example
            y, statistics = self.experts(h)
            return self.out((h + y)[:, 0]), statistics

    def loss(model, batch, rng):
        logits, statistics = model(batch["x"])
        labels = batch["y"]
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return cross_entropy + 0.01 * statistics["balance_loss"], {
            "load": statistics["expert_load"]
        }

    x = np.random.default_rng(0).normal(size=(1024, 2)).astype(np.float32)
    data = {"x": x, "y": (x[:, 0] * x[:, 1] > 0).astype(np.int32)}
    settings = ["train.steps=60", "run.progress=false", "mesh.data=4", "mesh.fsdp=2"]
    settings += [f"run.dir={tmp_path}", "run.tensorboard=false", "train.log_every=20"]
    result = paisoar_jax.fit(
        None, settings, model=Classifier, loss=loss, optimizer=optax.adam(3e-3), data=data
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert result["final_loss"] < records[0]["loss"] and records[-1]["load"] >= 1
    logits, statistics = result.model(x[:4])  # the trained module, as written
    assert logits.shape == (4, 2) and set(statistics) >= {"balance_loss", "expert_load"}
    with pytest.raises(paisoar_jax.UserError, match="a model of your own cannot use it yet"):
        paisoar_jax.fit(
            None,
            [*settings, "mesh.expert=2"],
            model=Classifier,
            loss=loss,
            optimizer=optax.adam(3e-3),
            data=data,
        )


def test_the_router_entropy_is_one_when_even_and_zero_when_collapsed():
    module, h = layer(MoeShape(4, 2, mlp_width=16)), inputs()
    module.router_kernel[...] = jnp.zeros_like(module.router_kernel[...])  # every expert alike
    _, even = jax.jit(lambda module, h: module(h))(module, h)
    assert float(even["router_entropy"]) == pytest.approx(1.0, abs=1e-6)
    # A router whose expert 0 outscores the rest by far for every token.
    kernel = np.zeros(module.router_kernel[...].shape, np.float32)
    module.router_kernel[...] = jnp.asarray(kernel)
    module.router_kernel[...] = module.router_kernel[...].at[:, 0].set(50.0)
    _, collapsed = jax.jit(lambda module, h: module(abs(h) + 1.0))(module, h)
    assert float(collapsed["router_entropy"]) < 1e-3
