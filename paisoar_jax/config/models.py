"""The `model` section: one dataclass per model family, chosen by model.name (MODEL_CONFIGS).

LanguageModelConfig serves the decoders (gpt, llama), dense or mixture-of-experts
(model.experts > 0: models/moe.py); VisionConfig the image classifiers; CustomModelConfig a
model of the user's own given to `fit`. Each checks its own values in `__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from paisoar_jax.config.checks import check_at_least, check_finite_non_negative
from paisoar_jax.errors import UserError

# The keys of the model section that only model.name=llama reads.
LLAMA_KEYS = ("kv_heads", "rope_scaling", "rope_factor", "rope_low_freq_factor")
LLAMA_KEYS += ("rope_high_freq_factor", "rope_original_length", "head_width", "qk_norm")
LLAMA_KEYS += ("qkv_bias", "sliding_window", "global_every", "local_rope_theta", "norm_offset")
LLAMA_KEYS += ("post_norms", "mlp_activation", "embed_scale", "query_scale_width")
LLAMA_KEYS += ("out_bias", "attention_sinks", "rope_beta_fast", "rope_beta_slow")
LLAMA_KEYS += ("rope_truncate", "rope_attention_factor", "kv_latent_width", "q_latent_width")
LLAMA_KEYS += ("rope_head_width", "value_head_width", "rope_interleave")
# The keys of the model section that only a mixture of experts (model.experts > 0) reads.
MOE_KEYS = ("experts_per_token", "expert_mlp_width", "expert_capacity_factor", "moe_every")
MOE_KEYS += ("shared_experts", "router", "router_renormalize", "router_aux_loss", "router_z_loss")
MOE_KEYS += ("router_bias_rate", "expert_bias", "expert_activation", "swiglu_alpha")
MOE_KEYS += ("swiglu_limit", "router_groups", "router_top_groups", "router_scale", "dense_layers")
MOE_KEYS += ("moe_impl",)


@dataclass(frozen=True)
class LanguageModelConfig:
    """A decoder language model and its shape: model.name gpt (the default) or llama.

    gpt: GPT-2's pre-LayerNorm blocks with biases and a GELU MLP. llama: RMSNorm, a SwiGLU
    MLP, rotary positions and grouped-query attention (kv_heads), no biases.
    """

    name: Literal["gpt", "llama"] = "gpt"  # the family: gpt (GPT-2 blocks) or llama (Llama 3)
    vocab_size: int = 256  # token ids the model embeds (256: bytes, as the embedded corpus)
    seq_len: int = 128  # the training window, in tokens
    # Positions the model holds (0: seq_len): the learned table's rows, the export's
    # n_positions / max_position_embeddings, the longest generation; at least seq_len.
    max_positions: int = 0
    layers: int = 4  # transformer blocks in the stack
    width: int = 128  # the model (embedding) width, d_model
    heads: int = 4  # attention heads per block (width / heads each, unless head_width)
    mlp_width: int = 0  # MLP hidden width; 0 means 4 * width
    position: Literal["learned", "rotary"] = "learned"  # gpt's choice; llama's is rotary
    tie_embeddings: bool = True  # the output head reuses the token embedding (GPT-2's)
    scan_layers: bool = True  # scan over stacked blocks (fast compile) or unroll
    attention: Literal["auto", "xla", "cudnn"] = "auto"  # auto: cudnn on a GPU where it runs
    # With mesh.context > 1 (parallel/context.py): how attention reaches the keys and
    # values of the other devices' tokens: gather (an all-gather of K and V per layer) or
    # ring (K and V passed round the context devices, an online softmax); context_balance
    # lays each sequence out so every device gets a chunk from the front and one from the
    # back (equal causal work), seq_len cutting into 2 x context pieces.
    context_attention: Literal["gather", "ring"] = "gather"
    # mesh.context > 1: each device a chunk from the front and one from the back (equal
    # causal work), seq_len cut into 2 x context pieces; false: one contiguous chunk each
    context_balance: bool = True
    # false: logits in the compute dtype (bf16: half the bytes of the largest activation, as
    # PyTorch autocast has them); the loss upcasts them and runs in fp32 either way.
    fp32_logits: bool = True
    # The loss takes the vocabulary in this many slices (models/chunked_loss.py): no B x T x
    # V logits are made, for the head's forward matmul twice; 0: the logits whole; -1
    # (auto): slices of at most 8,192 columns where the vocabulary is larger (gpt2_124m on
    # an H200: 3% faster a step and 1.5 GiB less, benchmarks/RESULTS.md), else whole
    loss_chunks: int = -1
    # Multi-token prediction (DeepSeek-V3's MTP, models/mtp.py): this many extra modules,
    # the k-th predicting the token k + 1 ahead from the stream and the next k tokens'
    # embeddings, each one more block; training only (0: off)
    mtp_depth: int = 0
    mtp_loss: float = 0.3  # the modules' mean loss's weight in the loss (DeepSeek-V3's lambda)
    init_std: float = 0.02  # std of the normal initialiser of every weight matrix
    norm_eps: float = 1e-6  # the epsilon of every layer norm (GPT-2 and Llama use 1e-5)
    rope_theta: float = 10000.0  # rotary positions: the base of the frequencies
    kv_heads: int = 0  # llama only: key/value heads of grouped-query attention (0: heads)
    # llama only: llama3 is Llama 3.1's long-context rope scaling, with the four numbers below
    # (as in HF's config.json); linear divides every frequency by rope_factor (Gemma 3's
    # global layers); yarn blends the two by wavelength (GPT-OSS's, with the rope_beta_* keys)
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = "none"
    rope_factor: float = 8.0  # llama3 or linear rope scaling: how much longer the context grows
    rope_low_freq_factor: float = 1.0  # llama3 rope scaling: low-frequency wavelength bound
    rope_high_freq_factor: float = 4.0  # llama3 rope scaling: high-frequency bound
    rope_original_length: int = 8192  # llama3 or yarn rope scaling: the context trained before
    rope_beta_fast: float = 32.0  # yarn: rotations below which a frequency is interpolated
    rope_beta_slow: float = 1.0  # yarn: rotations above which a frequency is kept
    rope_truncate: bool = True  # yarn: the blend's bounds rounded to whole dimensions
    # yarn: the rotary tables' scale (0: 0.1 ln(rope_factor) + 1, YaRN's)
    rope_attention_factor: float = 0.0
    head_width: int = 0  # llama only: each head's width (0: width / heads; Qwen3's is wider)
    qk_norm: bool = False  # llama only: RMSNorm on each head's queries and keys (Qwen3)
    qkv_bias: bool = False  # llama only: biases on the queries, keys and values (Qwen2's)
    # llama only: a token attends to this many tokens, itself and those just before it (0:
    # every earlier token; Mistral's and Gemma's sliding window)
    sliding_window: int = 0
    # llama only, with sliding_window: block i attends to every earlier token when
    # (i + 1) % global_every == 0 (Gemma 3: 6, Gemma 2: 2); 0: every block slides
    global_every: int = 0
    local_rope_theta: float = 0.0  # llama only: the sliding blocks' rotary base (0: rope_theta)
    norm_offset: bool = False  # llama only: every RMSNorm scales by (1 + w), w from 0 (Gemma's)
    # llama only: RMSNorms on the attention's and the MLP's outputs too, before each joins
    # the stream (Gemma 2 and 3)
    post_norms: bool = False
    # llama only: the gated MLP's activation: silu (SwiGLU, Llama's) or gelu_tanh (GeGLU
    # with tanh GELU, Gemma's)
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    embed_scale: bool = False  # llama only: embeddings times sqrt(width) (Gemma's)
    # llama only: attention logits divided by sqrt(this) instead of sqrt(head width) (0:
    # the head width; Gemma's query_pre_attn_scalar)
    query_scale_width: float = 0.0
    out_bias: bool = False  # llama only: a bias on the attention's output projection (GPT-OSS)
    # llama only: a learned logit per head in each softmax's denominator, attending to
    # nothing (GPT-OSS's attention sinks)
    attention_sinks: bool = False
    # llama only: multi-head latent attention (DeepSeek's MLA, models/latent.py) when > 0:
    # the keys and values are made from a latent of this width (kv_lora_rank), normed
    kv_latent_width: int = 0
    # llama only, with kv_latent_width: the queries made through a normed latent of this
    # width too (q_lora_rank; 0: projected from the stream directly)
    q_latent_width: int = 0
    # llama only, with kv_latent_width: the rotated part of each query head and of the key
    # that every head shares (qk_rope_head_dim); head_width is the unrotated part
    rope_head_width: int = 0
    # llama only, with kv_latent_width: each value head's width (v_head_dim; 0: head_width)
    value_head_width: int = 0
    # llama only, with kv_latent_width: rotary positions pair neighbouring features
    # (DeepSeek's rope_interleave) instead of the two halves of a head (Llama's)
    rope_interleave: bool = False
    # Mixture of experts (models/moe.py): 0 experts is a dense model. Each MoE layer's
    # feed-forward is `experts` SwiGLU experts of expert_mlp_width (0: mlp_width), a token
    # going to its experts_per_token best; every moe_every-th layer is one (layer i when
    # (i + 1) % moe_every == 0, Qwen-MoE's decoder_sparse_step).
    experts: int = 0
    experts_per_token: int = 2  # the experts each token is routed to (top-k)
    expert_mlp_width: int = 0  # each expert's SwiGLU hidden width (0: mlp_width)
    # Seats per expert: capacity_factor x tokens x experts_per_token / experts per batch
    # row, the choices beyond dropped; 0 is dropless (every choice kept).
    expert_capacity_factor: float = 0.0
    # how the experts compute: capacity (each expert over its tokens' seats in X x C buffers,
    # expert_capacity_factor's) or dropless (grouped matmuls over the choices sorted by
    # expert: every choice computed, nothing padded; models/dropless.py)
    moe_impl: Literal["capacity", "dropless"] = "capacity"
    moe_every: int = 1  # every n-th block has experts, the others dense (1: all)
    shared_experts: int = 0  # DeepSeek: SwiGLU experts every token takes, unweighted
    router: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3's scores
    router_renormalize: bool = True  # the chosen experts' weights sum to 1 (Mixtral)
    router_aux_loss: float = 0.01  # the balance loss's weight in the loss (Switch's)
    router_z_loss: float = 0.0  # the router z-loss's weight (ST-MoE uses 0.001)
    # DeepSeek-V3's balancing without a loss: a per-expert bias on the scores that choose
    # (not on the weights), moved by this much after each batch toward the even load (0: off)
    router_bias_rate: float = 0.0
    # biases on the router's logits and on each expert's three matmuls (GPT-OSS)
    expert_bias: bool = False
    # each expert's gated activation: silu (SwiGLU) or clamped_swiglu (GPT-OSS's: the gate
    # capped at swiglu_limit, the up clipped to +-swiglu_limit, (up + 1) x gate x
    # sigmoid(swiglu_alpha x gate))
    expert_activation: Literal["silu", "clamped_swiglu"] = "silu"
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's slope
    swiglu_limit: float = 7.0  # clamped_swiglu: the gate's cap and the up's bound
    # the experts in this many equal groups, a token choosing its experts within its
    # router_top_groups best groups (DeepSeek-V3's n_group; 1: one group)
    router_groups: int = 1
    # with router_groups: the groups a token's experts come from, ranked by the sum of
    # each group's two best scores (sigmoid, DeepSeek-V3's topk_group) or by its best
    # (softmax, DeepSeek-V2's); 0: every group
    router_top_groups: int = 0
    router_scale: float = 1.0  # the chosen experts' weights times this (routed_scaling_factor)
    # the first this many blocks have a dense MLP of mlp_width, the rest experts
    # (DeepSeek's first_k_dense_replace; needs model.scan_layers=false)
    dense_layers: int = 0

    def __post_init__(self):
        if self.name == "llama":  # its positions are always rotary: config.yaml says so
            object.__setattr__(self, "position", "rotary")
        else:
            self._refuse_llama_keys()
        positive = {key: 1 for key in ("vocab_size", "seq_len", "layers", "width", "heads")}
        check_at_least("model", self, positive)
        if self.mlp_width < 0:
            raise UserError(
                f"model.mlp_width must be >= 0 (0 means 4 * width), got {self.mlp_width}"
            )
        if self.width % self.heads and not self.head_width:
            raise UserError(
                f"model.width={self.width} is not divisible by model.heads={self.heads}"
            )
        if self.position == "rotary" and self.rotary_width % 2:
            raise UserError("model.position=rotary needs an even head width (width / heads)")
        self._check_latent()
        check_at_least("model", self, {"kv_heads": 0, "rope_original_length": 1})
        check_at_least("model", self, {"head_width": 0, "loss_chunks": -1})
        check_at_least("model", self, {"max_positions": 0, "mtp_depth": 0})
        check_finite_non_negative("model", self, ("mtp_loss",))
        if self.mtp_loss != 0.3 and not self.mtp_depth:
            raise UserError("model.mtp_loss is for multi-token prediction: set model.mtp_depth")
        self._check_window()
        if self.max_positions and self.seq_len > self.max_positions:
            raise UserError(
                f"model.seq_len={self.seq_len} is longer than the model's "
                f"model.max_positions={self.max_positions} positions"
            )
        if self.heads % self.key_value_heads:
            raise UserError(
                f"model.heads={self.heads} is not divisible by model.kv_heads={self.kv_heads}"
            )
        for key in ("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise UserError(f"model.{key} must be a finite number > 0, got {value}")
        self._check_experts()
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise UserError(
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} must be above "
                f"model.rope_low_freq_factor={self.rope_low_freq_factor}"
            )

    @property
    def positions(self) -> int:
        """The positions the model holds: max_positions, or seq_len when it is 0."""
        return self.max_positions or self.seq_len

    @property
    def head_size(self) -> int:
        """The width of one attention head: head_width, or width / heads when it is 0."""
        return self.head_width or self.width // self.heads

    @property
    def expert_width(self) -> int:
        """Each expert's SwiGLU hidden width: expert_mlp_width, else mlp_width, else 4 x width."""
        return self.expert_mlp_width or self.mlp_width or 4 * self.width

    @property
    def query_head_size(self) -> int:
        """A query's (and a key's) head width: head_size, plus the rotated part with MLA."""
        return self.head_size + (self.rope_head_width if self.kv_latent_width else 0)

    @property
    def value_head_size(self) -> int:
        """A value's head width: value_head_width with MLA where set, else head_size."""
        return (self.value_head_width if self.kv_latent_width else 0) or self.head_size

    @property
    def rotary_width(self) -> int:
        """The features of a head that rotary positions turn: all, or MLA's rotated part."""
        return self.rope_head_width if self.kv_latent_width else self.head_size

    @property
    def key_value_heads(self) -> int:
        """The key/value heads: kv_heads, or heads when it is 0 (no grouping)."""
        return self.kv_heads or self.heads

    def _check_experts(self) -> None:
        """The MoE keys: a dense model (experts=0) leaves them unset."""
        if self.experts == 0:
            for key in MOE_KEYS:  # the class's own defaults (an instance would recurse)
                if getattr(self, key) != LanguageModelConfig.__dataclass_fields__[key].default:
                    raise UserError(f"model.{key} is for a mixture of experts: set model.experts")
            return
        check_at_least("model", self, {"experts": 2, "experts_per_token": 1, "moe_every": 1})
        check_at_least("model", self, {"router_groups": 1, "router_top_groups": 0})
        check_at_least("model", self, {"dense_layers": 0})
        check_at_least("model", self, {"expert_mlp_width": 0, "shared_experts": 0})
        if self.experts_per_token > self.experts:
            raise UserError(
                f"model.experts_per_token={self.experts_per_token} is more than the "
                f"model.experts={self.experts} there are"
            )
        self._check_groups()
        if self.moe_impl == "dropless" and self.expert_capacity_factor:
            raise UserError(
                f"model.moe_impl=dropless drops no choice: model.expert_capacity_factor="
                f"{self.expert_capacity_factor} has no seats to count (set it to 0)"
            )
        keys = ("expert_capacity_factor", "router_aux_loss", "router_z_loss", "router_bias_rate")
        check_finite_non_negative("model", self, keys)
        if self.moe_every > self.layers:
            raise UserError(
                f"model.moe_every={self.moe_every} is more than model.layers={self.layers}: "
                "no layer would have experts"
            )
        if self.mlp_activation != "silu" and self.moe_every == 1 and not self.dense_layers:
            raise UserError(
                f"model.mlp_activation={self.mlp_activation} is the dense MLP's, and every "
                "block has experts: set model.expert_activation for theirs"
            )
        if self.expert_activation != "silu" and self.shared_experts:
            raise UserError(
                f"model.expert_activation={self.expert_activation} with model.shared_experts: "
                "the shared experts are SwiGLU (no architecture has both yet)"
            )
        if self.dense_layers and self.scan_layers:
            raise UserError(
                f"model.dense_layers={self.dense_layers} puts dense blocks before the experts, "
                "which one scanned stack cannot hold: set model.scan_layers=false"
            )
        if self.moe_every > 1 and self.scan_layers:
            raise UserError(
                f"model.moe_every={self.moe_every} mixes dense and MoE blocks, which one "
                "scanned stack cannot hold: set model.scan_layers=false (or model.moe_every=1)"
            )

    def _check_groups(self) -> None:
        """Group-limited routing: the experts split evenly, enough to choose from."""
        groups, top = self.router_groups, self.router_top_groups or self.router_groups
        if not (math.isfinite(self.router_scale) and self.router_scale > 0):
            raise UserError(
                f"model.router_scale must be a finite number > 0, got {self.router_scale}"
            )
        if self.experts % groups:
            raise UserError(
                f"model.experts={self.experts} do not split into model.router_groups={groups} "
                "equal groups"
            )
        if top > groups:
            raise UserError(
                f"model.router_top_groups={top} is more than the model.router_groups={groups}"
            )
        if groups > 1 and self.router == "sigmoid" and self.experts // groups < 2:
            raise UserError(
                f"model.router_groups={groups} leaves one expert a group: a sigmoid router "
                "ranks a group by its two best scores"
            )
        if top * (self.experts // groups) < self.experts_per_token:
            raise UserError(
                f"model.router_top_groups={top} groups of {self.experts // groups} experts "
                f"hold fewer than model.experts_per_token={self.experts_per_token}"
            )
        if self.dense_layers >= self.layers:
            raise UserError(
                f"model.dense_layers={self.dense_layers} is not fewer than model.layers="
                f"{self.layers}: no layer would have experts"
            )

    def _check_latent(self) -> None:
        """Multi-head latent attention's keys: set together, with what MLA computes."""
        check_at_least("model", self, {"kv_latent_width": 0, "q_latent_width": 0})
        check_at_least("model", self, {"rope_head_width": 0, "value_head_width": 0})
        if not self.kv_latent_width:
            for key in ("q_latent_width", "rope_head_width", "value_head_width", "rope_interleave"):
                if getattr(self, key):
                    raise UserError(
                        f"model.{key} is for multi-head latent attention: set model.kv_latent_width"
                    )
            return
        if not self.rope_head_width:
            raise UserError(
                "model.kv_latent_width needs model.rope_head_width: the rotated part of each "
                "query and key head (DeepSeek's qk_rope_head_dim)"
            )
        refused = {
            "kv_heads": self.kv_heads not in (0, self.heads),
            "qk_norm": self.qk_norm,
            "qkv_bias": self.qkv_bias,
            "out_bias": self.out_bias,
            "attention_sinks": self.attention_sinks,
            "sliding_window": self.sliding_window,
            "norm_offset": self.norm_offset,
        }
        for key, bad in refused.items():
            if bad:
                raise UserError(
                    f"model.{key}={getattr(self, key)} with multi-head latent attention "
                    "(model.kv_latent_width): every head has its own keys and values from the "
                    "latent, over every earlier token, with no biases, head norms, sinks or "
                    "offset norms"
                )

    def _check_window(self) -> None:
        """The sliding window's keys: blocks that differ need model.scan_layers=false."""
        check_at_least("model", self, {"sliding_window": 0, "global_every": 0})
        for key in ("local_rope_theta", "query_scale_width"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"model.{key} must be a finite number >= 0, got {value}")
        if self.attention_sinks and self.attention == "cudnn":
            raise UserError(
                "model.attention=cudnn has no attention sinks (model.attention_sinks runs "
                "XLA's attention): use auto or xla"
            )
        if self.global_every == 1:
            raise UserError(
                "model.global_every=1 makes every block global: leave it 0 for a window on "
                "every block, or set model.sliding_window=0 for none"
            )
        for key in ("rope_beta_fast", "rope_beta_slow"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                raise UserError(
                    f"model.{key} must be a finite number > 0, got {getattr(self, key)}"
                )
        if not (math.isfinite(self.rope_attention_factor) and self.rope_attention_factor >= 0):
            raise UserError(
                f"model.rope_attention_factor must be a finite number >= 0 (0: YaRN's own), "
                f"got {self.rope_attention_factor}"
            )
        if not self.sliding_window and (self.global_every or self.local_rope_theta):
            key = "global_every" if self.global_every else "local_rope_theta"
            raise UserError(f"model.{key} is for sliding-window blocks: set model.sliding_window")
        if self.global_every > 1 and self.scan_layers:
            raise UserError(
                f"model.global_every={self.global_every} mixes sliding-window and global "
                "blocks, which one scanned stack cannot hold: set model.scan_layers=false"
            )

    def window_of(self, layer: int) -> int:
        """How many tokens block `layer` (from 0) attends to, itself included; 0: all before."""
        every = self.global_every
        return 0 if every and (layer + 1) % every == 0 else self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (from 0) has experts: every moe_every-th after dense_layers."""
        if self.experts == 0 or layer < self.dense_layers:
            return False
        return (layer + 1) % self.moe_every == 0

    def _refuse_llama_keys(self) -> None:
        """Keys only llama reads, set on another model: they would silently do nothing."""
        defaults = LanguageModelConfig(name="llama")
        for key in LLAMA_KEYS:
            if getattr(self, key) != getattr(defaults, key):
                raise UserError(f"model.{key} is for model.name=llama, not {self.name}")


@dataclass(frozen=True)
class VisionConfig:
    """An image classifier (model.name resnet, vgg or vit); a 0 shape field takes the variant's.

    The variants and their shapes are listed in paisoar_jax/models/layers.py (VARIANTS).
    """

    name: str = ""  # registry name: resnet, vgg or vit (empty: the variant's family)
    variant: str = ""  # resnet18/34/50/101/152, vgg11/13/16/19, vit_b16, vit_tiny; empty: default
    num_classes: int = 1000  # classes of the classifier head (at least 2)
    image_size: int = 224  # square input images, image_size x image_size pixels
    channels: int = 3  # input channels (1 for grayscale)
    width: int = 0  # ResNet/VGG: first-stage channels (64); ViT: embedding width
    depth: int = 0  # ResNet/VGG: layer count of the name (18, 50, 16...); ViT: blocks
    heads: int = 0  # ViT attention heads
    mlp_width: int = 0  # ViT: MLP hidden width; VGG: classifier hidden width (4096)
    patch: int = 0  # ViT patch size in pixels
    batch_norm: bool = False  # VGG only: BatchNorm after every conv (ResNet always has it)
    # ViT only: the blocks stacked on a `layers` axis and scanned (what mesh.stage > 1 needs)
    scan_layers: bool = False
    zero_init_residual: bool = True  # ResNet: last BatchNorm scale of each block starts at 0
    init_std: float = 0.02  # ViT: std of the dense and position-embedding initialisers
    label_smoothing: float = 0.0  # share of the target spread evenly over all classes

    def __post_init__(self):
        if self.num_classes < 2:
            raise UserError(f"model.num_classes must be >= 2, got {self.num_classes}")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"model.label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass(frozen=True)
class CustomModelConfig:
    """A model of the user's own, given to `paisoar_jax.fit(model=...)`: it has no zoo keys."""

    name: str = "custom"
    factory: str = ""  # written by fit: the model factory's qualified name (for config.yaml)


# model.name -> the dataclass of the `model` section: each family has its own keys.
MODEL_CONFIGS: dict[str, type] = {
    "gpt": LanguageModelConfig,
    "llama": LanguageModelConfig,
    "resnet": VisionConfig,
    "vgg": VisionConfig,
    "vit": VisionConfig,
    "custom": CustomModelConfig,
}
