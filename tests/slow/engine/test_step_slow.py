"""The slow tier beside tests/engine/test_step.py: longer runs, more settings.

A sharded step must match the same step on one device: losses, gradients, new params.
"""

import jax
import numpy as np
from conftest import assert_trees_close, build_run, task_for, token_batches
from test_step import _shardings, spec

from paisoar_jax.engine.step import loss_and_grads
from paisoar_jax.parallel import sharding


def test_layouts_follow_the_rules(devices):
    """Inspect .sharding: where params and Adam moments live under each ZeRO stage."""
    expectations = {
        # mesh overrides: (qkv kernel spec, its Adam mu spec)
        ("mesh.data=4", "mesh.fsdp=2"): (
            (None, "fsdp", None, None, None),
            (None, "fsdp", None, None, None),
        ),
        ("mesh.data=4", "mesh.fsdp=2", "mesh.zero=1"): (
            (None, "fsdp", None, None, None),
            (None, ("data", "fsdp"), None, None, None),
        ),
        ("mesh.data=4", "mesh.fsdp=2", "mesh.zero=3"): (
            (None, ("data", "fsdp"), None, None, None),
            (None, ("data", "fsdp"), None, None, None),
        ),
        ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"): (
            (None, "fsdp", None, "tensor", None),
            (None, "fsdp", None, "tensor", None),
        ),
    }
    for overrides, (param_spec, moment_spec) in expectations.items():
        _, mesh, _, state, train_step = build_run(overrides, devices)
        adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
        kernel = state.params["blocks"]["qkv_kernel"]
        assert spec(kernel) == param_spec, overrides
        assert spec(adam.mu["blocks"]["qkv_kernel"]) == moment_spec, overrides
        assert spec(adam.nu["blocks"]["qkv_kernel"]) == moment_spec, overrides
        # MLP hidden and heads over tensor, Megatron style; embeddings over vocab x embed.
        if "mesh.tensor=2" in overrides:
            assert spec(state.params["blocks"]["mlp_in_kernel"]) == (None, "fsdp", "tensor")
            assert spec(state.params["blocks"]["mlp_out_kernel"]) == (None, "tensor", "fsdp")
            assert spec(state.params["token_embedding"]) == ("tensor", "fsdp")
        assert spec(state.step) == ()
        # The compiled step hands the state back in exactly the same layout.
        batch = jax.device_put(token_batches(1)[0], sharding.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            new_state, _ = train_step(state, batch)
        for before, after in zip(
            jax.tree.leaves(_shardings(state)), jax.tree.leaves(_shardings(new_state)), strict=True
        ):
            assert before == after


def test_bf16_fsdp_casts_the_weights_before_gathering_them(devices):
    """Under FSDP in bf16 the weights are cast where they are stored (sharded), so the
    all-gathers move bf16; the gradients reaching the optimizer are fp32 and equal those of
    the plain path (each layer casting as it uses the weight).

    XLA CPU runs bf16 collectives in f32, so the halved bytes only show on a GPU; here the
    program is checked before optimisation: a sharded convert f32 -> bf16 per weight.
    """
    config, mesh, layout, state, train_step = build_run(
        ["mesh.data=1", "mesh.fsdp=8", "precision.policy=bf16"], devices
    )
    assert jax.numpy.bfloat16 in jax.tree.leaves(layout.compute_dtypes)
    batch = jax.device_put(token_batches(1)[0], sharding.batch_sharding(mesh))
    task = task_for(config)
    with jax.set_mesh(mesh):
        text = train_step.lower(state, batch).as_text()
        gradients = {
            path: jax.jit(
                lambda p, b, with_layout=with_layout: loss_and_grads(
                    p, {}, layout.graphdef, b, task, layout=layout if with_layout else None
                )[1]
            )(state.params, batch)
            for path, with_layout in (("cast where stored", True), ("cast at use", False))
        }
    # The stacked MLP kernel (layers, width, 4 width) is cast whole and kept split over fsdp,
    # before the scan over layers slices and gathers it.
    assert "(tensor<2x64x256xf32>) -> tensor<2x64x256xbf16>" in text
    assert '<@mesh, [{}, {"fsdp"}, {}]> : tensor<2x64x256xbf16>' in text
    cast_where_stored, cast_at_use = gradients.values()
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(cast_where_stored))
    assert_trees_close(cast_where_stored, cast_at_use, rtol=1e-2)
