"""The DPO page's commands and Python, as written, on a tiny imported Llama (docs/how-to/dpo.md)."""

import json
import os

import numpy as np
import pytest
from conftest import WORDS, run_records, tiny_llama_import
from doc_blocks import command_lines, doc_block
from test_doc_blocks_slow import run_line
from test_preference import dpo_run, imported  # noqa: F401 (the module fixture)

TINY_RUN = [
    "train.steps=3",
    "train.log_every=1",
    "train.global_batch=8",
    "model.seq_len=32",
    "train.eval_every=0",
]
TINY_RUN += ["data.eval_fraction=0", "run.progress=false", "run.tensorboard=false"]


def test_the_dpo_page_runs(tmp_path):
    tiny_llama_import(tmp_path)
    rng = np.random.default_rng(0)
    lines = [
        {
            "prompt": " ".join(rng.choice(WORDS, 3)),
            "chosen": " " + " ".join(rng.choice(WORDS, 2)),
            "rejected": " " + " ".join(rng.choice(WORDS, 2)),
        }
        for _ in range(16)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    convert, train = command_lines(doc_block("dpo-sequence"))
    run_line(convert, tmp_path)
    run_line(train, tmp_path, TINY_RUN)
    records = [record for record in run_records(tmp_path / "runs" / "dpo") if "loss" in record]
    assert (
        records[0]["loss"] == np.log(2).astype(np.float32)
        or abs(records[0]["loss"] - np.log(2)) < 1e-6
    )
    assert {"rewards/accuracies", "logps/chosen"} <= set(records[0])
    assert (tmp_path / "runs" / "dpo" / "reference_logps.npz").is_file()
    program = doc_block("dpo-python").text.replace(
        '"run.dir=runs/dpo-python"',
        ", ".join(f'"{key}"' for key in ["run.dir=runs/dpo-python", *TINY_RUN]),
    )
    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        names = {}
        exec(program, names)  # the page's Python, as written, on this import
    finally:
        os.chdir(previous)
    assert names["result"].steps == 3 and abs(names["result"].first_loss - np.log(2)) < 1e-6


def test_meshes_accumulation_and_packing_give_the_same_steps(imported):  # noqa: F811
    """fsdp x tensor x data with 2 micro-batches and pairs packed: the losses of data=8."""
    root, _, _ = imported
    plain = dpo_run(root, "plain")
    sharded = dpo_run(
        root,
        "sharded",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.grad_accum=2",
    )
    for mine, reference in zip(sharded, plain, strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    # Packed: the 8 pairs two a row of 32 tokens, attention within each pair's documents.
    packed = dpo_run(
        root,
        "packed",
        "data.packing=documents",
        "model.seq_len=32",
        "train.global_batch=4",
        "mesh.data=4",
        "mesh.tensor=2",
    )
    for mine, reference in zip(packed, plain, strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
