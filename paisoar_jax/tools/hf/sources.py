"""`data.source=hf:<path>` at train time: the dataset tokenized once, on first use.

A Hugging Face `datasets` directory (save_to_disk) or local data files are converted by
`convert text --from-hf` into the cache directory the core reads them from
(`data.sources.hf_cache_directory`: a hash of the files and the settings, under
data.cache_dir), then trained on as an arrayrecord dataset, with the global sampler's
guarantees. Process 0 converts while the others wait; every process must see the cache.
"""

from __future__ import annotations

import itertools
import re

import jax

from paisoar_jax import output
from paisoar_jax.config import Config, DataConfig
from paisoar_jax.data.records import MANIFEST_NAME
from paisoar_jax.data.sources import hf_cache_directory
from paisoar_jax.errors import UserError

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


def hf_paths(config: Config) -> list[tuple[str, str, DataConfig]]:
    """The run's hf:<path> sources: (its key, its path, the data section it is read with).

    data.source or the mixture's, and data.eval_source (read with its own split).
    """
    data = config.data
    specs = [("data.mixture", entry.source, data) for entry in data.mixture]
    specs = specs or [("data.source", data.source, data)]
    specs += [("data.eval_source", data.eval_source, data.eval_side())] if data.eval_source else []
    return [
        (key, spec.removeprefix("hf:"), read) for key, spec, read in specs if spec.startswith("hf:")
    ]


# convert's flags, and the keys of the data section that set them here
FLAG_KEYS = {
    "--split": "data.hf_split",
    "--format": "data.hf_format",
    "--tokenizer": "data.tokenizer",
    "--messages-field": "data.hf_field",
    "--prompt-field": "data.hf_field (prompt,response)",
    "--response-field": "data.hf_field (prompt,response)",
    "--field": "data.hf_field",
}


def _field_arguments(form: str, field: str) -> list[str]:
    """The column flags of convert for data.hf_field under data.hf_format."""
    if not field:
        return []
    if form == "instruction":
        prompt, response = field.split(",")
        return ["--prompt-field", prompt.strip(), "--response-field", response.strip()]
    return ["--messages-field" if form == "chat" else "--field", field]


def _as_keys(message: str) -> str:
    """A convert error with its flags named as the config keys that set them."""
    for flag, key in FLAG_KEYS.items():
        message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", key, message)
    return message


def prepare(config: Config) -> None:
    """Tokenizes each hf:<path> source the cache lacks (process 0), before training."""
    paths = hf_paths(config)
    if not paths:
        return
    from paisoar_jax.tools import convert  # tokenizers and datasets: only when needed

    for key, path, data in paths:
        directory = hf_cache_directory(data, path)
        if jax.process_index() == 0 and not (directory / MANIFEST_NAME).is_file():
            arguments = ["text", "--from-hf", path, "--split", data.hf_split]
            arguments += ["--format", data.hf_format, "--tokenizer", data.tokenizer or "byte"]
            arguments += _field_arguments(data.hf_format, data.hf_field)
            arguments += ["--output", str(directory), "--overwrite", "--no-progress"]
            try:
                summary = convert.convert_text(convert.build_parser().parse_args(arguments))
            except UserError as error:  # convert's words for its flags, as this run's keys
                raise UserError(_as_keys(str(error))) from None
            except OSError as error:
                raise UserError(
                    f"data.cache_dir: cannot write {directory} ({error.strerror or error}): set "
                    f"data.cache_dir to a writable directory"
                ) from None
            output.note(f"{key}=hf:{path}, tokenized once for this and later runs: {summary}")
    if jax.process_count() > 1:
        wait_for_everyone(f"paisoar_jax.hf_sources.{next(_BARRIERS)}")
        for key, path, data in paths:
            directory = hf_cache_directory(data, path)
            if not (directory / MANIFEST_NAME).is_file():
                raise UserError(
                    f"{key}=hf:{path}: process 0 tokenized it into {directory}, which "
                    f"process {jax.process_index()} cannot see: set data.cache_dir to a "
                    f"directory every host shares"
                )
