"""`python -m paisoar_jax.generate SOURCE (--prompt TEXT | --tokens 1,2,3)`: continue a prompt.

SOURCE is a run directory (its newest checkpoint), a checkpoint step directory
(`runs/x/checkpoints/400`) or a params export (what `export` and `convert hf-import`
write). The model is placed as its config says (fsdp and tensor kept, data filling the
devices there are) and decodes with a key/value cache (models/decoding.py): one compile for
the prompt, one for every next token. `--greedy` (or `--temperature 0`) takes the likeliest
token; otherwise tokens are sampled at `--temperature`, from the `--top-k` likeliest and the
`--top-p` nucleus when given (transformers' warpers, in their order). Generation stops after
the model's end-of-sequence token (generation_config.json, config.json or the tokenizer's),
unless `--ignore-eos`; a prompt longer than the model's positions is refused, or cut to its
last positions with `--truncate-prompt`.

`--prompt` needs a tokenizer: the tokenizer.json beside the weights (`hf-import` copies the
model's own; a run fine-tuned from an import finds it through checkpoint.init_from), or
bytes for a byte-level model (vocab 256, the embedded corpus). `--json` prints one line
{"tokens": [...]} of the new ids; otherwise the prompt and its continuation as text.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paisoar_jax import output
from paisoar_jax.checkpoint import load_weights
from paisoar_jax.config import LanguageModelConfig, config_from_dict, to_dict
from paisoar_jax.errors import UserError
from paisoar_jax.models.decoding import empty_cache
from paisoar_jax.parallel import sharding
from paisoar_jax.precision import get_policy
from paisoar_jax.tools.cli import exit_status
from paisoar_jax.tools.convert import end_of_text_id
from paisoar_jax.tools.export import weights_source
from paisoar_jax.tools.hf import TOKEN_IDS_FILE, kept_file
from paisoar_jax.workload import setup
from paisoar_jax.zoo import zoo_workload

PROGRAM = "paisoar_jax.generate"


def weights_of(source: pathlib.Path):
    """(config, the directory that holds the weights, its tokenizer.json or None)."""
    config, path, _ = weights_source(source)
    return config, path, kept_file("tokenizer.json", config, path, source)


def placement(config, count: int) -> list[str]:
    """Overrides that place the model on `count` devices as its config says, where it can.

    fsdp and tensor are kept when they divide the devices (data takes the rest; pipeline
    stages are not kept: decoding runs the stack whole); a run trained over more devices
    than there are here (or with -1) is placed whole on each.
    Decoding runs XLA's attention, so model.attention=cudnn becomes auto.
    """
    fsdp, tensor = config.mesh.fsdp, config.mesh.tensor
    if fsdp < 1 or tensor < 1 or count % (fsdp * tensor):
        fsdp, tensor = 1, 1
    overrides = [f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", "mesh.data=-1"]
    overrides += ["mesh.dcn_data=1", "mesh.dcn_fsdp=1", "model.attention=auto"]
    overrides += ["mesh.expert=1", "mesh.dcn_expert=1"]  # each device all the experts
    # Decoding does not pipeline: a pipelined run's stages are placed as FSDP is.
    overrides += ["mesh.stage=1", "mesh.dcn_stage=1", "train.pipeline_microbatches=0"]
    overrides += ["train.pipeline_repeats=1"]
    return [*overrides, f"train.global_batch={count}", "train.grad_accum=1"]


def end_of_sequence_ids(
    config, directories: Sequence[pathlib.Path], tokenizer_file: pathlib.Path | None
) -> tuple[int, ...]:
    """The ids generation stops at, as transformers finds them.

    generation_config.json's eos_token_id (an id or a list), else config.json's (the
    import's hf_token_ids.json), both looked for in `directories` (and beside the import a
    run started from), else the tokenizer's end-of-text token. None for a byte-level model.
    """
    for name in ("generation_config.json", TOKEN_IDS_FILE):
        found = kept_file(name, config, *directories)
        value = json.loads(found.read_text()).get("eos_token_id") if found else None
        if value is not None:
            return tuple(value) if isinstance(value, list) else (int(value),)
    try:
        import tokenizers
    except ImportError:  # then --prompt is refused anyway; --tokens runs to --max-new
        return ()
    if tokenizer_file is None:
        return ()
    model = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    end = end_of_text_id(model, tokenizer_file.parent)
    return () if end is None else (end,)


class Model:
    """A decoder's weights on the devices, with its jitted prefill and next-token steps."""

    def __init__(self, source: pathlib.Path, devices=None):

        config, path, self.tokenizer_file = weights_of(source)
        if not isinstance(config.model, LanguageModelConfig):
            raise UserError(f"{source}: model.name={config.model.name} does not generate text")
        devices = devices or jax.devices()
        self.config = config_from_dict(to_dict(config), placement(config, len(devices)))
        run = setup(self.config, zoo_workload(self.config), devices)
        self.mesh, self.layout = run.mesh, run.layout
        self.rows = sharding.batch_shards(self.mesh)  # one row per batch shard, as in training
        with jax.set_mesh(self.mesh):
            self.params, model_state = load_weights(path, self.layout.abstract_state)
        self.model_state = model_state or {}
        self.end_ids = end_of_sequence_ids(config, (path, source), self.tokenizer_file)

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        *,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at: Sequence[int] = (),
    ) -> list[int]:
        """The token ids that follow `prompt`: `max_new` of them, or fewer.

        Fewer when one of `stop_at` (end-of-sequence ids) comes first: it ends the list, as
        in transformers' generate.
        """
        model_config = self.config.model
        self._check(prompt, max_new, top_k)
        length = len(prompt) + max_new
        dtype = get_policy(self.config.precision.policy).compute_dtype  # the keys' dtype
        sampling = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
        pick = functools.partial(_pick, **sampling)
        graphdef = self.layout.graphdef

        @jax.jit
        def prefill(params, model_state, tokens_RxP, key):
            model = nnx.merge(graphdef, params, model_state)
            cache = empty_cache(model_config, tokens_RxP.shape[0], length, dtype)
            logits_RxPxV, cache = model.decode(tokens_RxP, cache, 0)
            return pick(logits_RxPxV[:, -1], key), cache

        @functools.partial(jax.jit, donate_argnums=(2,))
        def next_token(params, model_state, cache, token_R, index, key):
            model = nnx.merge(graphdef, params, model_state)
            logits_Rx1xV, cache = model.decode(token_R[:, None], cache, index)
            return pick(logits_Rx1xV[:, -1], key), cache

        keys = jax.random.split(jax.random.key(seed), max_new)
        tokens_RxP = np.tile(np.asarray(prompt, np.int32), (self.rows, 1))
        with jax.set_mesh(self.mesh):
            batch = jax.device_put(tokens_RxP, sharding.batch_sharding(self.mesh))
            token_R, cache = prefill(self.params, self.model_state, batch, keys[0])
            new = [int(np.asarray(token_R)[0])]  # read each: it may be the end
            for step in range(1, max_new):
                if new[-1] in stop_at:
                    break
                index = jnp.int32(len(prompt) + step - 1)
                token_R, cache = next_token(
                    self.params, self.model_state, cache, token_R, index, keys[step]
                )
                new.append(int(np.asarray(token_R)[0]))
        return new

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


