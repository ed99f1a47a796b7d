"""Every config key with its default and its meaning, as `--help` lists them.

The meanings are the comments beside (or just above) each field in sections.py, the one
place they are written, so the listing cannot drift from the code. Model keys are listed
per family: the language models' (gpt, llama) and the image classifiers' (resnet, vgg, vit).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import NamedTuple

from paisoar_jax.config import sections

SECTIONS = {
    "mesh": (sections.MeshConfig,),
    "model": (sections.LanguageModelConfig, sections.VisionConfig),
    "data": (sections.DataConfig,),
    "optim": (sections.OptimConfig,),
    "precision": (sections.PrecisionConfig,),
    "remat": (sections.RematConfig,),
    "lora": (sections.LoraConfig,),
    "dpo": (sections.DpoConfig,),
    "grpo": (sections.GrpoConfig,),
    "sharding": (sections.ShardingConfig,),
    "checkpoint": (sections.CheckpointConfig,),
    "train": (sections.TrainConfig,),
    "run": (sections.RunConfig,),
    "distributed": (sections.DistributedConfig,),
}
# The model families each class of the model section serves (a key both have is listed twice).
FAMILIES = {sections.LanguageModelConfig: "gpt, llama", sections.VisionConfig: "resnet, vgg, vit"}


class Key(NamedTuple):
    """One config key: its name, default, meaning, allowed values and the models it is for."""

    key: str
    default: str
    meaning: str
    allowed: str  # "adamw | sgd | ..." for a choice, else the kind of value
    family: str  # the model families that read it ("" outside the model section)


def key_table() -> list[Key]:
    """Every key of every section, sections in the config's order."""
    meanings = _field_comments()
    table = []
    for section, classes in SECTIONS.items():
        for owner in classes:
            hints = typing.get_type_hints(owner)
            for field in dataclasses.fields(owner):
                if field.name.startswith("_"):
                    continue
                default = owner().__getattribute__(field.name)
                table.append(
                    Key(
                        key=f"{section}.{field.name}",
                        default=_shown(default),
                        meaning=meanings.get((owner.__name__, field.name), ""),
                        allowed=_allowed(hints[field.name]),
                        family=FAMILIES.get(owner, ""),
                    )
                )
    return table


def keys_help() -> str:
    """The `--help` epilog: each key's `section.key=default`, then its meaning and values."""
    lines = ["config keys (section.key=default, then what it means and takes):"]
    for row in key_table():
        setting = f"  {row.key}={row.default}"
        meaning = row.meaning + (f" [{row.allowed}]" if "|" in row.allowed else "")
        if row.family:
            meaning = f"({row.family}) {meaning}"
        wrapped = textwrap.wrap(meaning, width=88 - 40, break_on_hyphens=False) or [""]
        lines.append(f"{setting:<39} {wrapped[0]}".rstrip())
        lines += [" " * 40 + line for line in wrapped[1:]]
    return "\n".join(lines)


def _allowed(hint) -> str:
    """The values a field's type allows, as a reader writes them on the command line."""
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(str(value) for value in typing.get_args(hint))
    if hint is bool:
        return "true | false"
    origin = typing.get_origin(hint)
    if origin is tuple:
        return "list"
    if origin in (typing.Union, types.UnionType):
        kinds = [_allowed(arg) for arg in typing.get_args(hint) if arg is not type(None)]
        return " or ".join(kinds) + (" or unset" if type(None) in typing.get_args(hint) else "")
    return {int: "integer", float: "number", str: "text"}.get(hint, "")


def _shown(value) -> str:
    """A default as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(_shown(item) for item in value) + "]"
    return str(value)


def _field_comments() -> dict[tuple[str, str], str]:
    """{(class name, field): its comment} from the modules of the section classes.

    The comment on the field's own line, else the block of comment lines just above it.
    """
    modules = {inspect.getmodule(owner) for owners in SECTIONS.values() for owner in owners}
    comments = {}
    for module in sorted(modules, key=lambda module: module.__name__):
        comments |= _module_comments(module)
    return comments


def _module_comments(module) -> dict[tuple[str, str], str]:
    """{(class name, field): its comment} of the dataclasses in one module's source."""
    try:
        source = inspect.getsource(module)
    except OSError:  # installed without sources (.pyc only): the keys, without meanings
        return {}
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (
                isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            ):
                continue
            line = lines[statement.end_lineno - 1]
            text = line.split("  # ", 1)[1] if "  # " in line else ""
            block, above = [], statement.lineno - 2
            while above >= 0 and lines[above].strip().startswith("#"):
                block.insert(0, lines[above].strip().lstrip("# "))
                above -= 1
            comments[(node.name, statement.target.id)] = " ".join((text or " ".join(block)).split())
    return comments
