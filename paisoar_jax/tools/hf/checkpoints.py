"""Hugging Face checkpoints in and out, every family of models/families/, via safetensors.

`hf_import` reads an HF model directory (config.json and model.safetensors, or the shards
of a model.safetensors.index.json) into our parameter layout, written as a params export
(what `checkpoint.init_from` and `generate` take) with a config.yaml beside it. `hf_export`
writes a run's (or an export's) params back as a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads. The library never imports
transformers or torch: the formats are plain JSON and safetensors.

Each tensor is read memory-mapped and on its own (reader.py: MXFP4 decoded), checked
against the shape our model has for it (from the file's header), and each device's shard
of our parameter is built on its own (`placed_params`: FSDP over every device), so no host
holds the whole model. It is converted (HF's Linear stores out x in, GPT-2's Conv1D in x
out; our kernels are in x out with heads as their own axis); a missing tensor or a shape
that does not match gets one line that names it. Blocks are stacked on the `layers` axis
(the scan layout, model.scan_layers=true). Both spellings of Llama-3's rope scaling are read:
`rope_scaling` (transformers 4.x) and `rope_parameters` (5.x).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import shutil

import numpy as np

from paisoar_jax.checkpointing.weights import TOKEN_IDS_FILE, kept_file
from paisoar_jax.config import Config, LanguageModelConfig, dump_yaml
from paisoar_jax.data.tokenizing import EOS_NAMES
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import (
    Tensor,
    family_of,
    hf_config,
    model_config_from_hf,
    tensors_of,
)
from paisoar_jax.output import describe_params
from paisoar_jax.runtime.user_files import read_json
from paisoar_jax.tools.hf import peft
from paisoar_jax.tools.hf.reader import SafetensorsReader

__all__ = ["hf_config", "hf_export", "hf_import", "model_config_from_hf"]

# The special token ids HF keeps in config.json: carried through an import to the export.
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Where an import came from: a PEFT adapter's base_model_name_or_path names it.
SOURCE_FILE = "hf_source.json"
# Files an import keeps beside the weights and an export writes back (the tokenizer as
# transformers saves it: its special tokens live in tokenizer_config.json).
KEPT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # where transformers >= 4.47 saves a chat template
    "special_tokens_map.json",
    "generation_config.json",
)


def hf_import(
    source: pathlib.Path, output: pathlib.Path, adapter: pathlib.Path | None = None
) -> str:
    """Writes the HF model in `source` as a params export with its config.yaml; a summary.

    With a PEFT LoRA `adapter` directory its adapters are imported too, and config.yaml's
    lora section (rank, alpha, dropout, targets) trains them on.

    In a multi-process run every process calls it: each builds and writes only the shards
    of its own devices, and process 0 writes the files beside them (its summary is the
    only one; the others return "").
    """
    import jax
    from jax.experimental import multihost_utils

    from paisoar_jax.checkpointing.weights import export_weights

    config_path = source / "config.json"
    if not config_path.is_file():
        raise UserError(f"{source} has no config.json: not a Hugging Face model directory")
    _check_empty(output)
    hf_json = read_json(config_path)
    model = model_config_from_hf(hf_json, config_path)
    reader = SafetensorsReader(source)
    shapes, shardings = placed_params(model)
    expected, places = _flat(shapes), _flat(shardings)
    adapters, lora_settings = {}, None
    if adapter is not None:
        kernel_shapes = {path: shape.shape for path, shape in expected.items()}
        adapters, lora_settings = peft.read_adapter(adapter, model, kernel_shapes, source)
    whole = jax.sharding.NamedSharding(
        next(iter(places.values())).mesh, jax.sharding.PartitionSpec()
    )
    state_shapes = _flat(nnx_state_shapes(model))  # small (a router's bias): whole on each
    params, model_state = {}, {}
    for tensor in (laid for listed in tensors_of(model) for laid in _laid_out(listed, model)):
        if tensor.state and tensor.ours in state_shapes:
            shape = state_shapes[tensor.ours].shape
            model_state[tensor.ours] = _placed(reader, source, tensor, model, shape, whole)
        if tensor.state or tensor.ours not in expected:  # (the head of tied embeddings)
            continue
        shape = expected[tensor.ours].shape
        params[tensor.ours] = _placed(reader, source, tensor, model, shape, places[tensor.ours])
    unmapped = sorted(set(expected) - set(params))
    if unmapped:  # a mapping gap of ours, never silently an untrained parameter
        raise UserError(f"{source}: no Hugging Face tensor maps to our {', '.join(unmapped)}")
    for path, array in adapters.items():  # small: each device holds all of it
        params[path] = jax.make_array_from_callback(array.shape, whole, array.__getitem__)
    multihost_utils.sync_global_devices("hf-import: every process checked --output")
    output.mkdir(parents=True, exist_ok=True)
    export_weights(_nested(params), _nested(model_state), output)
    if jax.process_index() != 0:
        return ""
    token_ids = {key: hf_json.get(key) for key in TOKEN_IDS}
    (output / TOKEN_IDS_FILE).write_text(json.dumps(token_ids) + "\n")
    (output / SOURCE_FILE).write_text(json.dumps({"path": str(source.absolute())}) + "\n")
    for name in KEPT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, output / name)
    config = imported_config(model, output)
    if lora_settings is not None:
        config = dataclasses.replace(config, lora=lora_settings)
    (output / "config.yaml").write_text(dump_yaml(config))
    count = sum(array.size for path, array in params.items() if path not in adapters)
    with_adapter = f" with the LoRA adapter of {adapter}" if adapter is not None else ""
    return (
        f"imported {describe_params(count)} of a {model.name} model{with_adapter} -> "
        f"{output}/params"
    )


def imported_config(model: LanguageModelConfig, output: pathlib.Path) -> Config:
    """The config.yaml of an import: its model, its weights as the start, its tokenizer."""
    config = Config(model=model)
    # Fine-tuning settings, not the embedded corpus's pretraining ones (lr 3e-3, decay 0.1):
    # a small lr with a short warm-up, no weight decay, no byte-level closing sample.
    optim = dataclasses.replace(config.optim, lr=1e-4, warmup_steps=20, weight_decay=0.0)
    config = dataclasses.replace(
        config, optim=optim, train=dataclasses.replace(config.train, sample_bytes=0)
    )
    tokenizer = output / "tokenizer.json"
    # Pinned: data converted with another tokenizer (or the byte-level embedded corpus) is
    # refused, rather than trained on as ids that mean other tokens.
    data = dataclasses.replace(
        config.data, tokenizer=str(tokenizer.absolute()) if tokenizer.is_file() else ""
    )
    start = dataclasses.replace(config.checkpoint, init_from=str(output.absolute()))
    return dataclasses.replace(config, data=data, checkpoint=start)


def hf_export(source: pathlib.Path, output: pathlib.Path, form: str = "model") -> str:
    """Writes the params of a run or export in `source` as an HF directory; a summary.

    A LoRA run's (lora.rank > 0) needs a `form`: "peft" writes its adapters alone, as
    PEFT saves them (peft.py); "merged" the whole model with the adapters folded in.
    """
    from safetensors.numpy import save_file

    from paisoar_jax.checkpointing.weights import read_weights

    config, params, model_state, where = read_weights(source)
    model = config.model
    if not isinstance(model, LanguageModelConfig):
        raise UserError(f"{source}: model.name={model.name} has no Hugging Face form here")
    hf_json = hf_config(model)  # refuses what HF's classes cannot hold, before any write
    # Multi-token prediction's modules (models/mtp.py) are training's: no HF class has them.
    flat = {path: array for path, array in _flat(params).items() if not path.startswith("mtp.")}
    if form == "model" and peft.has_adapters(flat):
        raise UserError(
            f"{source} holds LoRA adapters: export them with --peft (an adapter for PEFT over "
            f"the base model) or --merged (the model with them folded in)"
        )
    if form != "model" and not peft.has_adapters(flat):
        raise UserError(f"{source} holds no LoRA adapters (lora.rank=0): --{form} is for LoRA runs")
    _check_empty(output)
    if form == "peft":
        return _export_adapter(config, flat, source, output, where)
    if form == "merged":
        flat = peft.merged(flat, config.lora)
    kept = kept_file(TOKEN_IDS_FILE, config.checkpoint.init_from, source)
    token_ids = read_json(kept) if kept else {}
    hf_json |= {key: token_ids.get(key) for key in TOKEN_IDS}  # null where none is known
    tensors, written = {}, set()
    state = _flat(model_state or {})
    for tensor in (laid for listed in tensors_of(model) for laid in _laid_out(listed, model)):
        held = state if tensor.state else flat
        if tensor.ours not in held:  # the head of tied embeddings; a bias never balanced
            continue
        written.add(tensor.ours)
        stored = np.asarray(held[tensor.ours], np.float32)
        for combination, name in _their_names(tensor, model).items():
            # a leading axis per {i} and {j} of HF's name: one tensor per layer and expert
            array = np.asarray(tensor.to_theirs(stored[combination], model), np.float32)
            if tensor.interleaved and name in tensors:  # the other parts' features are 0
                array = tensors[name] + array
            tensors[name] = np.ascontiguousarray(array)
    unwritten = sorted(set(flat) - written)
    if unwritten:  # a setting the architecture has no tensor for: never silently dropped
        raise UserError(
            f"{source}: a Hugging Face {family_of(model).architecture} has no tensor for our "
            f"{', '.join(unwritten[:4])}{' ...' if len(unwritten) > 4 else ''}"
        )
    for name in KEPT_FILES:  # a broken one is refused before anything is written
        found = kept_file(name, config.checkpoint.init_from, source)
        if found is not None and name.endswith(".json"):
            read_json(found)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(hf_json, indent=2) + "\n")
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    _copy_kept(config, source, output, KEPT_FILES, token_ids)
    return f"exported {where} as a Hugging Face {family_of(model).architecture} -> {output}"


def _copy_kept(config: Config, source, output: pathlib.Path, names, token_ids: dict) -> None:
    """The import's kept files (tokenizer, generation settings) copied beside the export."""
    for name in names:
        found = kept_file(name, config.checkpoint.init_from, source)
        if found is not None:
            shutil.copyfile(found, output / name)
    if (output / "tokenizer.json").is_file():
        _complete_tokenizer_config(output, token_ids)


