"""Run configuration: one frozen dataclass per concern, loaded from YAML plus dotted overrides.

A YAML file holds sections named after the fields of `Config` (mesh, model, data, ...); each
section lists only what differs from the dataclass defaults, so the defaults alone are the
embedded CPU-friendly run. Command-line overrides look like `optim.lr=3e-4`. Unknown keys,
wrong types and values outside a field's choices raise `UserError` with one line.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from paisoar_jax.errors import UserError

# The shipped recipes: paisoar_jax/configs inside an installed wheel, configs/ beside the
# package in a checkout and an editable install (pyproject.toml maps the one to the other).
_PACKAGE_DIR = pathlib.Path(__file__).parent
CONFIG_DIR = next(
    (path for path in (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs") if path.is_dir()),
    _PACKAGE_DIR / "configs",
)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh with axes (data, fsdp, tensor); -1 fills the remaining devices."""

    data: int = -1  # pure data parallelism within a host (ici)
    fsdp: int = 1  # params sharded over this axis, gathered per layer (FSDP)
    tensor: int = 1  # Megatron tensor parallelism: heads and MLP hidden split
    dcn_data: int = 1  # data parallelism across hosts/slices (dcn)
    dcn_fsdp: int = 1  # FSDP across hosts/slices (dcn)
    zero: int = 0  # 0 replicate over data; 1 (=2) shard optimizer state; 3 params too


@dataclass(frozen=True)
class ModelConfig:
    """Model choice (a name in the registry) and its shape."""

    name: str = "gpt"
    vocab_size: int = 256  # the embedded corpus is read byte-level
    seq_len: int = 128
    layers: int = 4
    width: int = 128
    heads: int = 4
    mlp_width: int = 0  # MLP hidden width; 0 means 4 * width
    position: Literal["learned", "rotary"] = "learned"
    tie_embeddings: bool = True
    scan_layers: bool = True  # scan over stacked blocks (fast compile) or unroll
    attention: Literal["auto", "xla", "cudnn"] = "auto"  # auto: cudnn on a GPU where it runs
    # false: logits in the compute dtype (bf16: half the bytes of the largest activation, as
    # PyTorch autocast has them); the loss upcasts them and runs in fp32 either way.
    fp32_logits: bool = True
    init_std: float = 0.02


@dataclass(frozen=True)
class VisionConfig:
    """An image classifier (model.name resnet, vgg or vit); a 0 shape field takes the variant's.

    The variants and their shapes are listed in paisoar_jax/models/layers.py (VARIANTS).
    """

    name: str = ""  # registry name: resnet, vgg or vit (empty: the variant's family)
    variant: str = ""  # resnet18/34/50/101/152, vgg11/13/16/19, vit_b16, vit_tiny; empty: default
    num_classes: int = 1000
    image_size: int = 224  # square input images, image_size x image_size pixels
    channels: int = 3  # input channels (1 for grayscale)
    width: int = 0  # ResNet/VGG: first-stage channels (64); ViT: embedding width
    depth: int = 0  # ResNet/VGG: layer count of the name (18, 50, 16...); ViT: blocks
    heads: int = 0  # ViT attention heads
    mlp_width: int = 0  # ViT: MLP hidden width; VGG: classifier hidden width (4096)
    patch: int = 0  # ViT patch size in pixels
    batch_norm: bool = False  # VGG only: BatchNorm after every conv (ResNet always has it)
    zero_init_residual: bool = True  # ResNet: last BatchNorm scale of each block starts at 0
    init_std: float = 0.02  # ViT: std of the dense and position-embedding initialisers
    label_smoothing: float = 0.0  # share of the target spread evenly over all classes


@dataclass(frozen=True)
class CustomModelConfig:
    """A model of the user's own, given to `paisoar_jax.fit(model=...)`: it has no zoo keys."""

    name: str = "custom"
    factory: str = ""  # written by fit: the model factory's qualified name (for config.yaml)


# model.name -> the dataclass of the `model` section: each family has its own keys.
MODEL_CONFIGS: dict[str, type] = {
    "gpt": ModelConfig,
    "resnet": VisionConfig,
    "vgg": VisionConfig,
    "vit": VisionConfig,
    "custom": CustomModelConfig,
}

