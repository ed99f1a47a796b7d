"""Hugging Face `datasets` as text to tokenize (`convert text --from-hf`, `data.source=hf:`).

Local, never the hub. A directory written by `Dataset.save_to_disk` (or a DatasetDict's,
whose split is read) is opened with `datasets.load_from_disk`; other local data files
(.jsonl, .json, .parquet, .csv, .txt: a file or a directory of them) are loaded through
`datasets.load_dataset` with the builder their suffix names. The hub is switched off
(HF_DATASETS_OFFLINE, HF_HUB_OFFLINE), so nothing is downloaded or asked for. Each row is
one record, as a .jsonl line is to `convert text`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from paisoar_jax.errors import FLAG_NAMES, SettingNames, UserError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def rows(
    path: pathlib.Path, split: str = "train", names: SettingNames = FLAG_NAMES
) -> Iterator[tuple[Any, str]]:
    """(row as a dict, where) of each row of the dataset at `path` (its `split`)."""
    with unreadable_as_one_line(path):
        dataset = open_dataset(path, split, names)
        for index, row in enumerate(dataset):
            yield row, f"{path}[{index}]"


@contextlib.contextmanager
def unreadable_as_one_line(path: pathlib.Path) -> Iterator[None]:
    """A file `datasets` or Arrow cannot read (bad JSON, a damaged .arrow) as a UserError."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:  # datasets' and pyarrow's own errors, of many types
        cause = error.__cause__ or error
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise UserError(
            f"{path}: datasets cannot read it ({type(cause).__name__}: {first})"
        ) from None


def open_dataset(path: pathlib.Path, split: str = "train", names: SettingNames = FLAG_NAMES):
    """The `datasets.Dataset` at `path`: saved with save_to_disk, or local data files.

    `names`: how errors name the `from_hf` and `split` settings.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local only: no hub, no download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{path}: reading a Hugging Face dataset needs datasets: "
            f'pip install "paisoar-jax[datasets]"'
        ) from None
    if not path.exists():
        raise UserError(f"{names('from_hf', path)}: no such directory or file")
    datasets.disable_progress_bars()  # the conversion prints its own summary
    if path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise UserError(
                    f"{path} has no split {split!r} (its splits: {', '.join(loaded)}): "
                    f"name one with {names('split')}"
                )
            loaded = loaded[split]
        return loaded
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    files = [file for file in files if file.is_file() and file.suffix in BUILDERS]
    builders = {BUILDERS[file.suffix] for file in files}
    if len(builders) != 1:
        what = "no" if not builders else "several kinds of"
        raise UserError(
            f"{path} holds {what} data files datasets reads ({', '.join(sorted(BUILDERS))}), "
            f"and is not a directory written by save_to_disk"
        )
    return datasets.load_dataset(
        builders.pop(), data_files=[str(file) for file in files], split="train"
    )
