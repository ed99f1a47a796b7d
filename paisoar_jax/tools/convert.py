"""`python -m paisoar_jax.convert text|images|verify|hf-import|hf-export ...`: datasets, models.

`text` tokenizes files (one file = one document, each followed by the end-of-document id;
a .jsonl or .parquet file holds one document per record or row, its `--field`; `--from-hf`
reads the rows of a Hugging Face `datasets` dataset instead) into one stream cut into
fixed-size records (the conversion itself is data/text_conversion.py, which a run's
`data.source=hf:` uses too); `images` packs a class-per-folder image tree
into labelled records; `verify` checks a dataset's shards against its manifest. The formats
and their readers are in `paisoar_jax.data.records`. `hf-import` and `hf-export` carry
GPT-2 and Llama weights between Hugging Face's format and ours (paisoar_jax/tools/hf/).

Inputs are files, directories (every non-hidden file below them) or recursive globs. The
`byte` tokenizer stores each file's raw UTF-8 bytes (vocab 256) and uses 0 as the
end-of-document id: text never contains NUL, so a file that does is rejected as binary.
A `tokenizers` JSON file ends documents with the end-of-sequence token its model directory
declares (tokenizer_config.json's eos_token, else generation_config.json's or config.json's
eos_token_id), or the one `--eos` names; only a bare tokenizer.json falls back to the first
of EOS_NAMES it has.

The same inputs give byte-identical output: inputs are sorted and the manifest holds no
timestamps or absolute paths. A dataset is built in a hidden sibling directory and renamed
into place only when complete, so a failed or interrupted run leaves no half dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from paisoar_jax import output
from paisoar_jax.cli import exit_status
from paisoar_jax.data import records
from paisoar_jax.data.conversations import FORMATS
from paisoar_jax.data.text_conversion import DEFAULT_RECORD_TOKENS, TextConversion, convert_text
from paisoar_jax.data.writing import (
    IMAGE_WRITER_OPTIONS,
    staged_output,
    write_manifest,
    write_shards,
)
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import ARCHITECTURES
from paisoar_jax.tools import hf

PROGRAM = "paisoar_jax.convert"
SHOWN_SKIPPED = 3


def _convert_text(args: argparse.Namespace) -> str:
    """`convert text`: its flags as a TextConversion."""
    settings = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(TextConversion)
        if field.name != "names"  # the flags' own, by default
    }
    return convert_text(TextConversion(**settings | {"input": tuple(args.input or ())}))


def convert_images(args: argparse.Namespace) -> str:
    """Packs a class-per-folder image tree into an images dataset; returns the summary line."""
    directory = pathlib.Path(args.input)
    classes, files, skipped = records.scan_image_folder(directory)
    if skipped:
        names = [str(path.relative_to(directory)) for path in skipped[:SHOWN_SKIPPED]]
        names += ["..."] if len(skipped) > SHOWN_SKIPPED else []
        output.warning(
            f"skipped {len(skipped)} unreadable images: {', '.join(names)}", program=PROGRAM
        )
    if not files:
        raise UserError(f"{directory} has no readable .jpg/.jpeg/.png images")
    contents = (
        np.array(label, records.LABEL_DTYPE).tobytes() + path.read_bytes()
        for path, label in output.file_progress(files, "packing", args.progress)
    )
    with staged_output(pathlib.Path(args.output), args.overwrite) as staging:
        shards = write_shards(
            staging, "images", contents, len(files), args.shards, IMAGE_WRITER_OPTIONS
        )
        manifest = {
            "format": records.IMAGES_FORMAT,
            "version": records.FORMAT_VERSION,
            "classes": classes,
            "count": len(files),
            "skipped": len(skipped),
            "shards": shards,
        }
        write_manifest(staging, manifest)
    return (
        f"wrote {len(files)} images of {len(classes)} classes "
        f"({len(skipped)} unreadable skipped) in {len(shards)} shards to {args.output}"
    )


def verify_dataset(args: argparse.Namespace) -> str:
    """Checks a dataset's manifest, shard sizes, record counts and hashes; returns the OK line."""
    directory = pathlib.Path(args.directory)
    try:
        found = json.loads((directory / records.MANIFEST_NAME).read_text()).get("format")
    except Exception:
        found = None  # TokenRecords below reports what exactly is wrong with the manifest.
    reader = (records.ImageRecords if found == records.IMAGES_FORMAT else records.TokenRecords)(
        directory
    )
    reader.verify()
    shards = len(reader.shard_paths)
    return f"OK: {directory}: {len(reader)} records in {shards} shards match the manifest"