# One mesh-axis entry of a sharding rule: a mesh axis (data, fsdp, tensor), a logical name
# of the rules table (embed, mlp, heads, vocab, ...), several mesh axes, or None (whole).
AxisEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class ShardingConfig:
    """How parameters the rules table does not know are split (models of one's own).

    Each parameter's sharding comes from, in this order: the first of `rules` whose regex
    is found in its dotted path (`blocks.0.attn.kernel`); else its own logical axis names
    (flax `nnx.with_partitioning`), through the table in paisoar_jax/sharding.py; else the
    default: whole on every device, except that under FSDP or ZeRO-3 a parameter of at
    least `min_split_size` elements is split on its largest dimension that the shard count
    divides. In a rule, `fsdp` (like the logical `embed`) also takes `data` under ZeRO-3
    for params and under ZeRO >= 1 for optimizer state.
    """

    # [[regex, [axis entry per dimension]], ...], e.g. [["mlp.*kernel", [fsdp, tensor]]]
    rules: tuple[tuple[str, tuple[AxisEntry, ...]], ...] = ()
    min_split_size: int = 2**14  # default inference: smaller parameters stay whole

    def __post_init__(self):
        for pattern, _ in self.rules:
            _check_regex(pattern, "sharding.rules")
        if self.min_split_size < 1:
            raise UserError(f"sharding.min_split_size must be >= 1, got {self.min_split_size}")


def _check_regex(pattern: str, key: str) -> None:
    """A regex of a config key must compile."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise UserError(f"{key}: {pattern!r} is not a valid regex ({error})") from None


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are loaded."""

    # gpt: embedded | synthetic | arrayrecord:<dir or glob>;
    # image models: images:<dir> | digits (scikit-learn's, no download) | synthetic
    source: str = "embedded"
    tokenizer: str = ""  # when set, must match the tokenizer of an arrayrecord dataset
    workers: int = 0  # grain worker processes (0: read in the main process)
    prefetch: int = 2  # global batches in flight on the devices
    eval_fraction: float = 0.05  # share of the data held out for eval (no separate split)
    min_crop_scale: float = 0.08  # images: smallest area share of a random-resized crop
    mixup_alpha: float = 0.0  # images: mixup's Beta(alpha, alpha); 0 turns mixup off
    # a resume onto data of another size or fingerprint: refuse it, or start the new data
    # from its first example
    on_change: Literal["refuse", "restart"] = "refuse"


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule, clipping and weight decay."""

    name: Literal["adamw", "sgd", "lamb", "lars"] = "adamw"
    lr: float = 3e-3
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 30
    final_lr_fraction: float = 0.1  # cosine/linear decay ends at lr * this
    clip_norm: float = 1.0  # global-norm clipping; 0 disables
    weight_decay: float = 0.1  # adamw: decoupled; sgd: L2 on the gradient; never norms, biases
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd and lars
    nesterov: bool = False  # sgd and lars
    trust_coefficient: float = 0.001  # lars: the layer-wise trust ratio's coefficient
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # rescale lr for the global batch
    base_batch: int = 0  # the global batch `lr` was tuned for (needed when lr_scaling != none)


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed-precision policy: params stay fp32, compute runs in the policy's dtype."""

    policy: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"  # fp8: bf16 + fp8 block matmuls
    loss_scale: str = "auto"  # auto (dynamic for fp16, else none) | dynamic | none | static:<v>
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # finite steps in a row before the scale doubles
    hysteresis: int = 1  # non-finite steps in a row before the scale halves
    min_scale: float = 1.0
    max_scale: float = 2.0**24


