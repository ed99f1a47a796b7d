"""Instruction and chat records as documents with a loss mask, for supervised fine-tuning.

`convert text --format instruction|chat` (a run's data.hf_format) reads JSON Lines or
Parquet records (or a `datasets` dataset's rows) and turns each into one document made of
pieces, each marked as context (the loss skips it: a prompt, a system or user turn, the
template's own markup) or as a response (the loss learns it):

    instruction   {"prompt": ..., "response": ...} (--prompt-field, --response-field): the
                  prompt's text as context, then the response's text, then the
                  end-of-document token, both learned. The text is taken as it is: a
                  prompt format ("### Instruction: ...") belongs to the records.
    chat          {"messages": [{"role": ..., "content": ...}, ...]} (--messages-field),
                  rendered with the tokenizer's chat template (chat_template.jinja or
                  tokenizer_config.json's, rendered as transformers renders it); each
                  assistant turn is learned, the rest is context.

A chat is cut into pieces by rendering it turn by turn: the text up to assistant turn i with
the generation prompt, then the text through turn i, each a prefix of the next. A template
that rewrites earlier turns as the chat goes on (Qwen3's drops the <think> reasoning of
turns before the last question) cannot be cut so: such a chat becomes one document per
assistant turn, each the conversation up to that turn as the template renders it then,
with that turn alone learned (as the model sees it when it writes that turn). Each piece
is tokenized on its own: templates put special tokens at the boundaries, so the tokens
equal the whole text's
(tests/data/test_conversations.py checks them against transformers' apply_chat_template).
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Iterator
from typing import Any

from paisoar_jax.errors import FLAG_NAMES, SettingNames, UserError
from paisoar_jax.runtime.user_files import read_json, read_text

FORMATS = ("text", "instruction", "chat", "preference")  # preference: data/preferences.py
Piece = tuple[str, bool]  # (text, learned: whether the loss counts its tokens)


def json_rows(path: pathlib.Path) -> Iterator[tuple[Any, str]]:
    """(record, where) for each non-blank line of a JSON Lines file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror}") from None
    if not data.strip():
        raise UserError(f"{path} is empty: no JSON lines in it")
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield json.loads(line), where
        except UnicodeDecodeError as error:
            raise UserError(f"{where}: not UTF-8 text (byte {error.start} of the line)") from None
        except json.JSONDecodeError as error:
            raise UserError(f"{where}: not a JSON object ({error.msg})") from None


def parquet_rows(
    path: pathlib.Path, columns: list[str] | None, names: SettingNames = FLAG_NAMES
) -> Iterator[tuple[Any, str]]:
    """(row as a dict, where) for each row of a Parquet file, one row group at a time.

    `columns`: the ones to read (those of the `field` setting), or None for all.
    """
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = parquet.ParquetFile(path)
    except Exception as error:
        raise UserError(f"{path} is not a Parquet file ({error})") from None
    missing = [name for name in columns or () if name not in table.schema_arrow.names]
    if missing:
        found = ", ".join(table.schema_arrow.names)
        raise UserError(
            f"{path} has no column {missing[0]!r} (columns: {found}): set {names('field')}"
        )
    row = 0
    for group in range(table.num_row_groups):
        for record in table.read_row_group(group, columns=columns).to_pylist():
            row += 1
            yield record, f"{path} row {row}"


def text_field(record: Any, field: str, where: str, option: str) -> str:
    """The text under `field` of one record, or a UserError naming the record and `option`."""
    if not isinstance(record, dict) or field not in record:
        raise UserError(f"{where}: no field {field!r} (set {option} to the text's name)")
    if not isinstance(record[field], str):
        raise UserError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
    return record[field]


def instruction_pieces(
    record: Any, fields: tuple[str, str], where: str, names: SettingNames = FLAG_NAMES
) -> list[Piece]:
    """[(prompt, context), (response, learned)] of one instruction record."""
    prompt = text_field(record, fields[0], where, names("prompt_field"))
    response = text_field(record, fields[1], where, names("response_field"))
    return [(prompt, False), (response, True)]


