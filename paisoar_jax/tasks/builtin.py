"""What a model learns from its batches: next-token prediction or image classification.

A task holds everything that differs between the two, so that the step, the loop, `bench`
and `plan` stay one code path: the sources and host pipeline, the shape of a batch, the loss
and its metrics, what eval reports, the throughput unit (tokens or examples) and its FLOPs.

    task                 batch (per process, from grain)                      unit
    LanguageModelling    int32 tokens (B, seq_len + 1), or with data.packing  tokens
                         or data.loss_on set, {"tokens", "loss_mask",
                         ["segments", "positions"]} (data/documents.py)
    ImageClassification  {"image": uint8 (B, size, size, C), "label": int32}  examples

Images reach the device as uint8 and are normalised there, inside the jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paisoar_jax import output
from paisoar_jax.config import DataConfig, LanguageModelConfig, TrainConfig, VisionConfig
from paisoar_jax.data import hf_sources, mixture
from paisoar_jax.data import images as image_data
from paisoar_jax.data.pipeline import GlobalBatches, batch_dataset
from paisoar_jax.data.preferences import PreferenceWindows
from paisoar_jax.data.small_images import SYNTHETIC_EVAL_LENGTH, SyntheticImages, open_digits
from paisoar_jax.data.sources import open_source
from paisoar_jax.engine.evaluation import EvalSet, HarnessTasks, check_harness
from paisoar_jax.errors import UserError
from paisoar_jax.models import moe, mtp, resolve_model_config
from paisoar_jax.models.chunked_loss import chunk_count, chunked_cross_entropy
from paisoar_jax.models.gpt import output_head, output_logits
from paisoar_jax.numerics.precision import float32_island, get_policy
from paisoar_jax.parallel.context import balanced_order
from paisoar_jax.parallel.sharding import context_shards
from paisoar_jax.tasks.sample import generate

SAMPLE_PROMPT = b"def "  # the embedded corpus is Python source


@dataclasses.dataclass(frozen=True)
class TaskSections:
    """What a zoo model's task reads of the config (zoo.zoo_workload hands it over)."""

    model: LanguageModelConfig | VisionConfig
    data: DataConfig  # the sources, their eval split and the augmentations
    train: TrainConfig  # the seed and train.eval_every
    precision_policy: str  # precision.policy: the dtype images are fed in


