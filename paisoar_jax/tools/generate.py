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

From Python, `paisoar_jax.Generator(SOURCE)` (inference/generator.py) generates for many
prompts at once: `.complete(texts)`, `.generate(token lists)`.

`--prompt` needs a tokenizer: the tokenizer.json beside the weights (`hf-import` copies the
model's own; a run fine-tuned from an import finds it through checkpoint.init_from), or
bytes for a byte-level model (vocab 256, the embedded corpus). `--json` prints one line
{"tokens": [...]} of the new ids; otherwise the prompt and its continuation as text.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from paisoar_jax import output
from paisoar_jax.cli import exit_status
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.inference.text import Text

PROGRAM = "paisoar_jax.generate"


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
    parser.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user turn, rendered with the model's chat template",
    )
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
        model = Generator(args.source)
        text = None
        if args.prompt is not None:
            text = Text(model.tokenizer_file, model.config.model.vocab_size)
            chat = [{"role": "user", "content": args.prompt}]
            prompt = text.encode_chat(chat) if args.chat else text.encode(args.prompt)
        else:
            prompt = _token_list(args.tokens)
        positions = model.config.model.positions
        if args.truncate_prompt and len(prompt) > positions:
            output.warning(f"the prompt's first {len(prompt) - positions} tokens are dropped")
            prompt = prompt[-positions:]
        sampling = dict(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k)
        sampling |= dict(top_p=args.top_p, stop_at=() if args.ignore_eos else model.end_ids)
        (new,) = model.generate([prompt], args.max_new, seed=args.seed, **sampling)
        if args.json or text is None:
            output.result(json.dumps({"tokens": new}))
        else:
            output.result(output.printable(text.decode(prompt + new)))

    return exit_status(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())