def filtered_logits(logits_RxV, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The logits a sample is drawn from, as transformers' warpers make them, in their order.

    Divided by `temperature`; then all but the `top_k` likeliest at -inf (0: all kept); then
    all outside the smallest set whose probability reaches `top_p` (1: all kept; the
    likeliest token always stays).
    """
    logits_RxV = logits_RxV.astype(jnp.float32) / temperature
    if top_k:
        threshold_Rx1 = jax.lax.top_k(logits_RxV, top_k)[0][:, -1:]
        logits_RxV = jnp.where(logits_RxV < threshold_Rx1, -jnp.inf, logits_RxV)
    if top_p < 1.0:
        sorted_RxV = jnp.sort(logits_RxV, axis=-1)[:, ::-1]  # likeliest first
        probabilities_RxV = jax.nn.softmax(sorted_RxV, axis=-1)
        before_RxV = jnp.cumsum(probabilities_RxV, axis=-1) - probabilities_RxV
        # The least likely logit still inside the set: the set's cut-off.
        inside_RxV = before_RxV < top_p
        threshold_Rx1 = jnp.min(jnp.where(inside_RxV, sorted_RxV, jnp.inf), -1, keepdims=True)
        logits_RxV = jnp.where(logits_RxV < threshold_Rx1, -jnp.inf, logits_RxV)
    return logits_RxV


def _pick(logits_RxV, key, *, greedy: bool, temperature: float, top_k: int, top_p: float):
    """The next token of each row: the likeliest, or a sample of the filtered logits."""
    if greedy or temperature == 0:
        return jnp.argmax(logits_RxV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    logits_RxV = filtered_logits(logits_RxV, temperature, top_k, top_p)
    return jax.random.categorical(key, logits_RxV, axis=-1).astype(jnp.int32)


class Text:
    """Text to token ids and back: a tokenizer.json, or bytes for a byte-level model."""

    def __init__(self, found: pathlib.Path | None, vocab_size: int):
        self.model = None
        if found is not None:
            try:
                import tokenizers
            except ImportError:
                message = f"{found} needs the tokenizers package: pip install tokenizers"
                raise UserError(message) from None
            self.model = tokenizers.Tokenizer.from_file(str(found))
        elif vocab_size != 256:
            raise UserError(
                "no tokenizer is known for this model (no tokenizer.json beside its weights, and "
                f"its vocab of {vocab_size} is not bytes): give --tokens 1,2,3"
            )

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, with the tokenizer's own markers (Llama's BOS)."""
        if self.model is None:
            return list(text.encode("utf-8"))
        return self.model.encode(text, add_special_tokens=True).ids

    def decode(self, tokens: list[int]) -> str:
        """The text of `tokens`."""
        if self.model is None:
            return bytes(token for token in tokens if token < 256).decode(errors="replace")
        return self.model.decode(tokens)


def _token_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.replace(" ", "").split(",") if item]
    except ValueError:
        raise UserError(f"--tokens {text!r} is not a comma-separated list of token ids") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path, help="a run, checkpoint step or export")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text to continue (needs a tokenizer)")
    given.add_argument("--tokens", help="token ids to continue, comma-separated")
    parser.add_argument("--max-new", type=int, default=64, help="new tokens (default 64)")
    parser.add_argument("--greedy", action="store_true", help="always the likeliest token")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the likeliest whose sum reaches p"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="go on past the end-of-sequence token"
    )
    parser.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="keep the last positions' worth of a prompt longer than the model's positions",
    )
    parser.add_argument("--json", action="store_true", help='one line {"tokens": [...]}')
    args = parser.parse_args(argv)

    def work() -> None:
        if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
            raise UserError("--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]")
        model = Model(args.source)
        text = None
        if args.prompt is not None:
            text = Text(model.tokenizer_file, model.config.model.vocab_size)
            prompt = text.encode(args.prompt)
        else:
            prompt = _token_list(args.tokens)
        positions = model.config.model.positions
        if args.truncate_prompt and len(prompt) > positions:
            output.warning(f"the prompt's first {len(prompt) - positions} tokens are dropped")
            prompt = prompt[-positions:]
        sampling = dict(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k)
        sampling |= dict(top_p=args.top_p, stop_at=() if args.ignore_eos else model.end_ids)
        new = model.generate(prompt, args.max_new, seed=args.seed, **sampling)
        if args.json or text is None:
            output.result(json.dumps({"tokens": new}))
        else:
            output.result(text.decode(prompt + new))

    return exit_status(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())
