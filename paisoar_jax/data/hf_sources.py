"""`data.source=hf:<path>` at train time: the dataset tokenized once, on first use.

A Hugging Face `datasets` directory (save_to_disk) or local data files are converted, as
`convert text --from-hf` converts them (data/text_conversion.py, its errors naming the
data.* keys), into the cache directory the core reads them from
(`data.sources.hf_cache_directory`: a hash of the files and the settings, under
data.cache_dir), then trained on as an arrayrecord dataset, with the global sampler's
guarantees. The language-model task prepares them when it opens its sources; process 0
converts while the others wait; every process must see the cache.
"""

from __future__ import annotations

import itertools
import pathlib

import jax

from paisoar_jax import output
from paisoar_jax.config import DataConfig
from paisoar_jax.data.records import MANIFEST_NAME
from paisoar_jax.data.sources import hf_cache_directory
from paisoar_jax.data.text_conversion import TextConversion, convert_text
from paisoar_jax.errors import SettingNames, UserError

WAIT_S = 24 * 3600  # how long the other processes wait for process 0's tokenizing
_BARRIERS = itertools.count()  # a barrier's name is used once


def wait_for_everyone(name: str) -> None:
    """Blocks until every process arrives, however long that takes (up to WAIT_S).

    The coordination service's barrier, not a collective: a device barrier (gloo, NCCL)
    gives up after a timeout of seconds to minutes, and tokenizing can take hours. A process
    that dies meanwhile fails the others through the same service.
    """
    from jax._src import distributed as jax_distributed  # the client has no public door

    jax_distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=WAIT_S * 1000)


def hf_paths(data: DataConfig) -> list[tuple[str, str, DataConfig]]:
    """The run's hf:<path> sources: (its key, its path, the data section it is read with).

    data.source or the mixture's, data.eval_source and data.eval_sets' (read with the eval
    split).
    """
    specs = [("data.mixture", entry.source, data) for entry in data.mixture]
    specs = specs or [("data.source", data.source, data)]
    specs += [("data.eval_source", data.eval_source, data.eval_side())] if data.eval_source else []
    specs += [
        (
            f"data.eval_sets[{entry.name}]",
            entry.source,
            data.eval_side(entry.source, entry.hf_split),
        )
        for entry in data.eval_sets
    ]
    return [
        (key, spec.removeprefix("hf:"), read) for key, spec, read in specs if spec.startswith("hf:")
    ]


# The conversion's settings as a run's config names them; eos and the record size are
# convert's alone (empty: no such key here).
CONFIG_LABELS = {
    "format": "data.hf_format",
    "tokenizer": "data.tokenizer",
    "field": "data.hf_field",
    "prompt_field": "data.hf_field (prompt,response)",
    "response_field": "data.hf_field (prompt,response)",
    "messages_field": "data.hf_field",
    "eos": "",
}


def conversion_for(
    key: str, data: DataConfig, path: str, directory: pathlib.Path
) -> TextConversion:
    """The conversion of `key`'s `hf:<path>` into `directory`, as the data section sets it."""
    columns = {}
    if data.hf_field and data.hf_format == "instruction":
        prompt, response = (name.strip() for name in data.hf_field.split(","))
        columns = {"prompt_field": prompt, "response_field": response}
    elif data.hf_field:
        columns = {"messages_field" if data.hf_format == "chat" else "field": data.hf_field}
    if key in ("data.source", "data.mixture"):
        split_key = "data.hf_split"
    elif key == "data.eval_source":
        split_key = "data.eval_hf_split"
    else:  # one of data.eval_sets: its own split (the entry's fourth item), else the eval one
        split_key = f"{key}'s hf_split or data.eval_hf_split"
    names = SettingNames(CONFIG_LABELS | {"from_hf": f"{key}=hf:", "split": split_key}, "=")
    return TextConversion(
        output=directory,
        from_hf=pathlib.Path(path),
        split=data.hf_split,
        tokenizer=data.tokenizer or "byte",
        format=data.hf_format,
        overwrite=True,  # the cache directory is ours; a partial one never lands (staged)
        progress=False,
        names=names,
        **columns,
    )


def prepare(data: DataConfig) -> None:
    """Tokenizes each hf:<path> source the cache lacks (process 0), before training."""
    paths = hf_paths(data)
    if not paths:
        return
    for key, path, read_with in paths:
        directory = hf_cache_directory(read_with, path, key)
        if jax.process_index() == 0 and not (directory / MANIFEST_NAME).is_file():
            try:
                summary = convert_text(conversion_for(key, read_with, path, directory))
            except OSError as error:
                raise UserError(
                    f"data.cache_dir: cannot write {directory} ({error.strerror or error}): set "
                    f"data.cache_dir to a writable directory"
                ) from None
            output.note(f"{key}=hf:{path}, tokenized once for this and later runs: {summary}")
    if jax.process_count() > 1:
        wait_for_everyone(f"paisoar_jax.hf_sources.{next(_BARRIERS)}")
        for key, path, read_with in paths:
            directory = hf_cache_directory(read_with, path, key)
            if not (directory / MANIFEST_NAME).is_file():
                raise UserError(
                    f"{key}=hf:{path}: process 0 tokenized it into {directory}, which "
                    f"process {jax.process_index()} cannot see: set data.cache_dir to a "
                    f"directory every host shares"
                )