class LanguageModelling:
    """Next-token prediction on windows of seq_len + 1 tokens (inputs first T, targets last T)."""

    unit = "tokens"
    rate_name = "tok_s"
    unit_of_data = "windows"  # what a source holds: windows of seq_len + 1 tokens
    reports_perplexity = True  # eval adds exp(eval_loss), the perplexity per token
    config_note = ""  # nothing atop config.yaml: it says all that made the run
    metric_names: tuple[str, ...] = ()  # the fp32 scalars `loss` returns beside the loss
    reads_pairs = False  # preference pairs (convert --format preference): tasks/preference.py

    def __init__(self, sections: TaskSections, model_class: type):
        self.model_config, self.data, self.train = sections.model, sections.data, sections.train
        self.precision_policy = sections.precision_policy
        self.model_class = model_class  # its static flops_per_token gives MFU
        if getattr(self.model_config, "experts", 0):  # a mixture of experts: router metrics
            self.metric_names = moe.metric_names(self.model_config)
        if getattr(self.model_config, "mtp_depth", 0):  # multi-token prediction's losses
            self.metric_names += mtp.metric_names(self.model_config)

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The train windows and the eval sets (evaluation.EvalSet).

        Train: data.source's or data.mixture's. Eval: the held-out windows or
        data.eval_source's, then each of data.eval_sets. hf:<path> sources are tokenized
        first, once, into their cache (data/hf_sources.py).
        """
        data, model, seed = self.data, self.model_config, self.train.seed
        hf_sources.prepare(self.data)
        train, held_out = (
            mixture.open_mixture(data.train_side(), lambda one: open_source(one, model, seed))
            if data.mixture
            else open_source(data.train_side(), model, seed)
        )
        eval_every = self.train.eval_every
        default = held_out
        if data.eval_source:
            default = self._open_eval("data.eval_source", data.eval_source)
        sets = [EvalSet(default, eval_every)]
        for entry in data.eval_sets:
            source = self._open_eval(f"data.eval_sets[{entry.name}]", entry.source, entry.hf_split)
            sets.append(EvalSet(source, entry.every or eval_every, entry.name))
        if self.train.harness_every:  # lm-eval's tasks, on the eval cadence's machinery
            harness = HarnessTasks(
                self.train.harness_tasks,
                self.train.harness_limit,
                self.train.harness_include_path,
            )
            check_harness(harness)
            sets.append(EvalSet(harness, self.train.harness_every, "harness"))
        if isinstance(train, PreferenceWindows) and not self.reads_pairs:
            raise UserError(
                f"data.source={data.source} holds preference pairs: train on them with "
                f"train.objective=dpo"
            )
        return train, tuple(sets)

    def _open_eval(self, key: str, source: str, hf_split: str = "") -> Any:
        """The windows of one eval set's source: all of a converted set, else its eval split."""
        side = self.data.eval_side(source, hf_split)
        try:
            train, held_out = open_source(side, self.model_config, self.train.seed)
        except UserError as error:
            # Opened as a data.source would be; said of the key that named it.
            text, opened_as = str(error), f"data.source={source}"
            if text.startswith(opened_as):
                raise UserError(f"{key}={source}{text.removeprefix(opened_as)}") from None
            raise UserError(f"{key}: {text}") from None
        return train if side.eval_fraction == 0 else held_out

    def host_batches(
        self, source, *, global_batch: int, seed: int, train: bool, workers: int = 0
    ) -> GlobalBatches:
        """The rows of global batches of one source this process reads (train: shuffled)."""
        data = self.data
        specs = [entry.source for entry in data.mixture] or [data.source]
        # files are read by grain's threads; in-memory windows on the prefetch thread alone
        in_memory = not any(spec.startswith(("arrayrecord:", "hf:")) for spec in specs)
        if isinstance(source, mixture.Mixture):
            return mixture.MixtureBatches(
                source,
                data,
                global_batch=global_batch,
                seed=seed,
                workers=workers,
                in_memory=in_memory,
            )
        return batch_dataset(
            source,
            global_batch=global_batch,
            seed=seed,
            shuffle=train,
            workers=workers,
            in_memory=in_memory,
        )

    def batch_shape(self, global_batch: int) -> jax.ShapeDtypeStruct | dict:
        """The shape and dtype of one global batch (a dict for masked or packed documents)."""
        T, data = self.model_config.seq_len, self.data
        tokens = jax.ShapeDtypeStruct((global_batch, T + 1), jnp.int32)
        if data.packing == "stream" and data.loss_on == "all":
            return tokens
        shape = {"tokens": tokens, "loss_mask": jax.ShapeDtypeStruct((global_batch, T), bool)}
        if data.packing == "documents":
            for name in ("segments", "positions"):
                shape[name] = jax.ShapeDtypeStruct((global_batch, T), jnp.int32)
        return shape

    def units_per_example(self) -> int:
        """Tokens per sequence."""
        return self.model_config.seq_len

    def flops_per_unit(self, param_count: int) -> float:
        """Training FLOPs per token (6 N plus attention)."""
        return self.model_class.flops_per_token(self.model_config, param_count)

    def loss(self, model, batch, key: jax.Array) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (fp32) over the learned targets, and its metrics.

        A mixture of experts adds its router's weighted balance and z-losses
        (moe.auxiliary_loss) and reports them, with the experts' load and drops, as metrics.
        Multi-token prediction (model.mtp_depth) adds model.mtp_loss x its modules' mean
        loss and reports each module's as mtp_loss/k.
        """
        del key  # no randomness (no dropout)
        losses_BxT, learned_BxT, statistics, depths = token_losses(model, batch, depths=True)
        loss = _mean(losses_BxT, learned_BxT)
        metrics = {}
        if depths:
            depth_losses = [_mean(losses, learned) for losses, learned in depths]
            loss = loss + self.model_config.mtp_loss * sum(depth_losses) / len(depth_losses)
            metrics = dict(zip(mtp.metric_names(self.model_config), depth_losses, strict=True))
        if not statistics:
            return loss, metrics
        router_loss = moe.auxiliary_loss(statistics, self.model_config)
        return loss + router_loss, moe.metrics_of(statistics, self.model_config) | metrics

    def loss_weight(self, batch) -> jax.Array | None:
        """The learned targets of a masked batch (the step weighs micro-batches by it)."""
        return batch["loss_mask"].sum(dtype=jnp.float32) if isinstance(batch, dict) else None

    def eval_rows(self, model, batch) -> dict[str, jax.Array]:
        """{"loss", "weight"} per held-out sequence: its mean loss and its learned targets.

        The eval step weighs each row by its "weight", so eval_loss is the mean per learned
        token (what perplexity is of), however the targets spread over the rows.
        """
        losses_BxT, learned_BxT, _, _ = token_losses(model, batch)
        weight_B = learned_BxT.sum(axis=1)
        loss_B = jnp.sum(losses_BxT * learned_BxT, axis=1) / jnp.maximum(weight_B, 1)
        return {"loss": loss_B, "weight": weight_B}

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""
        data = self.data
        signature = {"seq_len": self.model_config.seq_len}
        if data.packing != "stream" or data.loss_on != "all":  # kept out of older ones
            signature |= {"packing": data.packing, "loss_on": data.loss_on}
        return signature

    def prepare(self, layout, global_batch: int) -> None:
        """Nothing to check: the zoo's model and loss are known."""

    def closing_sample(self, layout, state, mesh) -> str | None:
        """train.sample_bytes bytes after a prompt, for the embedded (byte-level) text."""
        train = self.train
        data = self.data
        if not train.sample_bytes or data.source != "embedded" or data.mixture:
            return None
        text = generate(
            layout,
            state.params,
            state.model_state,
            mesh,
            SAMPLE_PROMPT,
            train.sample_bytes,
            self.model_config,
            get_policy(self.precision_policy).compute_dtype,
            seed=train.seed,
        )
        return output.printable(text.decode("utf-8", errors="replace"))


