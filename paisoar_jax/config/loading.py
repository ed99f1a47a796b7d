"""Reading a config: YAML files and `section.key=value` overrides into the dataclasses.

A YAML file holds sections named after the fields of `Config` (mesh, model, data, ...); each
section lists only what differs from the dataclass defaults, so the defaults alone are the
embedded CPU-friendly run. Command-line overrides look like `optim.lr=3e-4`. Unknown keys,
wrong types and values outside a field's choices raise `UserError` with one line; the
dataclasses check their values as they are built (sections.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
import typing
from typing import Any, Literal

import yaml

from paisoar_jax.config.models import MODEL_CONFIGS
from paisoar_jax.config.sections import Config
from paisoar_jax.errors import UserError, one_line_errors

# The shipped recipes: paisoar_jax/configs inside an installed wheel, configs/ beside the
# package in a checkout and an editable install (pyproject.toml maps the one to the other).
_PACKAGE_DIR = pathlib.Path(__file__).parent.parent
CONFIG_DIR = next(
    (path for path in (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs") if path.is_dir()),
    _PACKAGE_DIR / "configs",
)


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Returns `value` as type `kind`, accepting strings from the command line."""
    optional = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if typing.get_origin(kind) is types.UnionType and len(optional) == 1:  # `float | None`
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, optional[0], key)
    if typing.get_origin(kind) is tuple:
        item_kind = typing.get_args(kind)[0]
        if item_kind in (int, str):  # [10, 20] in YAML, 10,20 or [10,20] on the command line
            items = _split_list(value) if isinstance(value, str) else value
            if isinstance(items, list | tuple):
                try:
                    return tuple(
                        _coerce(item, item_kind, key) for item in items if str(item).strip()
                    )
                except UserError:
                    pass
            example = "integers like [10, 20]" if item_kind is int else "strings like [a, b]"
            raise UserError(f"{key}: expected a list of {example}, got {value!r}")
        return _coerce_rules(value, key)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise UserError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"{key}: expected {kind.__name__}, got {value!r}")


def _split_list(text: str) -> list[str]:
    """`[a, b]` or `a,b` -> its items, split on commas outside brackets (regexes keep theirs)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items, depth, current = [], 0, ""
    for character in text:
        depth += (character in "[({") - (character in "])}")
        if character == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += character
    return [*items, current.strip()]


def _coerce_rules(value: Any, key: str) -> tuple:
    """Sharding rules: [[regex, [entry, ...]], ...] or {regex: [entry, ...]}, YAML on the CLI."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            hint = ""
            if "unknown escape character" in str(error):  # "out\.kernel": \. is none
                hint = " (in double quotes YAML reads \\ as an escape: single-quote the regex)"
            raise UserError(f"{key}: not valid YAML{hint}: {value!r}") from None
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list | tuple):
        raise UserError(f"{key}: expected a list of [regex, [axes per dimension]], got {value!r}")
    rules = []
    for rule in value:
        if not (isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise UserError(f"{key}: a rule is [regex, [axes per dimension]], got {rule!r}")
        pattern, entries = rule
        if isinstance(entries, str) or not isinstance(entries, list | tuple):
            entries = [entries]
        rules.append((pattern, tuple(_axis_entry(entry, key, pattern) for entry in entries)))
    return tuple(rules)


def _axis_entry(entry: Any, key: str, pattern: str) -> str | tuple[str, ...] | None:
    """One dimension of a rule: None, a name, or a list of mesh-axis names."""
    if entry is None or (isinstance(entry, str) and entry.lower() in ("none", "null", "")):
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list | tuple) and all(isinstance(name, str) for name in entry):
        return tuple(entry)
    raise UserError(f"{key}: rule {pattern!r}: {entry!r} is not an axis name or a list of them")


