"""LoRA adapters in PEFT's format, both ways, and folded into the model's weights.

`adapter_tensors` gives a LoRA run's adapters as PEFT saves them: our adapter of a kernel
(`blocks.q_kernel_lora.a`, A: in x r, and `.b`, B: r x out, stacked over the layers) becomes
the `lora_A.weight` (r x in) and `lora_B.weight` (out x r) of the Hugging Face module that
kernel maps to (its family's table in models/families/: `model.layers.{i}.self_attn.q_proj`),
each key under PEFT's prefix `base_model.model.`: an adapter saved without it loads in PEFT
with no error, only a warning, and every lora_B left at zero. `adapter_config` writes the
rank, alpha, dropout and target modules the run trained with, so nothing is typed again at
export.

`merged` folds each adapter into its kernel (W + alpha / r x A B) for `hf-export --merged`.
`read_adapter` reads a PEFT adapter back into our adapters for `hf-import --adapter`, with
the lora section that trains them on.

The library never imports peft, transformers or torch: the files are JSON and safetensors.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np

from paisoar_jax.config import LanguageModelConfig, LoraConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import family_of, tensors_of
from paisoar_jax.runtime.user_files import read_json, safetensors_errors

PREFIX = "base_model.model."  # PEFT's key prefix: the PeftModel's own wrapping modules
ADAPTER_SUFFIXES = ("_lora.a", "_lora.b")


def has_adapters(flat: dict) -> bool:
    """Whether a {dotted path: array} of params holds LoRA adapters."""
    return any(path.endswith(ADAPTER_SUFFIXES) for path in flat)


def _kernels_of(flat: dict) -> list[str]:
    """The dotted paths of the kernels that have adapters."""
    return sorted(path.removesuffix("_lora.a") for path in flat if path.endswith("_lora.a"))


def _per_layer(kernel: str, array: np.ndarray, model: LanguageModelConfig):
    """(our stacked path, [(layer or None, that layer's array)]) of a kernel or adapter."""
    unscanned = re.fullmatch(r"blocks\.(\d+)\.(.+)", kernel)
    if unscanned:
        return f"blocks.{unscanned[2]}", [(int(unscanned[1]), array)]
    if kernel.startswith("blocks."):
        return kernel, [(layer, array[layer]) for layer in range(model.layers)]
    return kernel, [(None, array)]


def merged(flat: dict, lora: LoraConfig) -> dict:
    """The params with each adapter folded into its kernel, W + alpha / r x A B, in fp32."""
    result = {path: value for path, value in flat.items() if not path.endswith(ADAPTER_SUFFIXES)}
    for kernel in _kernels_of(flat):
        a, b = (np.asarray(flat[f"{kernel}_lora.{name}"], np.float32) for name in "ab")
        weight = np.asarray(flat[kernel], np.float32)
        rank = a.shape[-1]
        leading = a.ndim + b.ndim - 2 - weight.ndim  # 1: stacked over the layers
        a_flat = a.reshape(*a.shape[:leading], -1, rank)
        b_flat = b.reshape(*b.shape[:leading], rank, -1)
        delta = (lora.alpha / rank) * np.matmul(a_flat, b_flat)
        result[kernel] = weight + delta.reshape(weight.shape)
    return result


def adapter_tensors(flat: dict, model: LanguageModelConfig) -> tuple[dict, list[str]]:
    """({PEFT key: array}, target modules) of the adapters in `flat`."""
    by_ours = {tensor.ours: tensor for tensor in tensors_of(model)}
    tensors, modules = {}, []
    for kernel in _kernels_of(flat):
        ours, a_layers = _per_layer(kernel, np.asarray(flat[f"{kernel}_lora.a"]), model)
        _, b_layers = _per_layer(kernel, np.asarray(flat[f"{kernel}_lora.b"]), model)
        tensor = by_ours.get(ours)
        if tensor is None or "{j}" in tensor.theirs:
            raise UserError(f"{kernel} has no Hugging Face module to carry its LoRA adapter")
        for (layer, a), (_, b) in zip(a_layers, b_layers, strict=True):
            module = tensor.theirs.format(i=layer).removesuffix(".weight")
            rank = a.shape[-1]
            # Contiguous: safetensors writes an array's buffer as it lies, strides ignored.
            lora_a, lora_b = a.reshape(-1, rank).T, b.reshape(rank, -1).T
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(lora_a, np.float32)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b, np.float32)
            modules.append(module)
    # Short names ("q_proj") where every layer has them; else each module by its full name.
    short = {module.rsplit(".", 1)[1] for module in modules}
    if all(sum(m.endswith(f".{name}") for m in modules) == model.layers for name in short):
        return tensors, sorted(short)
    return tensors, sorted(modules)


def adapter_config(
    lora: LoraConfig, model: LanguageModelConfig, targets: list[str], base: str | None
) -> dict:
    """adapter_config.json: what `peft.PeftModel.from_pretrained` needs to rebuild them."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        # GPT-2's Conv1D keeps in x out: PEFT transposes its delta for it.
        "fan_in_fan_out": family_of(model).hf_type == "gpt2",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def read_adapter(
    directory: pathlib.Path,
    model: LanguageModelConfig,
    kernel_shapes: dict,
    base: pathlib.Path | None = None,
) -> tuple[dict, LoraConfig]:
    """({our adapter path: array}, lora section) of the PEFT adapter in `directory`.

    `kernel_shapes`: {our kernel path: shape} of the base model, imported from `base`. An
    adapter whose modules or shapes the base does not have (an adapter for another base) is
    refused in one line that sets its layers, width and base model beside this one's.
    """
    if not model.scan_layers:
        raise UserError(
            f"{directory}: importing a PEFT adapter onto a model whose blocks differ "
            f"(model.scan_layers=false: sliding and global layers, dense layers between "
            f"experts) is not supported yet: import the base, fine-tune with lora.rank, or "
            f"merge the adapter in transformers (merge_and_unload) and import that"
        )
    settings = read_adapter_settings(directory)
    stored = read_adapter_tensors(directory)
    _check_base(directory, stored, model, base)
    from paisoar_jax.models.gpt import Block as GptBlock
    from paisoar_jax.models.llama import Block as LlamaBlock

    input_axes = (GptBlock if model.name == "gpt" else LlamaBlock).LORA_KERNELS
    adapters, used = {}, set()
    for tensor in tensors_of(model):
        name = tensor.ours.removeprefix("blocks.")
        if name not in input_axes or "{i}" not in tensor.theirs:
            continue
        modules = [tensor.theirs.format(i=i).removesuffix(".weight") for i in range(model.layers)]
        keys = [f"{PREFIX}{module}.lora_{part}.weight" for module in modules for part in "AB"]
        present = [key in stored for key in keys]
        if not any(present):
            continue
        if not all(present):
            raise UserError(f"{directory}: adapts {tensor.theirs} in some layers only")
        shape = kernel_shapes[tensor.ours][1:]  # a layer's kernel
        inputs, outputs = shape[: input_axes[name]], shape[input_axes[name] :]
        a_layers, b_layers = [], []
        for module in modules:
            a_key, b_key = (f"{PREFIX}{module}.lora_{part}.weight" for part in "AB")
            wanted = ((settings.rank, int(np.prod(inputs))), (int(np.prod(outputs)), settings.rank))
            for key, want in zip((a_key, b_key), wanted, strict=True):
                if tuple(stored[key].shape) != want:
                    raise UserError(
                        f"{directory}: {key} has shape {list(stored[key].shape)} and this base "
                        f"model needs {list(want)} (an adapter for another base model?)"
                    )
            a_layers.append(stored[a_key].T.reshape(*inputs, settings.rank))
            b_layers.append(stored[b_key].T.reshape(settings.rank, *outputs))
            used |= {a_key, b_key}
        adapters[f"{tensor.ours}_lora.a"] = np.stack(a_layers).astype(np.float32)
        adapters[f"{tensor.ours}_lora.b"] = np.stack(b_layers).astype(np.float32)
    unknown = sorted(set(stored) - used)
    if unknown or not adapters:
        what = f"{unknown[0]} names no projection of" if unknown else "nothing in it adapts"
        raise UserError(
            f"{directory}: {what} this {model.name} model (an adapter for another base?)"
        )
    kernels = [path.removeprefix("blocks.") for path in _kernels_of(adapters)]
    targets = (rf"^blocks\.({'|'.join(kernels)})$",)
    return adapters, LoraConfig(settings.rank, settings.alpha, settings.dropout, targets)


def _check_base(
    directory: pathlib.Path, stored: dict, model: LanguageModelConfig, base: pathlib.Path | None
) -> None:
    """One line if the adapter's layers or width are not this base's: it adapts another.

    Its layers: the highest layer index in its keys, plus one; its width: the input size
    most of its lora_A matrices have (the residual stream's, for all but a down projection).
    """
    indices = [re.search(r"\.(?:layers|h)\.(\d+)\.", key) for key in stored]
    layers = 1 + max((int(found.group(1)) for found in indices if found), default=-1)
    inputs = [value.shape[1] for key, value in stored.items() if key.endswith("lora_A.weight")]
    width = max(set(inputs), key=inputs.count) if inputs else None
    if (layers, width) == (model.layers, model.width):
        return
    settings = read_json(directory / "adapter_config.json")
    named = settings.get("base_model_name_or_path") or "no base_model_name_or_path"
    raise UserError(
        f"{directory} is an adapter for another base model: {layers} layers of width {width} "
        f"({named}), and this one ({base or model.name}) has {model.layers} layers of width "
        f"{model.width}"
    )


def read_adapter_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """adapter_model.safetensors' tensors, by their names without PEFT's `.default.`."""
    from safetensors.numpy import load_file

    path = directory / "adapter_model.safetensors"
    with safetensors_errors(path):
        stored = load_file(str(path))
    return {key.replace(".default.", "."): value for key, value in stored.items()}


def read_adapter_settings(directory: pathlib.Path) -> LoraConfig:
    """The rank, alpha and dropout of adapter_config.json (a LoRA adapter's only)."""
    path = directory / "adapter_config.json"
    if not path.is_file() or not (directory / "adapter_model.safetensors").is_file():
        raise UserError(
            f"{directory}: not a PEFT adapter (adapter_config.json and "
            f"adapter_model.safetensors expected)"
        )
    found = read_json(path)
    if found.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type {found.get('peft_type')} is not LORA")
    for key in ("use_dora", "use_rslora"):
        if found.get(key):
            raise UserError(f"{path}: {key}=true is not a plain LoRA adapter, which this reads")
    if int(found.get("r", 0)) < 1:
        raise UserError(f"{path}: r={found.get('r')}: a LoRA adapter's rank is at least 1")
    missing = [key for key in ("lora_alpha", "lora_dropout") if key not in found]
    if missing:
        raise UserError(f"{path} has no {' or '.join(missing)}: not a whole PEFT adapter config")
    return LoraConfig(int(found["r"]), float(found["lora_alpha"]), float(found["lora_dropout"]))
