"""Every config key with its default and its meaning, as `--help` lists them.

The meanings are the comments beside (or just above) each field in sections.py, the one
place they are written, so the listing cannot drift from the code. Model keys are listed
per family: the language models' (gpt, llama) and the image classifiers' (resnet, vgg, vit).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

from paisoar_jax.config import sections

SECTIONS = {
    "mesh": (sections.MeshConfig,),
    "model": (sections.LanguageModelConfig, sections.VisionConfig),
    "data": (sections.DataConfig,),
    "optim": (sections.OptimConfig,),
    "precision": (sections.PrecisionConfig,),
    "remat": (sections.RematConfig,),
    "lora": (sections.LoraConfig,),
    "sharding": (sections.ShardingConfig,),
    "checkpoint": (sections.CheckpointConfig,),
    "train": (sections.TrainConfig,),
    "run": (sections.RunConfig,),
    "distributed": (sections.DistributedConfig,),
}


def key_table() -> list[tuple[str, str, str]]:
    """(section.key, default, meaning or "") of every key, sections in the config's order."""
    meanings = _field_comments()
    table = []
    for section, classes in SECTIONS.items():
        for owner in classes:
            for field in dataclasses.fields(owner):
                if field.name.startswith("_"):
                    continue
                default = owner().__getattribute__(field.name)
                key = f"{section}.{field.name}"
                if any(row[0] == key for row in table):  # a key both model families have
                    continue
                table.append((key, _shown(default), meanings.get((owner.__name__, field.name), "")))
    return table


def keys_help() -> str:
    """The `--help` epilog: one `section.key=default  meaning` line per key."""
    lines = ["config keys (section.key=default, then what it means):"]
    for key, default, meaning in key_table():
        setting = f"  {key}={default}"
        lines.append(f"{setting:<40} {meaning}".rstrip() if meaning else setting)
    return "\n".join(lines)


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
