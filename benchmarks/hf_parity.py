"""Logit parity with transformers after `convert hf-import` and `hf-export`, on CPU.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/hf_parity.py

Builds random tiny models with transformers' own classes (a GPT-2, and a Llama with
grouped-query attention and Llama-3 rope scaling), imports each, and prints one JSON line
per check: the largest absolute logit difference and the mean KL divergence of our
next-token distribution from transformers', in fp32, on 1 device and on fsdp=2 x tensor=2,
and after an export back to HF.
"""

import json
import pathlib
import tempfile

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from paisoar_jax.checkpointing.weights import load_weights
from paisoar_jax.config import load_config
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.zoo import zoo_workload
from paisoar_jax.tools import hf

TOKENS = np.random.default_rng(0).integers(0, 512, (4, 64))
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
ROPE |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def models() -> dict:
    """The two random reference models, by name."""
    torch.manual_seed(0)
    shape = dict(vocab_size=512, num_hidden_layers=4, max_position_embeddings=128)
    llama = transformers.LlamaConfig(
        **shape,
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_parameters=ROPE,
    )
    gpt2 = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=4, n_head=8)
    return {
        "llama_gqa_rope_llama3": transformers.LlamaForCausalLM(llama).eval(),
        "gpt2": transformers.GPT2LMHeadModel(gpt2).eval(),
    }


def ours(directory: pathlib.Path, mesh: list[str], devices) -> np.ndarray:
    """Our logits from an export, placed on `mesh` over `devices`."""
    config = load_config(str(directory / "config.yaml"), [*mesh, "train.global_batch=4"])
    run = setup(config, zoo_workload(config), devices)
    with jax.set_mesh(run.mesh):
        params, _ = load_weights(directory, run.layout.abstract_state)
        forward = jax.jit(lambda p, t: nnx.merge(run.layout.graphdef, p, {})(t))
        return np.asarray(forward(params, TOKENS), np.float64)


def compare(name: str, check: str, logits: np.ndarray, reference: np.ndarray) -> None:
    """Prints the largest logit difference and the mean KL(reference || ours)."""
    log_p = torch.log_softmax(torch.tensor(reference), -1)
    log_q = torch.log_softmax(torch.tensor(logits), -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    difference = float(np.abs(logits - reference).max())
    print(json.dumps({"model": name, "check": check, "max_abs_logit_diff": difference, "kl": kl}))


def main() -> None:
    """Every check of both models."""
    devices = jax.devices()
    for name, model in models().items():
        with torch.no_grad():
            reference = model(torch.tensor(TOKENS)).logits.double().numpy()
        with tempfile.TemporaryDirectory() as scratch:
            root = pathlib.Path(scratch)
            model.save_pretrained(root / "hf")
            hf.hf_import(root / "hf", root / "ours")
            compare(
                name,
                "import, 1 device",
                ours(root / "ours", ["mesh.data=1"], devices[:1]),
                reference,
            )
            sharded = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
            compare(
                name,
                "import, fsdp=2 x tensor=2",
                ours(root / "ours", sharded, devices[:4]),
                reference,
            )
            hf.hf_export(root / "ours", root / "back")
            back = transformers.AutoModelForCausalLM.from_pretrained(root / "back").eval()
            with torch.no_grad():
                exported = back(torch.tensor(TOKENS)).logits.double().numpy()
            compare(
                name,
                "export, transformers",
                exported,
                ours(root / "ours", ["mesh.data=1"], devices[:1]),
            )


if __name__ == "__main__":
    main()
