"""`data.source=hf:PATH` (paisoar_jax/data/hf_sources.py): a `datasets` directory is
tokenized once on first use, then trains and resumes as a converted dataset does."""

import shutil

import datasets
import numpy as np
import pytest
from conftest import resumable_run, task_for

from paisoar_jax.config import load_config
from paisoar_jax.data import hf_sources
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.data.sources import hf_cache_directory, open_source
from paisoar_jax.errors import UserError
from paisoar_jax.tools import convert

ROWS = [{"text": f"def add_{i}(x):\n    return x + {i}\n" * (i % 3 + 1)} for i in range(300)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A `datasets` Dataset written with save_to_disk."""
    path = tmp_path_factory.mktemp("hf") / "functions"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    return path


def settings(saved, cache):
    return [f"data.source=hf:{saved}", f"data.cache_dir={cache}"]


def test_a_datasets_directory_trains_and_resumes_exactly(saved, tmp_path, capsys):
    config = load_config(None, settings(saved, tmp_path / "cache"))
    with pytest.raises(UserError, match="is not tokenized yet: `python -m paisoar_jax.train`"):
        open_source(config.data, config.model, 0)
    task_for(config).open_sources()  # the task tokenizes it when it opens it
    directory = hf_cache_directory(config.data, str(saved))
    assert "tokenized once for this and later runs" in capsys.readouterr().out
    # the same tokens as `convert text --from-hf` writes
    assert (
        convert.main(["text", "--from-hf", str(saved), "--output", str(tmp_path / "by_hand")]) == 0
    )
    cached, by_hand = TokenRecords(directory), TokenRecords(tmp_path / "by_hand")
    assert np.array_equal(cached.read(0, cached.token_count), by_hand.read(0, by_hand.token_count))
    whole = resumable_run(tmp_path / "whole", settings(saved, tmp_path / "cache"), 6)
    resumable_run(tmp_path / "cut", settings(saved, tmp_path / "cache"), 3)
    hf_sources.prepare(config.data)  # a second run reads the cache as it is
    assert capsys.readouterr().out.count("tokenized once") == 0
    assert resumable_run(tmp_path / "cut", settings(saved, tmp_path / "cache"), 6) == whole


def test_a_missing_dataset_is_one_line_naming_its_key(tmp_path):
    nothing = tmp_path / "nothing"
    for key, setting in [
        ("data.source", f"data.source=hf:{nothing}"),
        ("data.eval_source", f"data.eval_source=hf:{nothing}"),
        (r"data.eval_sets\[gone\]", f"data.eval_sets=[[hf:{nothing},2,gone]]"),
    ]:
        with pytest.raises(UserError, match=f"^{key}=hf:.*nothing: no such directory or file"):
            hf_sources.prepare(load_config(None, [setting]).data)


def test_bad_datasets_and_settings_are_one_line_naming_the_keys(saved, tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{bad json\n')
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    for arrow in damaged.glob("*.arrow"):
        arrow.write_bytes(b"")
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:20])}).save_to_disk(splits)
    eval_split = [f"data.eval_source=hf:{splits}", "data.eval_hf_split=valid"]
    cases = [
        ([f"data.source=hf:{saved}", *eval_split], "name one with data.eval_hf_split"),
        (  # a named eval set is tokenized (and read) as data.eval_source is
            [f"data.source=hf:{saved}", f"data.eval_sets=[[hf:{splits},2,v]]", eval_split[1]],
            r"splits has no split 'valid' .*: name one with data.eval_sets\[v\]'s hf_split or",
        ),
        ([f"data.source=hf:{saved}", "data.hf_format=chat"], "data.hf_format=chat needs a"),
        ([f"data.source=hf:{tmp_path / 'broken.jsonl'}"], "broken.jsonl: datasets cannot read it"),
        ([f"data.source=hf:{damaged}"], "damaged: datasets cannot read it"),
        ([f"data.source=hf:{saved}", "data.hf_field=body"], "set data.hf_field"),
        ([f"data.source=hf:{saved}", "data.cache_dir=/dev/null/cache"], "data.cache_dir: cannot"),
    ]
    for overrides, message in cases:
        config = load_config(None, [f"data.cache_dir={tmp_path / 'cache'}", *overrides])
        with pytest.raises(UserError, match=message) as error:
            hf_sources.prepare(config.data)
        assert "\n" not in str(error.value) and "--" not in str(error.value), error.value


def test_an_instruction_dataset_names_its_two_columns(tmp_path):
    rows = [{"question": f"{i} + 1 =", "answer": f" {i + 1}"} for i in range(50)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sums"))
    overrides = [f"data.source=hf:{tmp_path / 'sums'}", f"data.cache_dir={tmp_path / 'cache'}"]
    overrides += ["data.hf_format=instruction", "data.hf_field=question,answer"]
    config = load_config(None, [*overrides, "data.loss_on=response"])
    hf_sources.prepare(config.data)
    records = TokenRecords(hf_cache_directory(config.data, str(tmp_path / "sums")))
    tokens, mask = records.read_with_mask(0, records.token_count)
    learned = bytes(tokens[mask.astype(bool)].astype(np.uint8)).decode()
    assert learned.startswith(" 1\0 2\0 3\0")  # the answers (and their end) alone are learned


def test_a_separate_eval_set_is_read_whole_from_its_own_split(tmp_path, capsys):
    """data.eval_source: eval reads all of another split (here a DatasetDict's validation),
    and data.source is trained on whole, not less data.eval_fraction."""
    from conftest import TINY, run_records, train

    splits = {"train": ROWS[:240], "validation": [{"text": "x = 'held out'\n" * 40}] * 20}
    splits = datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    overrides = [f"data.source=hf:{tmp_path / 'splits'}", f"data.cache_dir={tmp_path / 'cache'}"]
    overrides += [f"data.eval_source=hf:{tmp_path / 'splits'}", "data.eval_hf_split=validation"]
    overrides += [*TINY, "train.steps=2", "train.eval_every=2", f"run.dir={tmp_path / 'run'}"]
    config = load_config(None, overrides)
    hf_sources.prepare(config.data)
    assert "data.eval_source=hf:" in capsys.readouterr().out  # tokenized once, on its own
    train_windows, (eval_set,) = task_for(config).open_sources()
    eval_windows = eval_set.source
    apart = [
        TokenRecords(hf_cache_directory(data, str(tmp_path / "splits")))
        for data in (config.data, config.data.eval_side())
    ]
    seq_len = config.model.seq_len
    assert len(train_windows) == (apart[0].token_count - 1) // seq_len  # no windows held out
    assert len(eval_windows) == (apart[1].token_count - 1) // seq_len  # all of validation
    assert bytes(eval_windows[0][:14].astype(np.uint8)) == b"x = 'held out'"
    # The same split again as a named set, read from the set's own hf_split
    named = f"data.eval_sets=[[hf:{tmp_path / 'splits'},0,again,validation]]"
    summary = train(load_config(None, [*overrides, "data.eval_hf_split=train", named]))
    assert "eval_loss" in run_records(tmp_path / "run")[-1]
    assert summary["eval_again_loss"] != summary["eval_loss"]  # train split against validation
    summary = train(load_config(None, [*overrides, named, f"run.dir={tmp_path / 'again'}"]))
    assert summary["eval_again_loss"] == summary["eval_loss"]
    with pytest.raises(UserError, match="data.eval_source holds token eval sets"):
        load_config(None, ["model.name=resnet", "data.eval_source=synthetic"])