def _build_section(section_type: type, values: dict[str, Any], prefix: str) -> Any:
    """Builds one section dataclass from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(values, dict):
        raise UserError(f"{prefix}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(section_type)
    # a field may read its own value (data.mixture's nested lists): its metadata's "parse"
    parsers = {f.name: f.metadata.get("parse") for f in dataclasses.fields(section_type)}
    known = set(parsers)
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise UserError(
                f"unknown config key {prefix}.{key}{_model_hint(prefix, key, values)} "
                f"(known: {', '.join(sorted(known))})"
            )
        parse = parsers[key]
        kwargs[key] = parse(value) if parse else _coerce(value, hints[key], f"{prefix}.{key}")
    return section_type(**kwargs)


def _model_hint(prefix: str, key: str, values: dict[str, Any]) -> str:
    """For a model key of another family: which model.name it belongs to."""
    if prefix != "model":
        return ""
    owners = sorted(
        {
            name
            for name, section_type in MODEL_CONFIGS.items()
            if key in {f.name for f in dataclasses.fields(section_type)}
        }
    )
    if not owners:
        return ""
    return f": it belongs to model.name={'|'.join(owners)}, not {values.get('name', 'gpt')}"


def resolve_config_path(path_or_name: str) -> pathlib.Path:
    """Finds a config by path, or by name among the shipped configs (`gpt2_124m`)."""
    path = pathlib.Path(path_or_name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{path.stem}.yaml"
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise UserError(f"config file not found: {path_or_name} (shipped configs: {names})")


def _parse_override(text: str) -> tuple[str, str, str]:
    """Splits `section.key=value` into its three parts."""
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form section.key=value")
    dotted, value = text.split("=", 1)
    if dotted.count(".") != 1:
        raise UserError(f"override key {dotted!r} is not of the form section.key")
    section, key = dotted.split(".")
    return section, key, value


@one_line_errors("paisoar_jax.load_config")
def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads a YAML config (or the defaults when `path` is None) and applies overrides.

    Args:
        path: a YAML file or the name of a shipped config (configs/NAME.yaml); None: the
            defaults (the embedded tiny GPT).
        overrides: `section.key=value` strings, applied in order after the file.

    Returns:
        The resolved, checked Config.

    Raises:
        UserError: an unknown key, a wrong type or a value no run could use, in one line.

    Example:
        ```python
        import paisoar_jax

        config = paisoar_jax.load_config("gpt2_124m", ["train.steps=100", "mesh.fsdp=2"])
        print(config.model.layers, config.train.steps, config.run_dir)
        ```

    """
    if path is None:
        return config_from_dict({}, overrides)
    config_path = resolve_config_path(path)
    try:
        text = config_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{config_path}: not a YAML config (byte {error.start} is not UTF-8 text)"
        ) from None
    except OSError as error:
        raise UserError(f"{config_path}: cannot be read ({error.strerror or error})") from None
    if not text.strip():
        raise UserError(
            f"{config_path} is empty: a YAML config holds sections (model:, train: ...)"
        )
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{config_path}:{mark.line + 1}" if mark is not None else str(config_path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"{where}: not valid YAML ({problem})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{config_path}: expected a mapping of sections at the top level")
    raw.setdefault("run", {}).setdefault("name", config_path.stem)
    try:
        return config_from_dict(raw, overrides)
    except UserError as error:  # the line of the file's key it names, if any
        overridden = {override.partition("=")[0].strip() for override in overrides}
        line = _line_of_key_named(str(error), text, overridden)
        if line is None:
            raise
        raise UserError(f"{error} ({config_path}:{line})") from None


def _line_of_key_named(message: str, text: str, overridden: set[str]) -> int | None:
    """The line (from 1) of the first `section.key` of a YAML config that `message` names.

    None when there is none, or when the first it names was overridden (the override is
    the culprit, not the file).
    """
    root = yaml.compose(text)
    lines = {}
    for section, values in root.value if isinstance(root, yaml.MappingNode) else ():
        lines.setdefault(section.value, section.start_mark.line + 1)
        for key, _ in values.value if isinstance(values, yaml.MappingNode) else ():
            lines.setdefault(f"{section.value}.{key.value}", key.start_mark.line + 1)
    named = [m.group(0) for m in re.finditer(r"\b[a-z_]+\.[a-z_0-9]+\b", message)]
    key = next((key for key in named if key in lines or key in overridden), None)
    return None if key is None or key in overridden else lines[key]


def config_from_dict(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates a Config from plain sections (as YAML gives them) and overrides."""
    raw = {
        name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()
    }
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for text in overrides:
        section, key, value = _parse_override(text)
        if section not in sections:
            raise UserError(f"unknown config section {section!r} in override {text!r}")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise UserError(f"{section}: expected a mapping of keys")
        raw[section][key] = value
    for name in raw:
        if name not in sections:
            raise UserError(f"unknown config section {name!r} (known: {', '.join(sections)})")
    return Config(
        **{
            name: _build_section(_section_type(name, raw), raw.get(name) or {}, name)
            for name in sections
        }
    )


def _section_type(name: str, raw: dict[str, Any]) -> type:
    """The dataclass of section `name`; the model section's follows its model.name."""
    if name != "model":
        return typing.get_type_hints(Config)[name]
    model_name = (
        (raw.get("model") or {}).get("name", "gpt") if isinstance(raw.get("model"), dict) else "gpt"
    )
    if model_name not in MODEL_CONFIGS:
        zoo = sorted(name for name in MODEL_CONFIGS if name != "custom")
        raise UserError(
            f"model.name={model_name!r} is not one of {', '.join(zoo)} (custom: a model of "
            f"your own, given to paisoar_jax.fit)"
        )
    return MODEL_CONFIGS[model_name]


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain dicts, for config.yaml in the run directory."""
    return dataclasses.asdict(config)


# Atop a `fit` run's config.yaml (custom.CustomTask.config_note). The doctor looks for its
# first words alone, so that the rest may be reworded.
FIT_CONFIG_MARK = "# Written by paisoar_jax.fit:"
FIT_CONFIG_NOTE = (
    f"{FIT_CONFIG_MARK} the model, loss and data were the program's (and the\n"
    "# optimizer, when it gave one), not the model/data/optim settings below. The program\n"
    "# repeats the run; `--config` of this file alone would train the zoo's default.\n"
)


def dump_yaml(config: Config) -> str:
    """The resolved config as YAML text that load_config reads back to the same Config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)
