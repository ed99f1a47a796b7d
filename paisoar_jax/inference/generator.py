"""Batched generation from a run, a checkpoint step or an export: `paisoar_jax.Generator`.

    generator = paisoar_jax.Generator("runs/sft")           # a run, a step or an export
    answers = generator.complete(questions, max_new=32)     # texts (or chats) in, texts out
    tokens = generator.generate([[1, 2, 3], [4, 5]], max_new=8)

The model is placed as its config says (fsdp and tensor kept, data filling the devices
there are) and decodes with a key/value cache (models/decoding.py): prompts go in batches,
left-padded, one compiled loop per batch shape. Text is tokenized as transformers
tokenizes it (`Text`): the tokenizer.json beside the weights (an import's copy; a run
fine-tuned from an import finds it through checkpoint.init_from), or bytes for a
byte-level model. Generation stops after the model's end-of-sequence ids
(generation_config.json, config.json or the tokenizer's). `python -m paisoar_jax.generate`
is the command line over it (tools/generate.py).
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paisoar_jax.checkpointing.weights import (
    TOKEN_IDS_FILE,
    kept_file,
    load_weights,
    weights_source,
)
from paisoar_jax.config import LanguageModelConfig, MeshConfig, config_from_dict, to_dict
from paisoar_jax.config.mesh import DCN_NAMES
from paisoar_jax.data.tokenizing import end_of_text_id
from paisoar_jax.errors import UserError, one_line_errors
from paisoar_jax.inference.text import Text
from paisoar_jax.models.decoding import generate_rows, pick_token
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.parallel import sharding
from paisoar_jax.run.setup import setup
from paisoar_jax.runtime.platform import choose_platform
from paisoar_jax.runtime.user_files import open_tokenizer, read_json
from paisoar_jax.tasks.zoo import zoo_workload

PROMPT_BUCKET = 16  # batched prompts of several lengths are padded to a multiple of this


def weights_of(source: pathlib.Path):
    """(config, the directory that holds the weights, its tokenizer.json or None)."""
    config, path, _ = weights_source(source)
    return config, path, kept_file("tokenizer.json", config.checkpoint.init_from, path, source)


def placement(mesh: MeshConfig, count: int) -> list[str]:
    """Overrides that place the model on `count` devices as its config says, where it can.

    fsdp and tensor are kept when they divide the devices (data takes the rest; pipeline
    stages are not kept: decoding runs the stack whole); a run trained over more devices
    than there are here (or with -1) is placed whole on each.
    Decoding runs XLA's attention, so model.attention=cudnn becomes auto.
    """
    fsdp, tensor = mesh.fsdp, mesh.tensor
    if fsdp < 1 or tensor < 1 or count % (fsdp * tensor):
        fsdp, tensor = 1, 1
    overrides = [f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", "mesh.data=-1"]
    overrides += [f"mesh.{key}=1" for key in DCN_NAMES]  # one process
    overrides += ["model.attention=auto", "mesh.expert=1"]  # each device all the experts
    # Decoding does not pipeline: a pipelined run's stages are placed as FSDP is.
    overrides += ["mesh.stage=1", "train.pipeline_microbatches=0"]
    overrides += ["train.pipeline_repeats=1"]
    return [*overrides, f"train.global_batch={count}", "train.grad_accum=1"]


def end_of_sequence_ids(
    init_from: str, directories: Sequence[pathlib.Path], tokenizer_file: pathlib.Path | None
) -> tuple[int, ...]:
    """The ids generation stops at, as transformers finds them.

    generation_config.json's eos_token_id (an id or a list), else config.json's (the
    import's hf_token_ids.json), both looked for in `directories` (and beside the import a
    run started from), else the tokenizer's end-of-text token. None for a byte-level model.
    """
    for name in ("generation_config.json", TOKEN_IDS_FILE):
        found = kept_file(name, init_from, *directories)
        value = read_json(found).get("eos_token_id") if found else None
        if value is not None:
            return tuple(value) if isinstance(value, list) else (int(value),)
    try:
        import tokenizers  # noqa: F401 (here only: is it installed?)
    except ImportError:  # then --prompt is refused anyway; --tokens runs to --max-new
        return ()
    if tokenizer_file is None:
        return ()
    model = open_tokenizer(tokenizer_file)
    end = end_of_text_id(model, tokenizer_file.parent)
    return () if end is None else (end,)


class Generator:
    """A decoder's weights on the devices, generating for many prompts at once.

    `complete` takes texts (or chats) and gives texts; `generate` takes and gives token ids.
    Prompts go in batches of up to `batch_size` rows (the longest prompts together), each
    left-padded to its longest with the padding masked, decoded with a key/value cache in
    one compiled loop that stops once every row has ended. One compile per batch shape
    (rows, prompt length, max_new and the sampling settings), kept for the next call.

    Args:
        source: a run directory (its newest checkpoint), a checkpoint step or an export of
            a zoo decoder (gpt, llama; an hf-import's too).
        devices: the devices to place the weights on; None: every device jax sees, the
            weights split as the run's config says (fsdp and tensor kept).

    Example:
        ```python
        import paisoar_jax

        generator = paisoar_jax.Generator("runs/tiny")  # a run, a checkpoint step or an export
        print(generator.complete(["def "], max_new=16))  # text in, text out
        print(generator.generate([[100, 101, 102]], max_new=4))  # token ids in, ids out
        ```

    """

    @one_line_errors("paisoar_jax.Generator")
    def __init__(self, source: str | pathlib.Path, devices: Sequence[jax.Device] | None = None):
        choose_platform()  # before jax starts its backends (runtime/platform.py)
        source = pathlib.Path(source)
        config, path, self.tokenizer_file = weights_of(source)
        if not isinstance(config.model, LanguageModelConfig):
            raise UserError(f"{source}: model.name={config.model.name} does not generate text")
        devices = devices or jax.devices()
        self.config = config_from_dict(to_dict(config), placement(config.mesh, len(devices)))
        run = setup(self.config, zoo_workload(self.config), devices)
        self.mesh, self.layout = run.mesh, run.layout
        self.rows = sharding.batch_shards(self.mesh)  # rows come in multiples of this
        with jax.set_mesh(self.mesh):
            self.params, model_state = load_weights(path, self.layout.abstract_state)
        self.model_state = model_state or {}
        self.end_ids = end_of_sequence_ids(
            config.checkpoint.init_from, (path, source), self.tokenizer_file
        )
        self._text: Text | None = None
        self._compiled: dict[tuple, Callable] = {}
        self._scorer: Callable | None = None

    @classmethod
    def of_run(cls, run: Any, state: Any) -> Generator:
        """A Generator over a training run's weights as they are, placed as the run's.

        `run`: the run's Setup; `state`: its TrainState (read, never changed). The
        tokenizer and end ids are the run's (found as for its saved steps).
        """
        generator = cls.__new__(cls)
        generator.config = config = config_from_dict(run.record)
        generator.mesh, generator.layout = run.mesh, run.layout
        generator.rows = sharding.batch_shards(run.mesh)
        generator.params, generator.model_state = state.params, state.model_state or {}
        init_from, places = config.checkpoint.init_from, (pathlib.Path(run.run_dir),)
        generator.tokenizer_file = kept_file("tokenizer.json", init_from, *places)
        generator.end_ids = end_of_sequence_ids(init_from, places, generator.tokenizer_file)
        generator._text, generator._compiled, generator._scorer = None, {}, None
        return generator

    @one_line_errors("paisoar_jax.Generator")
    def complete(
        self, prompts: Sequence[str | list[dict]], max_new: int = 64, **settings: Any
    ) -> list[str]:
        """The text each prompt continues with, up to its end-of-sequence token (left out).

        A prompt is text (tokenized as transformers' `tokenizer(text)`, with the tokenizer's
        own markers: Llama's BOS, once) or a chat, a list of {role, content} messages (its
        tokens are `apply_chat_template(chat, add_generation_prompt=True, tokenize=True)`'s).

        Args:
            prompts: texts, or chats (lists of {"role", "content"} messages).
            max_new: the most tokens each continues with.
            **settings: `generate`'s keywords (greedy, temperature, top_k, top_p, seed,
                stop_at, batch_size); stop_at defaults to the model's end-of-sequence ids.

        Returns:
            Each prompt's continuation as text, its end-of-sequence token left out.
        """
        if self._text is None:
            self._text = Text(self.tokenizer_file, self.config.model.vocab_size)
        settings.setdefault("stop_at", self.end_ids)
        encoded = [
            self._text.encode(prompt) if isinstance(prompt, str) else self._text.encode_chat(prompt)
            for prompt in prompts
        ]
        continued = self.generate(encoded, max_new, **settings)
        stops = set(settings["stop_at"])
        return [
            self._text.decode(new[:-1] if new and new[-1] in stops else new) for new in continued
        ]

    @one_line_errors("paisoar_jax.Generator")
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: int = 64,
        *,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at: Sequence[int] = (),
        batch_size: int = 64,
    ) -> list[list[int]]:
        """The token ids that follow each prompt: `max_new` of them, or fewer.

        Fewer when one of `stop_at` (end-of-sequence ids) comes first: it ends the list, as
        in transformers' generate. Sampling (greedy=False) draws from `temperature`, the
        `top_k` likeliest and the `top_p` nucleus; a prompt's draws depend on its batch.

        Args:
            prompts: each prompt's token ids.
            max_new: the most tokens each prompt continues with.
            greedy: the likeliest token each time; False samples.
            temperature: the logits divided by it before sampling (0: greedy).
            top_k: sample among the k likeliest tokens only (0: all).
            top_p: sample from the smallest set of tokens holding this probability.
            seed: the sampling's random seed.
            stop_at: token ids that end a row (included in its list).
            batch_size: the most prompts decoded together.

        Returns:
            The new token ids of each prompt.
        """
        prompts = [list(map(int, prompt)) for prompt in prompts]
        if not prompts:
            return []
        for prompt in prompts:
            self._check(prompt, max_new, top_k)
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or batch_size < 1:
            raise UserError(
                "temperature must be >= 0, top_k >= 0, top_p in (0, 1] and batch_size >= 1"
            )
        sampling = (greedy or temperature == 0, temperature, top_k, top_p)
        decode = self._decoder(sampling, tuple(stop_at), max_new)
        # The longest prompts together: the least padding. Rows: a multiple of the shards.
        order = sorted(range(len(prompts)), key=lambda index: -len(prompts[index]))
        rows = -(-min(batch_size, len(prompts)) // self.rows) * self.rows
        results: list[list[int]] = [[] for _ in prompts]
        key = jax.random.key(seed)
        with jax.set_mesh(self.mesh):
            for first in range(0, len(order), rows):
                chosen = order[first : first + rows]
                tokens_RxP, starts_R = _left_padded([prompts[index] for index in chosen], rows)
                placed = jax.device_put((tokens_RxP, starts_R), sharding.batch_sharding(self.mesh))
                new_RxN, made = jax.device_get(
                    decode(self.params, self.model_state, *placed, jax.random.fold_in(key, first))
                )
                for row, index in enumerate(chosen):
                    results[index] = _until_stop(new_RxN[row, :made].tolist(), stop_at)
        return results

    @one_line_errors("paisoar_jax.Generator")
    def score(
        self, sequences: Sequence[Sequence[int]], batch_size: int = 64
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each token's log-probability given the ones before it, and whether it was likeliest.

        For a sequence of n tokens: two arrays of n - 1, for tokens 1 .. n - 1 (fp32
        log-probabilities from fp32 logits, and the greedy flags), as a causal model scores
        them in one forward pass. Sequences go in batches of up to `batch_size` rows, the
        longest together, right-padded to a multiple of 16 tokens.

        Args:
            sequences: token ids, 2 to model.max_positions + 1 of each.
            batch_size: the most sequences scored together.
        """
        sequences = [list(map(int, sequence)) for sequence in sequences]
        for sequence in sequences:
            if not 2 <= len(sequence) <= self.config.model.positions + 1:
                raise UserError(
                    f"a scored sequence needs 2 to {self.config.model.positions + 1} tokens, "
                    f"got {len(sequence)}"
                )
        if self._scorer is None:
            self._scorer = jax.jit(functools.partial(score_rows, graphdef=self.layout.graphdef))
        order = sorted(range(len(sequences)), key=lambda index: -len(sequences[index]))
        rows = -(-min(batch_size, max(len(sequences), 1)) // self.rows) * self.rows
        results: list[Any] = [None] * len(sequences)
        with jax.set_mesh(self.mesh):
            for first in range(0, len(order), rows):
                chosen = order[first : first + rows]
                width = -(-len(sequences[chosen[0]]) // PROMPT_BUCKET) * PROMPT_BUCKET
                width = min(width, self.config.model.positions + 1)  # (learned positions)
                tokens_RxL = np.zeros((rows, width), np.int32)
                for row, index in enumerate(chosen):
                    tokens_RxL[row, : len(sequences[index])] = sequences[index]
                placed = jax.device_put(tokens_RxL, sharding.batch_sharding(self.mesh))
                log_probs, greedy = jax.device_get(
                    self._scorer(self.params, self.model_state, placed)
                )
                for row, index in enumerate(chosen):
                    length = len(sequences[index]) - 1
                    results[index] = (log_probs[row, :length], greedy[row, :length])
        return results

    def _decoder(self, sampling: tuple, stop_at: tuple, max_new: int) -> Callable:
        """The jitted generation loop for these settings (jit keeps a compile per shape)."""
        settings = (sampling, stop_at, max_new)
        if settings not in self._compiled:
            greedy, temperature, top_k, top_p = sampling
            pick = functools.partial(
                pick_token, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p
            )
            self._compiled[settings] = jax.jit(
                functools.partial(
                    generate_rows,
                    graphdef=self.layout.graphdef,
                    model_config=self.config.model,
                    dtype=get_policy(self.config.precision.policy).compute_dtype,
                    pick=pick,
                    stop_at=stop_at,
                    max_new=max_new,
                )
            )
        return self._compiled[settings]

    def _check(self, prompt: list[int], max_new: int, top_k: int) -> None:
        model = self.config.model
        if not prompt:
            raise UserError("the prompt is empty: give --prompt TEXT or --tokens 1,2,3")
        if max_new < 1:
            raise UserError(f"--max-new must be at least 1, got {max_new}")
        bad = [token for token in prompt if not 0 <= token < model.vocab_size]
        if bad:
            vocabulary = f"0..{model.vocab_size - 1}"
            raise UserError(f"token {bad[0]} is outside the vocabulary ({vocabulary})")
        if len(prompt) > model.positions:
            raise UserError(
                f"the prompt has {len(prompt)} tokens, more than the model's {model.positions} "
                f"positions (model.max_positions): shorten it, or --truncate-prompt keeps its "
                f"last {model.positions}"
            )
        # The last new token is never fed back: the positions used are prompt + new - 1.
        if model.position == "learned" and len(prompt) + max_new - 1 > model.positions:
            raise UserError(
                f"{len(prompt)} prompt + {max_new} new tokens need {len(prompt) + max_new - 1} "
                f"positions, more than the model's {model.positions} learned ones "
                f"(model.max_positions)"
            )
        if top_k > model.vocab_size:
            raise UserError(f"--top-k {top_k} is more than the vocabulary's {model.vocab_size}")


def score_rows(params, model_state, tokens_RxL: jax.Array, graphdef) -> tuple:
    """(log-probabilities, likeliest?) of tokens 1.. of each row, (R, L - 1) each."""
    model = nnx.merge(graphdef, params, model_state)
    logits_RxLxV = model(tokens_RxL[:, :-1]).astype(jnp.float32)
    targets_RxL = tokens_RxL[:, 1:]
    log_probs_RxLxV = jax.nn.log_softmax(logits_RxLxV)
    taken_RxL = jnp.take_along_axis(log_probs_RxLxV, targets_RxL[..., None], axis=-1)[..., 0]
    return taken_RxL, logits_RxLxV.argmax(axis=-1) == targets_RxL


def _left_padded(prompts: list[list[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens R x P, each row's padding): prompts right-aligned at P, rows filled to R.

    P is the longest prompt's length, rounded up to a multiple of PROMPT_BUCKET when they
    differ (fewer shapes to compile); filler rows repeat the first prompt.
    """
    longest = max(map(len, prompts))
    same = all(len(prompt) == longest for prompt in prompts)
    length = longest if same else -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    filled = prompts + [prompts[0]] * (rows - len(prompts))
    tokens_RxP = np.zeros((rows, length), np.int32)
    starts_R = np.array([length - len(prompt) for prompt in filled], np.int32)
    for row, prompt in enumerate(filled):
        tokens_RxP[row, starts_R[row] :] = prompt
    return tokens_RxP, starts_R


def _until_stop(tokens: list[int], stop_at: Sequence[int]) -> list[int]:
    """`tokens` up to and with the first of `stop_at`."""
    for position, token in enumerate(tokens):
        if token in stop_at:
            return tokens[: position + 1]
    return tokens