class ImageClassification:
    """Softmax classification of images: label smoothing, optional mixup, accuracy."""

    unit = "examples"
    rate_name = "img_s"
    unit_of_data = "images"
    metric_names = ("accuracy",)
    reports_perplexity = False
    config_note = ""

    def __init__(self, sections: TaskSections, model_class: type):
        self.data, self.train = sections.data, sections.train
        self.model_class = model_class  # its static flops_per_example gives MFU
        self.model_config = resolve_model_config(sections.model)
        self.mean, self.std = image_data.channel_statistics(self.model_config.channels)
        self.compute_dtype = get_policy(sections.precision_policy).compute_dtype

    def open_sources(self) -> tuple[Any, tuple[EvalSet, ...]]:
        """The train images and the eval set, of images:<dir>, digits or synthetic images."""
        data, model = self.data, self.model_config
        if data.source.startswith("images:"):
            train, held_out, _ = image_data.open_image_source(data.source, data.eval_fraction)
            if jax.process_index() == 0:
                image_data.warn_of_skipped_files(train, held_out)
        elif data.source == "digits":
            train, held_out = open_digits(data.eval_fraction)
        elif data.source == "synthetic":
            shape = (model.image_size, model.channels, model.num_classes)
            seed = self.train.seed
            train = SyntheticImages(*shape, seed)
            held_out = SyntheticImages(*shape, seed + 1, length=SYNTHETIC_EVAL_LENGTH)
        else:
            raise UserError(
                f"data.source={data.source!r}: model.name={model.name} reads images: use "
                f"images:<dir>, digits or synthetic"
            )
        if len(train.classes) > model.num_classes:  # labels past the head would train nothing
            raise UserError(
                f"data.source={data.source} has {len(train.classes)} classes, more than "
                f"model.num_classes={model.num_classes}"
            )
        return train, (EvalSet(held_out, self.train.eval_every),)

    def host_batches(
        self, source, *, global_batch: int, seed: int, train: bool, workers: int = 0
    ) -> GlobalBatches:
        """The uint8 batches this process reads: decoded, augmented (train) or centre-cropped."""
        return image_data.image_batches(
            source,
            global_batch=global_batch,
            seed=seed,
            image_size=self.model_config.image_size,
            train=train,
            channels=self.model_config.channels,
            workers=workers,
            min_crop_scale=self.data.min_crop_scale,
        )

    def batch_shape(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes and dtypes of one global batch."""
        size, channels = self.model_config.image_size, self.model_config.channels
        return {
            "image": jax.ShapeDtypeStruct((global_batch, size, size, channels), jnp.uint8),
            "label": jax.ShapeDtypeStruct((global_batch,), jnp.int32),
        }

    def units_per_example(self) -> int:
        """One example per image."""
        return 1

    def flops_per_unit(self, param_count: int) -> float:
        """Training FLOPs per image (3 x the forward multiply-adds x 2)."""
        return self.model_class.flops_per_example(self.model_config, param_count)

    def loss(self, model, batch: dict, key: jax.Array) -> tuple[jax.Array, dict]:
        """Cross-entropy against smoothed (and mixed) targets; accuracy on the true labels."""
        num_classes = self.model_config.num_classes
        images = image_data.normalize_on_device(
            batch["image"], self.mean, self.std, self.compute_dtype
        )
        targets_BxN = image_data.label_smoothing_targets(
            batch["label"], num_classes, self.model_config.label_smoothing
        )
        images, targets_BxN = image_data.mixup(images, targets_BxN, key, self.data.mixup_alpha)
        logits_BxN = model(images, train=True)
        loss = optax.softmax_cross_entropy(logits_BxN, targets_BxN).mean()
        return loss, {"accuracy": _accuracy(logits_BxN, batch["label"])}

    def loss_weight(self, batch) -> None:
        """None: the loss is a mean over the batch's rows, a count that does not vary."""
        return None

    def eval_rows(self, model, batch: dict) -> dict[str, jax.Array]:
        """{"loss", "accuracy"} per image (B,), on running BatchNorm statistics, hard labels."""
        images = image_data.normalize_on_device(
            batch["image"], self.mean, self.std, self.compute_dtype
        )
        logits_BxN = float32_island(model(images, train=False))
        losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxN, batch["label"])
        correct_B = (logits_BxN.argmax(axis=-1) == batch["label"]).astype(jnp.float32)
        return {"loss": losses_B, "accuracy": correct_B}

    def signature(self) -> dict[str, Any]:
        """The input settings a saved data position depends on."""
        return {"image_size": self.model_config.image_size, "channels": self.model_config.channels}

    def prepare(self, layout, global_batch: int) -> None:
        """Nothing to check: the zoo's model and loss are known."""

    def closing_sample(self, layout, state, mesh) -> None:
        """An image classifier has no sample to show."""
        return None


