"""Text into token ids: the `byte` tokenizer or a `tokenizers` JSON file, and its end id.

The `byte` tokenizer stores each document's raw UTF-8 bytes (vocab 256) and uses 0 as the
end-of-document id: text never contains NUL, so a document that does is rejected as
binary. A `tokenizers` JSON file ends documents with the end-of-sequence token its model
directory declares (tokenizer_config.json's eos_token, else generation_config.json's or
config.json's eos_token_id), or the one asked for; only a bare tokenizer.json falls back to
the first of EOS_NAMES it has. `python -m paisoar_jax.convert text` and `generate` use it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np

from paisoar_jax.data import records
from paisoar_jax.errors import FLAG_NAMES, SettingNames, UserError
from paisoar_jax.runtime.user_files import open_tokenizer, read_json

# The last resort for a tokenizer whose directory declares no end-of-sequence token.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


@dataclasses.dataclass
class Tokenizer:
    """Byte-level (model None) or a HuggingFace `tokenizers` model, with its ids."""

    name: str
    sha256: str | None
    vocab_size: int
    eos_id: int
    model: object | None = None
    path: pathlib.Path | None = None  # the tokenizers JSON file (None: byte)


def load_tokenizer(
    spec: str, eos: str | None = None, names: SettingNames = FLAG_NAMES
) -> Tokenizer:
    """`byte`, a HuggingFace `tokenizers` JSON file, or an HF model directory (its own).

    `eos` names the end-of-document token; by default the one the directory declares
    (declared_end_id). `names`: how errors name the `tokenizer` and `eos` settings.
    """
    if spec == "byte":
        if eos:
            raise UserError(
                f"{names('eos')} names a token of a tokenizers model, not of "
                f"{names('tokenizer', 'byte')}"
            )
        # UTF-8 text never contains NUL, so byte 0 is free to mark the end of a document.
        return Tokenizer("byte", None, 256, 0)
    path = pathlib.Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"  # a Hugging Face model directory, or an import of one
    if not path.is_file():
        raise UserError(
            f"{names('tokenizer', spec)}: no such file (use byte, a tokenizers JSON file or a "
            f"Hugging Face model directory)"
        )
    try:
        import tokenizers  # noqa: F401 (here only: is it installed?)
    except ImportError:
        raise UserError(
            f"{names('tokenizer', spec)} needs the tokenizers package: pip install tokenizers"
        ) from None
    model = open_tokenizer(path)
    if eos:
        eos_id = model.token_to_id(eos)
        if eos_id is None:
            raise UserError(f"{names('eos', eos)}: {path} has no such token")
    else:
        eos_id = end_of_text_id(model, path.parent)
    if eos_id is None:
        remedy = (
            f"name it with {names('eos', 'TOKEN')}"
            if names.offers("eos")  # a run's data.source=hf: has no such key: convert has
            else "convert with `python -m paisoar_jax.convert text --eos TOKEN` and train on "
            "data.source=arrayrecord:DIR"
        )
        raise UserError(
            f"{path} has no end-of-sequence token: its directory declares none (an eos_token "
            f"in tokenizer_config.json, an eos_token_id in generation_config.json or "
            f"config.json) and it has none of {', '.join(EOS_NAMES)}; {remedy}"
        )
    sha256 = records.file_sha256(path)
    return Tokenizer(path.name, sha256, model.get_vocab_size(), eos_id, model, path)


def declared_end_id(model: Any, directory: pathlib.Path) -> int | None:
    """The end-of-sequence id a model directory declares for its `tokenizers` model.

    tokenizer_config.json's eos_token (a string or an AddedToken), else the eos_token_id
    (an id or a list: its first) of generation_config.json, else of config.json, as
    transformers reads them; None when none of them says.
    """
    for name in records.EOS_DECLARING_FILES:
        path = directory / name
        settings = read_json(path) if path.is_file() else {}  # a broken one: one line
        token = settings.get("eos_token") if name == records.EOS_DECLARING_FILES[0] else None
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and model.token_to_id(token) is not None:
            return model.token_to_id(token)
        token_id = settings.get("eos_token_id")
        token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
        if isinstance(token_id, int) and 0 <= token_id < model.get_vocab_size():
            return token_id
    return None


def end_of_text_id(model: Any, directory: pathlib.Path | None = None) -> int | None:
    """The end-of-text id of a `tokenizers` model: its directory's declared one, else by name.

    The first of EOS_NAMES it has is only the last resort, for a bare tokenizer.json.
    """
    declared = declared_end_id(model, directory) if directory is not None else None
    if declared is not None:
        return declared
    ids = (model.token_to_id(name) for name in EOS_NAMES)
    return next((token for token in ids if token is not None), None)


def tokenize(tokenizer: Tokenizer, data: bytes, where: str) -> np.ndarray:
    """The token ids of one document's UTF-8 bytes, without its end-of-document id."""
    if tokenizer.model is None:
        if b"\0" in data:
            raise UserError(f"{where} contains NUL bytes (the byte tokenizer's end-of-document)")
        return np.frombuffer(data, np.uint8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where} is not UTF-8 text: {error}") from None
    return np.asarray(tokenizer.model.encode(text, add_special_tokens=False).ids, np.int64)
