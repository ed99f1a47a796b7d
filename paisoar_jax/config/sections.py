"""The run's settings: one frozen dataclass per concern, each checking its own values.

A section refuses a value no run could use in its `__post_init__` (a count below its
minimum, a rate that is not finite, a shape that does not divide) with one-line `UserError`s;
`Config.__post_init__` holds the checks that read several sections at once, in one place.
What needs the devices (mesh sizes: sharding.py) or a model's own tables (an image variant's
shape: models/) is checked there, once the run has them. This module imports nothing of the
package but its error type, so anything may import it.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Literal

from paisoar_jax.config.checks import check_at_least, check_finite_non_negative, check_regex
from paisoar_jax.config.data import DataConfig
from paisoar_jax.config.lora import LoraConfig
from paisoar_jax.config.mesh import MeshConfig
from paisoar_jax.config.models import (
    CustomModelConfig,
    LanguageModelConfig,
    VisionConfig,
)
from paisoar_jax.config.optim import OptimConfig
from paisoar_jax.config.preference import DpoConfig, check_objective
from paisoar_jax.config.reinforcement import GrpoConfig
from paisoar_jax.config.run import RunConfig
from paisoar_jax.errors import UserError

# Sections of their own modules, parts of Config.
__all__ = ["DataConfig", "DpoConfig", "GrpoConfig", "LoraConfig", "MeshConfig", "RunConfig"]


# One mesh-axis entry of a sharding rule: a mesh axis (data, stage, fsdp, expert, context,
# tensor), a logical name
# of the rules table (embed, mlp, heads, vocab, ...), several mesh axes, or None (whole).
AxisEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class ShardingConfig:
    """How parameters the rules table does not know are split (models of one's own).

    Each parameter's sharding comes from, in this order: the first of `rules` whose regex
    is found in its dotted path (`blocks.0.attn.kernel`); else its own logical axis names
    (flax `nnx.with_partitioning`), through the table in paisoar_jax/parallel/sharding.py; else the
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
            check_regex(pattern, "sharding.rules")
        if self.min_split_size < 1:
            raise UserError(f"sharding.min_split_size must be >= 1, got {self.min_split_size}")


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed-precision policy: params stay fp32, compute runs in the policy's dtype."""

    # the compute dtype (params stay fp32): fp32; bf16; fp16 (with a dynamic loss scale);
    # fp8 (bf16, the zoo blocks' matmuls in fp8, scaled as precision.fp8 says)
    policy: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    # policy=fp8's scales: delayed (each from the amax of the past 1024 steps: no extra pass),
    # tensorwise (current: one per tensor, from its own amax) or rowwise (current: one per
    # row of each matmul's operands along the axes it contracts)
    fp8: Literal["delayed", "tensorwise", "rowwise"] = "delayed"
    # policy=fp8: a matmul whose contracted or output size is under this stays in bf16 (fp8
    # gains nothing on small matmuls; torchao measures the break-even near 1024); 0: none
    fp8_min_size: int = 0
    loss_scale: str = "auto"  # auto (dynamic for fp16, else none) | dynamic | none | static:<v>
    initial_scale: float = 2.0**15  # the dynamic loss scale's first value
    growth_interval: int = 2000  # finite steps in a row before the scale doubles
    hysteresis: int = 1  # non-finite steps in a row before the scale halves
    min_scale: float = 1.0  # the dynamic loss scale never halves below this
    max_scale: float = 2.0**24  # the dynamic loss scale never doubles above this
    # A model of one's own: cast the batch's floating arrays to the compute dtype before the
    # loss. Off, each input reaches the loss in its own dtype (a float32 timestep stays exact;
    # the flax layers cast what they are given).
    cast_inputs: bool = False

    def __post_init__(self):
        self.loss_scale_mode()
        check_at_least("precision", self, {"fp8_min_size": 0})

    def loss_scale_mode(self) -> tuple[str, float]:
        """(mode, static value) of `loss_scale`: dynamic, static or none (auto resolved)."""
        text = self.loss_scale
        if text == "auto":
            text = "dynamic" if self.policy == "fp16" else "none"
        if text in ("dynamic", "none"):
            return text, 1.0
        if text.startswith("static:"):
            try:
                value = float(text.removeprefix("static:"))
            except ValueError:
                value = -1.0
            if value > 0:
                return "static", value
        raise UserError(
            f"precision.loss_scale={text!r} is not auto, dynamic, none or static:<positive number>"
        )


@dataclass(frozen=True)
class RematConfig:
    """Activation checkpointing per block (policy names in paisoar_jax.numerics.remat)."""

    # what each block keeps for the backward pass (numerics/remat.py): none (everything);
    # full (nothing: the block recomputed); dots, dots_no_batch (matmul outputs);
    # minimal (attention and MLP outputs); offload_* (those moved to host memory)
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
            check_regex(pattern, "remat.blocks")
        if self.blocks and self.policy == "none":
            raise UserError(
                "remat.blocks names blocks, but remat.policy=none checkpoints nothing: set "
                "remat.policy=full (or dots, minimal, ...)"
            )


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

    def __post_init__(self):
        check_at_least("checkpoint", self, {"every": 0, "keep": 1, "keep_period": 0})
        if self.resume not in ("auto", "never") and not self.resume.isdigit():
            raise UserError(
                f"checkpoint.resume must be auto, never or a step number, got {self.resume!r}"
            )


def check_stage_groups(name: str, layers: int, stages: int, repeats: int) -> None:
    """Raises UserError unless `layers` blocks split into stages x repeats equal groups."""
    groups = stages * repeats
    if layers % groups:
        raise UserError(
            f"{name}={layers} does not split into mesh.stage x train.pipeline_repeats = "
            f"{stages} x {repeats} = {groups} equal groups"
        )


@dataclass(frozen=True)
class TrainConfig:
    """Length, batch and cadence of the training loop."""

    steps: int = 400  # optimizer steps of the run (the schedule ends here)
    # what the model learns: next_token (pre-training, SFT); dpo: to prefer each chosen
    # response of a preference dataset over its rejected one (the dpo section); grpo: the
    # answers to prompts that reward functions score higher (the grpo section)
    objective: Literal["next_token", "dpo", "grpo"] = "next_token"
    global_batch: int = 16  # sequences per optimizer step, over all devices and micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step, accumulated inside the step
    seed: int = 0  # seeds the initial weights, the data order and the step's random stream
    log_every: int = 10  # steps between metrics.jsonl records and printed lines
    # Steps between evals of the default eval set (0: never; a data.eval_sets entry with an
    # every of its own is still evaluated)
    eval_every: int = 100
    eval_batches: int = 0  # 0: every eval reads the whole eval set; n: its first n batches
    sample_bytes: int = 160  # length of the text sample generated at the end (0: none)
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 looks the device kind up
    # [start, end]: a jax.profiler trace of steps start..end into run.dir/profile (TensorBoard's
    # profile plugin or Perfetto); empty: no trace.
    profile_steps: tuple[int, ...] = ()
    memory_limit_gb: float = 0.0  # per-device GiB the compiled step must fit; 0: no check
    # Seconds without a finished step before a process says it hangs, asks for a save and
    # exits with status 3 (watchdog.py); 0: off; -1: 600 s when several processes train.
    hang_timeout_s: float = -1.0
    pipeline_microbatches: int = 0  # mesh.stage > 1: micro-batches a pass (0: 2 x stages)
    # mesh.stage > 1: laps round the stages (1: gpipe; more: the circular schedule, a smaller
    # bubble)
    pipeline_repeats: int = 1
    # An exponential moving average of the weights, moved each step: average * d + new * (1
    # - d) (0.999: about the last 1000 steps). Checkpointed with the run; fit's result has it
    # as .ema_model, `load(..., ema=True)` and `export --ema` read it. 0: none.
    ema_decay: float = 0.0
    # Skip the update of a step whose loss exceeds the mean of the last 128 steps' losses by
    # this many standard deviations (engine/spikes.py; counted as skipped_spikes); 0: off
    skip_spikes: float = 0.0
    # Steps between lm-evaluation-harness evals of the weights as they are (and at the last
    # step; metrics eval_harness_<task>/<metric>, lines in harness.jsonl); 0: none
    harness_every: int = 0
    harness_tasks: tuple[str, ...] = ()  # the harness's task names (hellaswag, a YAML's)
    harness_limit: float = 0.0  # the first N of each task's requests (< 1: a share); 0: all
    harness_include_path: str = ""  # a folder of task YAMLs of one's own

    def __post_init__(self):
        check_finite_non_negative("train", self, ("skip_spikes", "harness_limit"))
        if bool(self.harness_every) != bool(self.harness_tasks):
            raise UserError(
                "train.harness_every and train.harness_tasks go together: the tasks to "
                "evaluate and how often (train.harness_every=0 turns it off)"
            )
        if not 0 <= self.ema_decay < 1:
            raise UserError(
                f"train.ema_decay must be in [0, 1) (0: no average), got {self.ema_decay}"
            )
        positive = {key: 1 for key in ("steps", "global_batch", "grad_accum", "log_every")}
        check_at_least("train", self, positive)
        check_at_least("train", self, {"pipeline_microbatches": 0, "pipeline_repeats": 1})
        if self.global_batch % self.grad_accum:
            raise UserError(
                f"train.global_batch={self.global_batch} is not divisible by "
                f"train.grad_accum={self.grad_accum}"
            )
        profile = self.profile_steps
        if profile and profile[-1] > self.steps:
            raise UserError(
                f"train.profile_steps={list(profile)} ends after the last step "
                f"(train.steps={self.steps})"
            )
        check_at_least("train", self, {"eval_every": 0, "eval_batches": 0, "sample_bytes": 0})
        check_finite_non_negative("train", self, ("memory_limit_gb", "peak_tflops"))
        hang = self.hang_timeout_s
        if not (hang == -1 or 0 <= hang < math.inf):
            raise UserError(
                f"train.hang_timeout_s must be seconds >= 0 (0: off) or -1 (600 s when several "
                f"processes train), got {hang}"
            )
        if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
            raise UserError(
                "train.profile_steps must be [start, end] with 1 <= start <= end, "
                f"got {list(profile)}"
            )


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up (jax.distributed); what is left unset comes from the environment.

    Unset fields are read from the launcher's PAISOAR_* variables, SLURM, Open MPI or
    torchrun's variables, in that order (paisoar_jax/runtime/distributed.py); with none of them the
    run is one process.
    """

    coordinator: str = ""  # host:port where process 0 runs the coordinator; empty: environment
    num_processes: int = 0  # processes in the run; 0: environment (1 when nothing says)
    process_id: int = -1  # this process's rank, 0 .. num_processes - 1; -1: environment
    local_device_ids: str = ""  # comma-separated local device ids this process uses; empty: all
    timeout_s: int = 0  # seconds to wait for every process to join; 0: PAISOAR_TIMEOUT_S or 300


@dataclass(frozen=True)
class Config:
    """The whole run: one section per concern ([config keys](config.md) lists every key).

    Usually made by `load_config` (a YAML file and overrides); each section is a frozen
    dataclass that checks its own values, and `dataclasses.replace` makes a changed copy.

    Args:
        mesh: the device mesh: its axes' sizes, ZeRO, the gradients on the wire.
        model: the model: a zoo decoder's or image classifier's shape, or a model of one's own.
        data: the input: its source, tokenizer, packing, workers and eval sets.
        optim: the optimizer, learning-rate schedule, clipping and weight decay.
        precision: the compute dtype and loss scaling.
        remat: what each block keeps for the backward pass.
        lora: low-rank adapters (rank 0: none).
        sharding: rules placing the parameters of a model of one's own.
        checkpoint: where, how often and how many checkpoints; resume and init_from.
        train: steps, batch, accumulation, cadences, the pipeline's schedule.
        run: the run's name and directory, trackers, progress bar.
        distributed: the multi-process start-up (what the environment leaves unset).

    Example:
        ```python
        import dataclasses

        import paisoar_jax

        config = paisoar_jax.Config()  # the defaults: the embedded tiny GPT
        shorter = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=50))
        print(shorter.train.steps, shorter.model.name)  # 50 gpt
        ```

    """

    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: LanguageModelConfig | VisionConfig = field(default_factory=LanguageModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self):
        """The checks that read several sections; each section has checked itself."""
        if not isinstance(self.model, VisionConfig):
            for key in self.data.image_keys_changed():
                raise UserError(f"data.{key} is for image models (model.name=resnet|vgg|vit)")
        if isinstance(self.model, CustomModelConfig) and self.precision.policy == "fp8":
            raise UserError(
                "precision.policy=fp8 runs the zoo's transformer blocks (gpt, vit) in fp8; a "
                "model of your own trains in bf16 (its matmuls are not fp8 ops)"
            )
        if self.data.mixture and not isinstance(self.model, LanguageModelConfig):
            custom = isinstance(self.model, CustomModelConfig)
            raise UserError(
                f"data.mixture mixes token sources for the zoo's decoders (gpt, llama); "
                f"model.name={self.model.name} reads "
                f"{'the data given to fit' if custom else 'one data.source'}"
            )
        for key, fit_argument in (("eval_source", "eval_data"), ("eval_sets", "eval_sets")):
            if getattr(self.data, key) and not isinstance(self.model, LanguageModelConfig):
                custom = self.model.name == "custom"
                raise UserError(
                    f"data.{key} holds token eval sets for the zoo's decoders (gpt, llama); "
                    f"model.name={self.model.name} holds out data.eval_fraction"
                    f"{f' (or takes fit({fit_argument}=...))' if custom else ''}"
                )
        for entry in self.data.eval_sets:
            if not (entry.every or self.train.eval_every):
                raise UserError(
                    f"data.eval_sets: {entry.name} is evaluated every train.eval_every steps "
                    f"(its every is 0), and train.eval_every=0: give it its own every"
                )
        if self.data.eval_fraction == 0 and self.train.eval_every > 0 and not self.data.eval_source:
            also = " and give each of data.eval_sets its own every" if self.data.eval_sets else ""
            raise UserError(
                f"data.eval_fraction=0 leaves the default eval set no data: set "
                f"train.eval_every=0 too{also} (or set data.eval_source)"
            )
        self._check_pipeline()
        self._check_grad_comm()
        self._check_experts()
        self._check_context()
        check_objective(self)

    def _check_context(self) -> None:
        """Context parallelism (mesh.context > 1) against the model, its window and the mesh."""
        shards = self.mesh.contexts
        if shards == 1:
            return
        if not isinstance(self.model, LanguageModelConfig):
            raise UserError(
                "mesh.context splits the sequences of the zoo's decoders (gpt, llama); this "
                "model cannot split its inputs that way: split the batch with mesh.data"
            )
        model = self.model
        pieces = 2 * shards if model.context_balance else shards
        if model.seq_len % pieces:
            how = "2 x " * model.context_balance
            raise UserError(
                f"model.seq_len={model.seq_len} does not cut into {how}{shards} equal pieces "
                f"for mesh.context x mesh.dcn_context = {shards}"
                + (" with model.context_balance=true" if model.context_balance else "")
            )
        if model.attention == "cudnn" and model.context_attention == "ring":
            raise UserError(
                "model.attention=cudnn does not run in ring attention's hops (they fold "
                "statistics cuDNN does not return): use model.context_attention=gather, or "
                "model.attention=auto"
            )
        if self.mesh.experts > 1:
            raise UserError("mesh.context and mesh.expert do not combine yet: use one of them")

    def _check_experts(self) -> None:
        """A mixture of experts (model.experts > 0) against the mesh and the precision."""
        shards = self.mesh.experts
        if not isinstance(self.model, LanguageModelConfig) or self.model.experts == 0:
            if shards > 1:  # (fit checks its overrides on the zoo's dense default first)
                raise UserError(
                    "mesh.expert splits the experts of the zoo's decoders (model.experts), and "
                    "this model has none (a model of your own cannot use it yet): split the "
                    "batch with mesh.data"
                )
            return
        if self.model.experts % shards:
            raise UserError(
                f"model.experts={self.model.experts} does not split over the {shards} "
                "expert shards (mesh.expert x mesh.dcn_expert)"
            )
        if shards > 1 and self.mesh.grad_comm != "fp32":
            raise UserError(
                f"mesh.grad_comm={self.mesh.grad_comm} does not combine with mesh.expert > 1 "
                "yet: use mesh.grad_comm=fp32"
            )
        if self.mesh.stages > 1 and self.model.router_bias_rate:
            raise UserError(
                f"model.router_bias_rate does not pipeline yet ({self.mesh.describe_stages()}): "
                "each stage's micro-batches would move the biases on their own; set "
                "model.router_bias_rate=0 (balance with model.router_aux_loss)"
            )

    def _check_grad_comm(self) -> None:
        """mesh.grad_comm against the pipeline and the precision (grad_comm.py)."""
        if self.mesh.grad_comm == "fp32":
            return
        if self.mesh.stages > 1:
            raise UserError(
                f"mesh.grad_comm={self.mesh.grad_comm} does not combine with pipeline stages "
                f"yet ({self.mesh.describe_stages()}): use mesh.grad_comm=fp32"
            )
        if self.precision.policy == "fp8":
            raise UserError(
                f"mesh.grad_comm={self.mesh.grad_comm} does not combine with precision.policy="
                "fp8: each data shard would update the fp8 scaling state on its own"
            )

    def _check_pipeline(self) -> None:
        """mesh.stage against the batch, the model's stack and the precision."""
        stages, train = self.mesh.stages, self.train
        if stages == 1:
            for key, unset in (("pipeline_microbatches", 0), ("pipeline_repeats", 1)):
                if getattr(train, key) != unset:
                    raise UserError(f"train.{key} is for a pipelined mesh: set mesh.stage > 1")
            return
        microbatches = train.pipeline_microbatches or 2 * stages
        per_pass = train.global_batch // train.grad_accum
        if per_pass % microbatches:
            raise UserError(
                f"train.pipeline_microbatches={microbatches} does not divide the batch of "
                f"{per_pass} sequences per pass (train.global_batch / train.grad_accum)"
            )
        if train.pipeline_repeats > 1 and microbatches < stages:
            raise UserError(
                f"the circular schedule (train.pipeline_repeats > 1) needs "
                f"train.pipeline_microbatches >= {stages} stages, got {microbatches}"
            )
        if self.precision.policy == "fp8":
            raise UserError(
                "precision.policy=fp8 does not pipeline yet (mesh.stage > 1): each fp8 "
                "matmul's scaling state is updated once per forward pass, and a pipeline "
                "calls each block once per micro-batch"
            )
        model = self.model
        if isinstance(model, LanguageModelConfig):
            if not model.scan_layers:
                raise UserError(
                    "mesh.stage > 1 pipelines the stacked blocks: set model.scan_layers=true"
                )
            layers = model.layers
        else:  # an image model's variant (zoo.check_model) or one's own (when traced)
            return
        check_stage_groups("model.layers", layers, stages, train.pipeline_repeats)

    @property
    def run_dir(self) -> pathlib.Path:
        """The directory that holds everything this run writes."""
        return pathlib.Path(self.run.dir or f"runs/{self.run.name}")