def _export_adapter(config: Config, flat: dict, source, output: pathlib.Path, where) -> str:
    """Writes a LoRA run's adapters as a PEFT adapter directory; a summary."""
    from safetensors.numpy import save_file

    tensors, targets = peft.adapter_tensors(flat, config.model)
    # The Hugging Face model the run's import came from (AutoPeftModel loads it from here).
    kept = kept_file(SOURCE_FILE, config.checkpoint.init_from, source)
    base = read_json(kept).get("path") if kept else None
    settings = peft.adapter_config(config.lora, config.model, targets, base)
    output.mkdir(parents=True, exist_ok=True)
    (output / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    save_file(tensors, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    # The tokenizer beside the adapter, as TRL's and PEFT's trainers save it.
    kept = kept_file(TOKEN_IDS_FILE, config.checkpoint.init_from, source)
    tokenizer_files = [name for name in KEPT_FILES if name != "generation_config.json"]
    _copy_kept(config, source, output, tokenizer_files, read_json(kept) if kept else {})
    count = sum(array.size for array in tensors.values())
    return (
        f"exported the LoRA adapters of {where} ({describe_params(count)}, rank "
        f"{config.lora.rank}, on {', '.join(targets)}) as a PEFT adapter -> {output}"
    )


def _complete_tokenizer_config(output: pathlib.Path, token_ids: dict) -> None:
    """tokenizer_config.json as transformers saves it, with the special tokens it lacks.

    A model imported with a bare tokenizer.json (or an HF one without a pad token) would
    load in AutoTokenizer with no eos or pad: they are named from the model's token ids
    (config.json's), the eos from the usual end-of-text names where none is given, and
    pad falls back to eos (what fine-tuning scripts set, as no token of ours is padding).
    A BOS is named only for a bare tokenizer.json: a tokenizer_config.json without one
    says the tokenizer has none (config.json's bos_token_id is then transformers' default,
    and naming it would put it before every context lm-eval scores).
    """
    path = output / "tokenizer_config.json"
    bare = not path.is_file()
    settings = read_json(path) if path.is_file() else {}
    tokenizer = read_json(output / "tokenizer.json")
    vocabulary = dict(tokenizer.get("model", {}).get("vocab") or {})
    vocabulary |= {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    names = {token_id: name for name, token_id in vocabulary.items()}
    eos_id = token_ids.get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    named = settings.get("eos_token")  # the tokenizer's own word first (maybe an AddedToken)
    eos = named.get("content") if isinstance(named, dict) else named
    eos = eos or names.get(eos_id) or next((name for name in EOS_NAMES if name in vocabulary), None)
    wanted = {
        "bos_token": names.get(token_ids.get("bos_token_id")) if bare else None,
        "eos_token": eos,
        "pad_token": names.get(token_ids.get("pad_token_id")) or eos,
    }
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key, value in wanted.items():
        if value is not None and not settings.get(key):
            settings[key] = value
    path.write_text(json.dumps(settings, indent=2) + "\n")


def abstract_params(model: LanguageModelConfig) -> dict:
    """Our model's params as shapes (nothing is allocated)."""
    from flax import nnx

    return nnx.to_pure_dict(_abstract_state(model))


def placed_params(model: LanguageModelConfig, devices=None) -> tuple[dict, dict]:
    """(shapes, shardings) of our params, split over every device as FSDP splits them.

    An import builds each device's shard on its own, so no host holds the whole model; a
    parameter whose shape does not split over the devices is kept whole on each.
    """
    import jax
    from flax import nnx

    from paisoar_jax.config import MeshConfig, ShardingConfig
    from paisoar_jax.parallel import rules, sharding

    mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=-1), devices or jax.devices())
    state = _abstract_state(model)
    shapes = nnx.to_pure_dict(state)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    placed, flat_specs = {}, _flat(specs)
    for path, shape in _flat(shapes).items():
        # One at a time, so a parameter that does not split falls back alone.
        one, spec = _nested({path: shape}), _nested({path: flat_specs[path]})
        try:
            found = rules.parameter_shardings(one, spec, mesh, ShardingConfig(), 0)[0]
            placed[path] = _flat(found)[path]
        except UserError:
            placed[path] = sharding.replicated(mesh)
    return shapes, _nested(placed)


def nnx_state_shapes(model: LanguageModelConfig) -> dict:
    """Our model's state that is not a parameter (a router's bias), as shapes."""
    from flax import nnx

    return nnx.to_pure_dict(_abstract_state(model, nnx.Not(nnx.Param)))


def _abstract_state(model: LanguageModelConfig, kind=None):
    """Our model's params (or the variables `kind` filters), as shapes."""
    import jax
    from flax import nnx

    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.zoo import build_model

    def create():
        built = build_model(model, get_policy("fp32"), "none", nnx.Rngs(params=0))
        return nnx.state(built, nnx.Param if kind is None else kind)

    with nnx.use_eager_sharding(False):
        return jax.eval_shape(create)


def _laid_out(tensor: Tensor, model: LanguageModelConfig) -> list[Tensor]:
    """A table's tensor as our params hold it: stacked (one), or one per unscanned block.

    Blocks that differ (model.scan_layers=false: a sliding-window pattern, dense layers
    between experts) are params of their own, blocks.0.q_kernel, blocks.1.q_kernel, ...
    """
    if model.scan_layers or not tensor.ours.startswith("blocks."):
        return [tensor]
    rest = tensor.ours.removeprefix("blocks.")
    return [
        dataclasses.replace(
            tensor, ours=f"blocks.{i}.{rest}", theirs=tensor.theirs.replace("{i}", str(i))
        )
        for i in range(model.layers)
        if tensor.on_layer(model, i)
    ]


def _their_names(tensor: Tensor, model: LanguageModelConfig) -> dict[tuple, str]:
    """HF's names of a tensor by the index of our array's leading axes ({i}, then {j})."""
    keys = [key for key in ("i", "j") if f"{{{key}}}" in tensor.theirs]
    return {
        combination: tensor.theirs.format(**dict(zip(keys, combination, strict=True)))
        for combination in itertools.product(*_leading_axes(tensor, model))
    }


def _leading_axes(tensor: Tensor, model: LanguageModelConfig) -> list[range]:
    """Our array's leading axes of HF's name: the layers for {i}, the experts for {j}."""
    counts = {"i": model.layers, "j": model.experts}
    return [range(count) for key, count in counts.items() if f"{{{key}}}" in tensor.theirs]


def _placed(reader, source, tensor: Tensor, model, shape: tuple, place):
    """Our param as a global array: each device's shard read and converted on its own.

    A stacked param's leading axes are the layers ({i} in HF's name) and the experts ({j});
    its shard is built an HF tensor at a time, one in host memory.
    """
    import jax

    names = _their_names(tensor, model)
    counts = [len(axis) for axis in _leading_axes(tensor, model)]
    lead = len(counts)  # our leading axes: the layers, the experts
    # Every tensor's shape is checked before any device is written, and only once.
    stored = {
        combination: _check_shape(reader, source, name, tensor, model, shape[lead:])
        for combination, name in names.items()
    }

    def shard(index):
        ranges = [range(count)[part] for count, part in zip(counts, index, strict=False)]
        pieces = [
            tensor.to_ours(reader.read(stored[combination]), model)[index[lead:]]
            for combination in itertools.product(*ranges)
        ]
        return np.stack(pieces).reshape(*map(len, ranges), *pieces[0].shape)

    return jax.make_array_from_callback(shape, place, shard)


def _check_shape(reader, source, name: str, tensor: Tensor, model, shape: tuple) -> str:
    """The stored name of HF tensor `name`, once its shape is the one our model needs."""
    stored = reader.name_of(name)
    if stored is None:
        raise UserError(f"{source}: tensor {name} is missing")
    found, wanted = reader.shape(stored), _their_shape(tensor, model, shape)
    if found != wanted:
        raise UserError(
            f"{source}: tensor {name} has shape {list(found)}, and config.json's model "
            f"needs {list(wanted)}"
        )
    return stored


def _their_shape(tensor: Tensor, model: LanguageModelConfig, shape: tuple) -> tuple:
    """The HF shape of our `shape`, traced (no array of that size is made)."""
    import jax

    ours = jax.ShapeDtypeStruct(shape, np.float32)
    return jax.eval_shape(lambda array: tensor.to_theirs(array, model), ours).shape


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict as {dotted path: leaf}."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        flat |= _flat(value, f"{path}.") if isinstance(value, dict) else {path: value}
    return flat


def _nested(flat: dict) -> dict:
    """{dotted path: leaf} as a nested dict."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def _check_empty(output: pathlib.Path) -> None:
    """--output must be new or an empty directory (made only once everything was read)."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output} exists and is not an empty directory")