class ChatTemplate:
    """A tokenizer's Jinja chat template, rendered as transformers renders it."""

    def __init__(self, tokenizer_path: pathlib.Path, names: SettingNames = FLAG_NAMES):
        self.names = names  # how errors name the format and messages_field settings
        config_path = tokenizer_path.parent / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t["name"] == "default"), None)
        template_path = tokenizer_path.parent / "chat_template.jinja"  # newer transformers
        if template_path.is_file():
            template = read_text(template_path, "a Jinja template")
        if not isinstance(template, str):
            raise UserError(
                f"{names('format', 'chat')} needs a chat template, and {tokenizer_path.parent} "
                f"has none (no chat_template.jinja, none in tokenizer_config.json): use "
                f"{names('format', 'instruction')} with prompt and response fields"
            )
        try:
            import jinja2
            import jinja2.ext
            import jinja2.sandbox
        except ImportError:
            raise UserError(
                f"{names('format', 'chat')} renders templates with jinja2: pip install jinja2"
            ) from None
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_tags(jinja2)],
        )
        environment.filters["tojson"] = _to_json
        environment.globals["raise_exception"] = _raise_template_error
        environment.globals["strftime_now"] = _strftime_now
        self.template = environment.from_string(template)
        # The special tokens a template may name, as strings ({{ bos_token }}).
        self.specials = {
            name: _token_text(value)
            for name, value in config.items()
            if name.endswith("_token") and _token_text(value) is not None
        }

    def render(self, messages: list, add_generation_prompt: bool, where: str = "the chat") -> str:
        """The template's text of `messages`; a template that fails on them is a UserError."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
            )
        except UserError:
            raise
        except Exception as error:
            raise UserError(f"{where}: the chat template fails on it: {error}") from None

    def documents(self, record: Any, messages_field: str, where: str) -> list[list[Piece]]:
        """The chat as one document of pieces, or one per assistant turn.

        One per turn when its template rewrites earlier turns (see the module docstring).
        """
        try:
            return [self.pieces(record, messages_field, where)]
        except _RewritesEarlierTurnsError:
            messages = record[messages_field]
        documents = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], True, where)
            through = self.render(messages[: index + 1], False, where)
            if not through.startswith(prompt):
                raise UserError(
                    f"{where}: the chat template renders turn {index} differently from the "
                    f"prompt it renders before it, so its prompt cannot be masked"
                )
            documents.append([(prompt, False), (through[len(prompt) :], True)])
        return documents

    def pieces(self, record: Any, messages_field: str, where: str) -> list[Piece]:
        """The chat cut into context and learned (assistant) pieces, turn by turn."""
        messages = record.get(messages_field) if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise UserError(
                f"{where}: no list of {{role, content}} messages under {messages_field!r} "
                f"(set {self.names('messages_field')})"
            )
        pieces, done = [], ""
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], True, where)
            through = self.render(messages[: index + 1], False, where)
            for before, after in ((done, prompt), (prompt, through)):
                if not after.startswith(before):
                    raise _RewritesEarlierTurnsError()
            pieces += [(prompt[len(done) :], False), (through[len(prompt) :], True)]
            done = through
        whole = self.render(messages, False, where)
        if not any(learned for _, learned in pieces):
            raise UserError(f"{where}: the chat has no assistant turn to learn")
        if not whole.startswith(done):
            raise _RewritesEarlierTurnsError()
        return [*pieces, (whole[len(done) :], False)]


class _RewritesEarlierTurnsError(Exception):
    """A chat's template renders its earlier turns differently as it goes on."""


def _generation_tags(jinja2) -> type:
    """A Jinja extension that renders `{% generation %}...{% endgeneration %}` as its body.

    Templates mark the assistant's text so for transformers' assistant-token masks; the
    turn-by-turn cut above finds the same text without them.
    """

    class GenerationTags(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTags


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json as text (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _to_json(value: Any, indent: int | None = None, **options: Any) -> str:
    """Jinja's tojson as chat templates expect it: no HTML escaping, unicode kept."""
    return json.dumps(value, indent=indent, ensure_ascii=False, **options)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"it raises {message!r}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