@dataclass(frozen=True)
class RematConfig:
    """Activation checkpointing per block (policy names in paisoar_jax.remat)."""

    policy: Literal[
        "none",
        "full",
        "dots",
        "dots_no_batch",
        "minimal",
        "offload_dots_no_batch",
        "offload_minimal",
    ] = "none"
    # Models of one's own: regexes of module paths (`blocks\.\d+`, found with re.search)
    # whose calls are checkpointed with `policy`, as paisoar_jax.remat_block(module) does.
    blocks: tuple[str, ...] = ()

    def __post_init__(self):
        for pattern in self.blocks:
            _check_regex(pattern, "remat.blocks")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under run.dir/checkpoints (or `dir`): async, atomic, resumable."""

    enabled: bool = True  # false: never save or resume (benchmarks)
    dir: str = ""  # empty: <run.dir>/checkpoints
    every: int = 100  # save every N steps; 0 saves only at the end (and on SIGTERM/SIGINT)
    keep: int = 3  # the newest checkpoints kept
    keep_period: int = 0  # also keep every step that is a multiple of this forever (0: none)
    async_save: bool = True  # write in the background while training goes on
    resume: str = "auto"  # auto (the newest readable checkpoint) | never | <step>
    init_from: str = ""  # start from exported params (a params export or checkpoint step dir)


@dataclass(frozen=True)
class TrainConfig:
    """Length, batch and cadence of the training loop."""

    steps: int = 400
    global_batch: int = 16  # sequences per optimizer step, over all devices and micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step, accumulated inside the step
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 disables eval
    eval_batches: int = 4
    sample_bytes: int = 160  # length of the text sample generated at the end (0: none)
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 looks the device kind up
    # [start, end]: a jax.profiler trace of steps start..end into run.dir/profile (TensorBoard's
    # profile plugin or Perfetto); empty: no trace.
    profile_steps: tuple[int, ...] = ()
    memory_limit_gb: float = 0.0  # per-device GiB the compiled step must fit; 0: no check


@dataclass(frozen=True)
class RunConfig:
    """Where the run writes and what it shows."""

    name: str = "default"
    dir: str = ""  # empty: runs/<name>
    tensorboard: bool = True
    progress: bool = True  # tqdm progress bar


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up (jax.distributed); what is left unset comes from the environment.

    Unset fields are read from the launcher's PAISOAR_* variables, SLURM, Open MPI or
    torchrun's variables, in that order (paisoar_jax/distributed.py); with none of them the
    run is one process.
    """

    coordinator: str = ""  # host:port where process 0 runs the coordinator; empty: environment
    num_processes: int = 0  # processes in the run; 0: environment (1 when nothing says)
    process_id: int = -1  # this process's rank, 0 .. num_processes - 1; -1: environment
    local_device_ids: str = ""  # comma-separated local device ids this process uses; empty: all
    timeout_s: int = 0  # seconds to wait for every process to join; 0: PAISOAR_TIMEOUT_S or 300


@dataclass(frozen=True)
class Config:
    """The whole run: one section per concern."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig | VisionConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def run_dir(self) -> pathlib.Path:
        """The directory that holds everything this run writes."""
        return pathlib.Path(self.run.dir or f"runs/{self.run.name}")


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Returns `value` as type `kind`, accepting strings from the command line."""
    if typing.get_origin(kind) is tuple:
        item_kind = typing.get_args(kind)[0]
        if item_kind in (int, str):  # [10, 20] in YAML, 10,20 or [10,20] on the command line
            items = _split_list(value) if isinstance(value, str) else value
            if isinstance(items, list | tuple):
                try:
                    return tuple(
                        _coerce(item, item_kind, key) for item in items if str(item).strip()
                    )
                except UserError:
                    pass
            example = "integers like [10, 20]" if item_kind is int else "strings like [a, b]"
            raise UserError(f"{key}: expected a list of {example}, got {value!r}")
        return _coerce_rules(value, key)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise UserError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"{key}: expected {kind.__name__}, got {value!r}")


def _split_list(text: str) -> list[str]:
    """`[a, b]` or `a,b` -> its items, split on commas outside brackets (regexes keep theirs)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items, depth, current = [], 0, ""
    for character in text:
        depth += (character in "[({") - (character in "])}")
        if character == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += character
    return [*items, current.strip()]


def _coerce_rules(value: Any, key: str) -> tuple:
    """Sharding rules: [[regex, [entry, ...]], ...] or {regex: [entry, ...]}, YAML on the CLI."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UserError(f"{key}: not valid YAML: {value!r}") from None
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list | tuple):
        raise UserError(f"{key}: expected a list of [regex, [axes per dimension]], got {value!r}")
    rules = []
    for rule in value:
        if not (isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise UserError(f"{key}: a rule is [regex, [axes per dimension]], got {rule!r}")
        pattern, entries = rule
        if isinstance(entries, str) or not isinstance(entries, list | tuple):
            entries = [entries]
        rules.append((pattern, tuple(_axis_entry(entry, key, pattern) for entry in entries)))
    return tuple(rules)


def _axis_entry(entry: Any, key: str, pattern: str) -> str | tuple[str, ...] | None:
    """One dimension of a rule: None, a name, or a list of mesh-axis names."""
    if entry is None or (isinstance(entry, str) and entry.lower() in ("none", "null", "")):
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list | tuple) and all(isinstance(name, str) for name in entry):
        return tuple(entry)
    raise UserError(f"{key}: rule {pattern!r}: {entry!r} is not an axis name or a list of them")


