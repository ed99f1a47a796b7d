"""Reading the files a user hands us: a broken one is one line naming it and what is wrong.

Every reader of a user's file (a Hugging Face directory's JSON and safetensors, tokenizer
files, a run's config.yaml, exports and checkpoints) goes through these, so a file that is
truncated, empty or not of its format is a `UserError` (exit status 2 on the command line)
that names the file, never the parser's traceback.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator
from typing import Any

from paisoar_jax.errors import UserError


def read_text(path: pathlib.Path, what: str = "a text file") -> str:
    """The file's text (UTF-8); a file that is missing, unreadable or not text is a UserError."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except UnicodeDecodeError as error:
        raise UserError(
            f"{path} is not {what}: byte {error.start} is not UTF-8 (a binary file, or truncated?)"
        ) from None
    except OSError as error:
        raise UserError(f"{path} cannot be read ({error.strerror or error})") from None


def read_json(path: pathlib.Path, kind: type = dict) -> Any:
    """The JSON value in `path`, which must be a `kind` (an object by default)."""
    text = read_text(path, "JSON")
    if not text.strip():
        raise UserError(f"{path} is empty: a JSON {_kind_name(kind)} was expected")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{path} is not valid JSON ({error.msg}: line {error.lineno} column {error.colno}"
            f"{': truncated?' if error.pos >= len(text.rstrip()) else ''})"
        ) from None
    if not isinstance(value, kind):
        found = _kind_name(type(value))
        raise UserError(f"{path} holds a JSON {found}, not an {_kind_name(kind)}")
    return value


def _kind_name(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        kind, kind.__name__
    )


@contextlib.contextmanager
def safetensors_errors(path: pathlib.Path) -> Iterator[None]:
    """Turns safetensors' errors on `path` (truncated, empty, not safetensors) into one line."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:  # safetensors_rust.SafetensorError is a plain Exception
        if type(error).__name__ != "SafetensorError" and not isinstance(error, OSError):
            raise
        size = pathlib.Path(path).stat().st_size if pathlib.Path(path).exists() else None
        what = "is empty" if size == 0 else f"is not a complete safetensors file ({error})"
        raise UserError(f"{path} {what}") from None


def open_tokenizer(path: pathlib.Path) -> Any:
    """A `tokenizers.Tokenizer` from tokenizer.json; a broken file is one line naming it."""
    import tokenizers

    text = read_text(path, "a tokenizer.json")
    if not text.strip():
        raise UserError(f"{path} is empty: not a tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception
        raise UserError(
            f"{path} is not a tokenizer.json the tokenizers library reads ({error})"
        ) from None