def _import_hf(args: argparse.Namespace) -> str:
    """hf-import, in every process of a launched run (each builds only its devices' shards)."""
    from paisoar_jax.config import DistributedConfig
    from paisoar_jax.runtime import distributed

    distributed.initialize(DistributedConfig(), program=PROGRAM)  # the launcher's, if any
    return hf.hf_import(args.input, args.output, args.adapter)


def _add_hf_commands(commands) -> None:
    """The `hf-import` and `hf-export` subcommands: Hugging Face checkpoints in and out."""
    families = ", ".join(ARCHITECTURES.values())
    hf_in = commands.add_parser("hf-import", help=f"a Hugging Face model as params ({families})")
    hf_in.add_argument("--input", required=True, metavar="HF_DIR", type=pathlib.Path)
    hf_in.add_argument("--output", required=True, metavar="DIR", type=pathlib.Path)
    hf_in.add_argument(
        "--adapter",
        metavar="PEFT_DIR",
        type=pathlib.Path,
        help="a PEFT LoRA adapter of that model, imported to train on (lora.* in config.yaml)",
    )
    hf_in.set_defaults(handler=_import_hf)
    hf_out = commands.add_parser("hf-export", help="a run's params as a Hugging Face model")
    hf_out.add_argument("source", metavar="RUN_DIR_OR_EXPORT", type=pathlib.Path)
    hf_out.add_argument("--output", required=True, metavar="HF_DIR", type=pathlib.Path)
    form = hf_out.add_mutually_exclusive_group()
    form.add_argument(
        "--peft",
        dest="form",
        action="store_const",
        const="peft",
        default="model",
        help="a LoRA run's adapters alone, as a PEFT adapter over the base model",
    )
    form.add_argument(
        "--merged",
        dest="form",
        action="store_const",
        const="merged",
        help="a LoRA run's model with its adapters folded into the weights",
    )
    hf_out.set_defaults(handler=lambda args: hf.hf_export(args.source, args.output, args.form))


def build_parser() -> argparse.ArgumentParser:
    """The `text`, `images`, `verify`, `hf-import` and `hf-export` subcommands."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description="Build ArrayRecord datasets.")
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("text", help="tokenize text files into a tokens dataset")
    inputs = text.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input", nargs="+", metavar="FILES_OR_GLOB")
    inputs.add_argument(
        "--from-hf",
        type=pathlib.Path,
        metavar="DATASET",
        help="a Hugging Face datasets directory (save_to_disk) or local data files it loads",
    )
    text.add_argument("--split", default="train", help="--from-hf: the split of a DatasetDict")
    text.add_argument(
        "--tokenizer", default="byte", help="byte, a tokenizers JSON file or an HF model directory"
    )
    text.add_argument(
        "--eos",
        metavar="TOKEN",
        help="the end-of-document token (default: the one the tokenizer's directory declares)",
    )
    text.add_argument("--record-tokens", type=int, default=DEFAULT_RECORD_TOKENS)
    text.add_argument(
        "--field", default="text", help=".jsonl and .parquet inputs: the text's field or column"
    )
    text.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text: whole documents, all learned; instruction: prompt and response fields, "
        "the prompt masked from the loss; chat: messages rendered with the tokenizer's chat "
        "template, the assistant turns learned; preference: prompt, chosen and rejected "
        "(text or messages), two documents a record, for train.objective=dpo",
    )
    text.add_argument("--prompt-field", default="prompt", help="--format instruction")
    text.add_argument("--response-field", default="response", help="--format instruction")
    text.add_argument("--messages-field", default="messages", help="--format chat")
    text.set_defaults(handler=_convert_text)
    images = commands.add_parser("images", help="pack a DIR/CLASS/*.jpg tree into a dataset")
    images.add_argument("--input", required=True, metavar="DIR")
    images.set_defaults(handler=convert_images)
    for command in (text, images):
        command.add_argument("--output", required=True, metavar="DIR")
        command.add_argument("--shards", type=int, default=1)
        command.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
        command.add_argument("--no-progress", dest="progress", action="store_false")
    _add_hf_commands(commands)
    verify = commands.add_parser("verify", help="check a dataset against its manifest")
    verify.add_argument("directory", metavar="DIR")
    verify.set_defaults(handler=verify_dataset)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)

    def work() -> None:
        if getattr(args, "shards", 1) < 1:
            raise UserError(f"--shards must be at least 1, got {args.shards}")
        summary = args.handler(args)
        if summary:  # empty on the other processes of a multi-process import
            output.result(f"{PROGRAM}: {summary}")  # the tool's product, in every mode

    return exit_status(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())