def _build_section(section_type: type, values: dict[str, Any], prefix: str) -> Any:
    """Builds one section dataclass from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(values, dict):
        raise UserError(f"{prefix}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(section_type)
    known = {f.name for f in dataclasses.fields(section_type)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise UserError(
                f"unknown config key {prefix}.{key}{_model_hint(prefix, key, values)} "
                f"(known: {', '.join(sorted(known))})"
            )
        kwargs[key] = _coerce(value, hints[key], f"{prefix}.{key}")
    return section_type(**kwargs)


def _model_hint(prefix: str, key: str, values: dict[str, Any]) -> str:
    """For a model key of another family: which model.name it belongs to."""
    if prefix != "model":
        return ""
    owners = sorted(
        {
            name
            for name, section_type in MODEL_CONFIGS.items()
            if key in {f.name for f in dataclasses.fields(section_type)}
        }
    )
    if not owners:
        return ""
    return f": it belongs to model.name={'|'.join(owners)}, not {values.get('name', 'gpt')}"


def resolve_config_path(path_or_name: str) -> pathlib.Path:
    """Finds a config by path, or by name among the shipped configs (`gpt2_124m`)."""
    path = pathlib.Path(path_or_name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{path.stem}.yaml"
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise UserError(f"config file not found: {path_or_name} (shipped configs: {names})")


def _parse_override(text: str) -> tuple[str, str, str]:
    """Splits `section.key=value` into its three parts."""
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form section.key=value")
    dotted, value = text.split("=", 1)
    if dotted.count(".") != 1:
        raise UserError(f"override key {dotted!r} is not of the form section.key")
    section, key = dotted.split(".")
    return section, key, value


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads a YAML config (or the defaults when `path` is None) and applies overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        config_path = resolve_config_path(path)
        try:
            raw = yaml.safe_load(config_path.read_text()) or {}
        except yaml.YAMLError as error:
            first_line = str(error).splitlines()[0]
            raise UserError(f"{config_path}: not valid YAML ({first_line})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{config_path}: expected a mapping of sections at the top level")
        raw.setdefault("run", {}).setdefault("name", config_path.stem)
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates a Config from plain sections (as YAML gives them) and overrides."""
    raw = {
        name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()
    }
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for text in overrides:
        section, key, value = _parse_override(text)
        if section not in sections:
            raise UserError(f"unknown config section {section!r} in override {text!r}")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise UserError(f"{section}: expected a mapping of keys")
        raw[section][key] = value
    for name in raw:
        if name not in sections:
            raise UserError(f"unknown config section {name!r} (known: {', '.join(sections)})")
    config = Config(
        **{
            name: _build_section(_section_type(name, raw), raw.get(name) or {}, name)
            for name in sections
        }
    )
    from paisoar_jax.validation import validate  # it imports this module's dataclasses

    validate(config)
    return config


def _section_type(name: str, raw: dict[str, Any]) -> type:
    """The dataclass of section `name`; the model section's follows its model.name."""
    if name != "model":
        return typing.get_type_hints(Config)[name]
    model_name = (
        (raw.get("model") or {}).get("name", "gpt") if isinstance(raw.get("model"), dict) else "gpt"
    )
    if model_name not in MODEL_CONFIGS:
        zoo = sorted(name for name in MODEL_CONFIGS if name != "custom")
        raise UserError(
            f"model.name={model_name!r} is not one of {', '.join(zoo)} (custom: a model of "
            f"your own, given to paisoar_jax.fit)"
        )
    return MODEL_CONFIGS[model_name]


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain dicts, for config.yaml in the run directory."""
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    """The resolved config as YAML text that load_config reads back to the same Config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)