def _mean(losses_BxT: jax.Array, learned_BxT: jax.Array) -> jax.Array:
    """The mean loss over the learned targets."""
    return jnp.sum(losses_BxT * learned_BxT) / jnp.maximum(learned_BxT.sum(), 1)


def token_losses(model, batch, depths: bool = False) -> tuple:
    """(B, T) fp32 next-token cross-entropies, their weights, the router statistics, depths.

    The windows hold T + 1 tokens. The weights are 1 for a learned target, 0 for one the
    loss skips (data/documents.py). The statistics are a mixture of experts' ({} for a
    dense model). `depths` (training) with model.mtp_depth: each multi-token prediction
    module's (losses, weights) of the token k + 1 ahead (models/mtp.py); else none.
    """
    tokens_BxT1 = batch["tokens"] if isinstance(batch, dict) else batch
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    masked = isinstance(batch, dict)
    learned_BxT = batch["loss_mask"].astype(jnp.float32) if masked else jnp.ones(inputs_BxT.shape)
    documents = {}
    if masked and "segments" in batch:
        documents = {"segments_BxT": batch["segments"], "positions_BxT": batch["positions"]}
    shards = context_shards()
    if shards > 1 and model.config.context_balance:
        # Each context device gets a chunk from the front and one from the back of every
        # sequence (equal causal work); the tokens keep their positions, and the loss is a
        # sum over tokens, so the order changes nothing else.
        order_T = balanced_order(inputs_BxT.shape[1], shards)
        documents.setdefault(
            "positions_BxT", jnp.broadcast_to(np.arange(len(order_T)), inputs_BxT.shape)
        )
        inputs_BxT, targets_BxT, learned_BxT = (
            x[:, order_T] for x in (inputs_BxT, targets_BxT, learned_BxT)
        )
        documents = {name: x[:, order_T] for name, x in documents.items()}
    chunks = chunk_count(model.config.loss_chunks, model.config.vocab_size)
    if depths and getattr(model.config, "mtp_depth", 0):
        streams, statistics = model.depth_streams_and_statistics(inputs_BxT, **documents)
        losses_BxT = _stream_losses(model, streams[0], targets_BxT, chunks)
        depth_pairs = []
        for k, h_BxTxD in enumerate(streams[1:], start=1):  # module k: the token k + 1 ahead
            segments_BxT = documents.get("segments_BxT")
            ahead_BxT, weights_BxT = mtp.targets_ahead(targets_BxT, learned_BxT, segments_BxT, k)
            depth_pairs.append((_stream_losses(model, h_BxTxD, ahead_BxT, chunks), weights_BxT))
        return losses_BxT, learned_BxT, statistics, depth_pairs
    if chunks:  # a vocabulary slice at a time: no B x T x V logits (models/chunked_loss.py)
        h_BxTxD, statistics = model.stream_and_statistics(inputs_BxT, **documents)
        return _stream_losses(model, h_BxTxD, targets_BxT, chunks), learned_BxT, statistics, []
    # Upcast here (fused into the loss): bf16 logits (model.fp32_logits=false) are never
    # normalised in bf16.
    logits_BxTxV, statistics = model.logits_and_statistics(inputs_BxT, **documents)
    logits_BxTxV = float32_island(logits_BxTxV)
    losses_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
    return losses_BxT, learned_BxT, statistics, []


def _stream_losses(model, h_BxTxD: jax.Array, targets_BxT: jax.Array, chunks: int) -> jax.Array:
    """(B, T) fp32 cross-entropies of the head over a final-normed stream."""
    if chunks:  # a vocabulary slice at a time: no B x T x V logits (models/chunked_loss.py)
        return chunked_cross_entropy(
            h_BxTxD, output_head(model), targets_BxT, chunks, model.config.fp32_logits
        )
    logits_BxTxV = float32_island(output_logits(model, h_BxTxD))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)


def _accuracy(logits_BxN: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Share of the batch whose top class is the label."""
    return (logits_BxN.argmax(axis=-1) == labels_B).mean(dtype=jnp.float32)
