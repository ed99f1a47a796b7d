import json

import pytest

from paisoar_jax.observe.metrics import MetricsWriter, device_peak_tflops, mfu


def test_mfu_against_the_peak_of_all_devices(devices):
    # 8 CPU devices at a configured 100 TFLOP/s each: 8e14 FLOP/s in all.
    assert mfu(1e6, 4e8, 100.0) == pytest.approx(0.5)
    assert mfu(1e6, 4e8, None) is None


def test_peak_lookup(devices):
    assert device_peak_tflops(123.0) == 123.0
    assert device_peak_tflops() is None  # CPU devices have no known peak


def test_writer_writes_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path / "run", tensorboard=True)
    writer.write({"step": 1, "loss": 2.5, "mfu": None})
    writer.write({"step": 2, "loss": 2.0, "mfu": None})
    writer.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 2.5, "mfu": None},
        {"step": 2, "loss": 2.0, "mfu": None},
    ]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def tensorboard_events(directory):
    """Every event of the TensorBoard files in `directory`, in order (TFRecord framing:
    a length, its crc, the event's bytes, their crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position < len(data):
            length = int.from_bytes(data[position : position + 8], "little")
            events.append(event_pb2.Event.FromString(data[position + 12 : position + 12 + length]))
            position += 12 + length + 4
    return events


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    """Before: steps logged after the checkpoint showed twice once the run resumed."""
    from paisoar_jax.config import load_config, to_dict

    config = load_config(None, ["run.trackers=[tensorboard]"])
    first = MetricsWriter(tmp_path, reporting=config.run, record=to_dict(config))
    for step in (1, 2, 3, 4):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = MetricsWriter(  # killed after step 4
        tmp_path, resume_step=2, reporting=config.run, record=to_dict(config)
    )
    for step in (3, 4, 5):
        resumed.write({"step": step, "loss": float(step)})
    resumed.close()
    events = tensorboard_events(tmp_path / "tensorboard")
    # TensorBoard hides what the file before holds from the purge step on.
    purges = [event.step for event in events if event.HasField("session_log")]
    assert purges == [3]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()] == [
        1, 2, 3, 4, 5,
    ]  # fmt: skip


def test_every_field_a_run_records_is_in_the_documented_table(tmp_path):
    """RECORD_FIELDS (the docs' metrics.jsonl reference) names each field real runs write:
    a language model with its evals, and an image classifier's metrics."""
    import re

    from conftest import TINY, TINY_RESNET, run_records, train

    from paisoar_jax.config import load_config
    from paisoar_jax.observe.metrics import RECORD_FIELDS

    patterns = [
        re.compile(
            "^"
            + re.sub(
                r"<[a-z ]+>", "[^/]+", re.escape(field).replace(r"\<", "<").replace(r"\>", ">")
            )
            + "$"
        )
        for field in RECORD_FIELDS
        if field != "<metric>"  # the task's own metrics, checked by name below
    ]
    runs = {"lm": [*TINY, "train.eval_every=2"], "images": [*TINY_RESNET, "train.eval_every=2"]}
    for name, overrides in runs.items():
        run_dir = tmp_path / name
        settings = [*overrides, "train.steps=2", "train.log_every=1", f"run.dir={run_dir}"]
        train(load_config(None, [*settings, "checkpoint.enabled=false"]))
        metrics = {"accuracy"} if name == "images" else set()
        for record in run_records(run_dir):
            for key in record:
                known = key in metrics or any(pattern.match(key) for pattern in patterns)
                assert known, (name, key)
