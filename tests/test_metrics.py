import json

import pytest

from paisoar_jax.metrics import MetricsWriter, device_peak_tflops, mfu


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
