import itertools
import json
import time

import jax
import numpy as np
import pytest

from paisoar_jax.config import DataConfig, LanguageModelConfig, MeshConfig
from paisoar_jax.data.images import image_batches
from paisoar_jax.data.pipeline import (
    READ_AHEAD_BATCHES,
    GlobalBatches,
    PerExampleReads,
    WholeBatchReads,
    batch_dataset,
    dataset_identity,
    example_stream,
)
from paisoar_jax.data.prefetch import DevicePrefetcher
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.data.small_images import SyntheticImages
from paisoar_jax.data.sources import (
    EMBEDDED_EVAL_BYTES,
    SyntheticWindows,
    TokenWindows,
    embedded_corpus,
    open_source,
)
from paisoar_jax.data.user_data import _Rows
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus(0.05)


def test_embedded_corpus_is_real_python_and_split_stably(corpus):
    train, held_out = corpus
    assert train.dtype == np.uint8 and len(train) > 1_000_000
    assert len(held_out) == EMBEDDED_EVAL_BYTES  # the first of the held-out files, not all
    assert b"def " in train[:100_000].tobytes() and b"import" in held_out.tobytes()
    again_train, again_eval = embedded_corpus(0.05)
    assert np.array_equal(again_train, train) and np.array_equal(again_eval, held_out)


def test_windows_are_inputs_plus_shifted_targets():
    windows = TokenWindows(np.arange(100, dtype=np.uint8), seq_len=8)
    assert len(windows) == 12
    np.testing.assert_array_equal(windows[1], np.arange(8, 17))
    assert windows[1].dtype == np.int32


def first_batches(source, count, **kwargs):
    return [batch for batch in itertools.islice(iter(batch_dataset(source, **kwargs)), count)]


def test_same_seed_same_batches_and_new_order_each_epoch():
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)  # 40 windows
    one = first_batches(source, 20, global_batch=4, seed=3)
    two = first_batches(source, 20, global_batch=4, seed=3)
    other = first_batches(source, 20, global_batch=4, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(one, two, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(one, other, strict=True))
    epoch_one, epoch_two = np.concatenate(one[:10]), np.concatenate(one[10:])
    starts = lambda batches: sorted(int(row[0]) for row in batches)
    assert starts(epoch_one) == starts(epoch_two) == list(range(0, 320, 8))  # each once
    assert not np.array_equal(epoch_one[:, 0], epoch_two[:, 0])  # but reshuffled


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_read_exactly_their_rows_of_each_global_batch(processes):
    # 40 windows in batches of 12: epochs end inside batches 3 and 6 (at examples 40 and 80).
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    single = first_batches(source, 8, global_batch=12, seed=0)
    shares = [
        first_batches(source, 8, global_batch=12, seed=0, process_index=p, process_count=processes)
        for p in range(processes)
    ]
    for step, whole in enumerate(single):
        rows = [share[step] for share in shares]
        assert all(len(part) == 12 // processes for part in rows)
        np.testing.assert_array_equal(np.concatenate(rows), whole)  # the global batch, in order
    starts = np.concatenate(single)[:, 0].tolist()
    assert sorted(starts[:40]) == sorted(starts[40:80]) == list(range(0, 320, 8))  # each once


def test_resume_continues_after_the_examples_consumed_on_any_process_count():
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    uninterrupted = first_batches(source, 9, global_batch=8, seed=4)
    two_process = [
        batch_dataset(source, global_batch=8, seed=4, process_index=p, process_count=2)
        for p in range(2)
    ]
    for share in two_process:
        for _ in range(5):
            next(share)
    states = [share.get_state() for share in two_process]
    assert states[0] == states[1]  # the position is global
    assert states[0]["examples"] == 40 and states[0]["epoch"] == 1
    resumed = batch_dataset(source, global_batch=8, seed=4)  # now on one process
    resumed.set_state(json.loads(json.dumps(states[0])))
    for wanted in uninterrupted[5:]:
        np.testing.assert_array_equal(next(resumed), wanted)


@pytest.mark.parametrize("shuffle", [pytest.param(True, marks=pytest.mark.slow), False])
def test_whole_batch_reads_follow_grain_s_own_order(shuffle):
    """Sources with read_batch take the one-read-per-batch path; it must give exactly the
    batches of grain's per-example shuffle, repeat and batch (epochs and offsets included)."""
    windows = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    synthetic = SyntheticWindows(vocab_size=50, seq_len=4, seed=3)
    rows = _Rows({"x": np.arange(60).reshape(30, 2), "y": np.arange(30)}, "data")
    for source in (windows, synthetic, rows):
        for process in range(2):
            options = dict(global_batch=12, seed=9, process_index=process, process_count=2)
            fast = batch_dataset(source, shuffle=shuffle, **options)
            assert isinstance(fast.reads, WholeBatchReads)
            slow = GlobalBatches(
                PerExampleReads(example_stream(source, 9, shuffle)), source=source, **options
            )
            for start in (0, 7):  # whole batches of rows, then a position that is not
                fast.set_state({"examples": start})
                slow.set_state({"examples": start})
                for _ in range(9):  # past several epochs of the 30- and 40-example sources
                    jax.tree.map(np.testing.assert_array_equal, next(fast), next(slow))


def test_dataset_identity_tells_changed_data_apart():
    tokens = np.arange(8 * 40 + 1, dtype=np.int32)
    identity = dataset_identity(TokenWindows(tokens, seq_len=8))
    assert identity == dataset_identity(TokenWindows(tokens.copy(), seq_len=8))
    assert identity["size"] == 40
    changed = tokens.copy()
    changed[0] = 7
    assert (
        dataset_identity(TokenWindows(changed, seq_len=8))["fingerprint"] != identity["fingerprint"]
    )
    assert dataset_identity(TokenWindows(tokens[:-8], seq_len=8))["size"] == 39


def test_workers_give_the_same_batches():
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    plain = first_batches(source, 6, global_batch=4, seed=1)
    workers = first_batches(source, 6, global_batch=4, seed=1, workers=1)
    assert all(np.array_equal(a, b) for a, b in zip(plain, workers, strict=True))


class CountedImages(SyntheticImages):
    """Synthetic images that count the examples read (grain's reader threads share it)."""

    reads = 0

    def __getitem__(self, index: int) -> dict:
        CountedImages.reads += 1
        return super().__getitem__(index)


def test_a_file_source_is_read_a_few_batches_ahead_not_grains_500():
    # Grain's default read-ahead counts elements, which are our whole batches: a worker
    # of the resnet50 config held 500 x 256 images (19 GB) and was killed on the H200.
    source = CountedImages(image_size=8, channels=3, num_classes=10, seed=0)
    CountedImages.reads = 0  # this run's reads alone
    batches = image_batches(source, global_batch=16, seed=0, image_size=8, train=True)
    next(batches)
    time.sleep(0.5)  # the reader threads run ahead as far as they are let
    assert 16 < CountedImages.reads <= 16 * (READ_AHEAD_BATCHES + 2)


def test_prefetched_arrays_carry_the_batch_sharding(devices):
    mesh = sharding.build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    host = first_batches(source, 3, global_batch=8, seed=0)
    prefetcher = DevicePrefetcher(iter(host), sharding.batch_sharding(mesh), depth=2)
    arrays = list(prefetcher)
    assert len(arrays) == 3
    for array, expected in zip(arrays, host, strict=True):
        assert array.sharding.is_equivalent_to(sharding.batch_sharding(mesh), 2)
        assert array.addressable_shards[0].data.shape == (2, 9)  # 8 rows over 4 batch shards
        np.testing.assert_array_equal(jax.device_get(array), expected)
    prefetcher.close()


def test_prefetcher_reraises_producer_errors(devices):
    mesh = sharding.build_mesh(MeshConfig(data=1), devices[:1])

    def broken():
        yield np.zeros((2, 3), np.int32)
        raise RuntimeError("disk on fire")

    prefetcher = DevicePrefetcher(broken(), sharding.batch_sharding(mesh), depth=1)
    next(prefetcher)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(prefetcher)


def test_source_errors():
    with pytest.raises(UserError, match="data.source='hdfs:/x' is not one of embedded"):
        open_source(DataConfig(source="hdfs:/x"), LanguageModelConfig(), 0)
    with pytest.raises(UserError, match="arrayrecord:/no/such: no such file or directory"):
        open_source(DataConfig(source="arrayrecord:/no/such"), LanguageModelConfig(), 0)
    with pytest.raises(UserError, match="holds images, and model.name=gpt reads tokens"):
        open_source(DataConfig(source="images:/x"), LanguageModelConfig(), 0)
    with pytest.raises(UserError, match="needs model.vocab_size >= 256"):
        open_source(DataConfig(), LanguageModelConfig(vocab_size=100), 0)
    with pytest.raises(UserError, match="longer than the embedded eval split"):
        open_source(DataConfig(eval_fraction=0.0001), LanguageModelConfig(seq_len=1 << 22), 0)


def test_arrayrecord_source_packs_windows_with_a_held_out_tail(token_dataset):
    data = DataConfig(source=f"arrayrecord:{token_dataset}", eval_fraction=0.1)
    train, held_out = open_source(data, LanguageModelConfig(seq_len=64), 0)
    total = len(train) + len(held_out)
    assert total == (TokenRecords(token_dataset).token_count - 1) // 64
    assert len(held_out) == round(total * 0.1)
    assert np.array_equal(train[1][:1], train[0][-1:])  # windows share the boundary token
    assert held_out[0][0] == train[len(train) - 1][-1]
    assert b"import" in bytes(np.concatenate([train[i] for i in range(20)]).astype(np.uint8))
    shards = DataConfig(source=f"arrayrecord:{token_dataset}/*.array_record")
    assert len(open_source(shards, LanguageModelConfig(seq_len=64), 0)[0]) == len(
        open_source(
            DataConfig(source=f"arrayrecord:{token_dataset}"), LanguageModelConfig(seq_len=64), 0
        )[0]
    )


@pytest.mark.parametrize(
    "data, model, message",
    [
        ({}, {"vocab_size": 100}, "has vocab size 256 (byte) but model.vocab_size=100"),
        ({"tokenizer": "gpt2.json"}, {}, "data.tokenizer=gpt2.json but"),
        ({}, {"seq_len": 1 << 20}, "model.seq_len=1048576 is longer than the data"),
        ({"eval_fraction": 0.99999}, {}, "leaves an empty train or eval split"),
    ],
)
def test_dataset_that_disagrees_with_the_model_is_refused(token_dataset, data, model, message):
    config = DataConfig(source=f"arrayrecord:{token_dataset}", **data)
    with pytest.raises(UserError) as error:
        open_source(config, LanguageModelConfig(**model), 0)
    assert message in str(error.value)


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_iterator_state_resumes_at_exactly_the_next_batch(devices, workers):
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    options = dict(global_batch=4, seed=2, workers=workers)
    uninterrupted = first_batches(source, 16, **options)
    mesh = sharding.build_mesh(MeshConfig(data=1), devices[:1])
    # The prefetcher reads ahead; the state it reports is the one after the last batch used.
    prefetcher = DevicePrefetcher(
        iter(batch_dataset(source, **options)), sharding.batch_sharding(mesh), depth=3
    )
    consumed = [jax.device_get(next(prefetcher)) for _ in range(13)]  # past an epoch (10)
    state = json.loads(json.dumps(prefetcher.consumed_state()))  # as a checkpoint holds it
    prefetcher.close()
    resumed = iter(batch_dataset(source, **options))
    resumed.set_state(state)
    rest = [next(resumed) for _ in range(3)]
    if hasattr(resumed, "close"):
        resumed.close()
    for got, wanted in zip(consumed + rest, uninterrupted, strict=True):
        np.testing.assert_array_equal(got, wanted)


def test_synthetic_source_is_reproducible():
    train, held_out = open_source(
        DataConfig(source="synthetic"), LanguageModelConfig(vocab_size=1000), 5
    )
    np.testing.assert_array_equal(train[7], train[7])
    assert train[7].max() < 1000 and train[7].shape == (129,)
    assert not np.array_equal(train[7], held_out[7])


def test_a_batch_that_does_not_split_over_the_processes_is_a_user_error():
    source = TokenWindows(np.arange(81, dtype=np.int32), seq_len=8)
    with pytest.raises(UserError, match="does not split evenly over 2 processes"):
        batch_dataset(source, global_batch=3, seed=0, process_index=1, process_count=2)


def test_another_global_batch_goes_on_from_the_first_example_not_yet_trained():
    """A resume with train.global_batch 8 -> 16 (on two processes): none skipped or repeated."""
    source = TokenWindows(np.arange(8 * 40 + 1, dtype=np.int32), seq_len=8)
    uninterrupted = np.concatenate(first_batches(source, 10, global_batch=8, seed=4))
    before = batch_dataset(source, global_batch=8, seed=4)
    for _ in range(5):
        next(before)
    position = json.loads(json.dumps(before.get_state()))
    shares = [
        batch_dataset(source, global_batch=16, seed=4, process_index=p, process_count=2)
        for p in range(2)
    ]
    for share in shares:
        share.set_state(position)
    after = [np.concatenate([next(share) for share in shares]) for _ in range(3)]
    np.testing.assert_array_equal(np.concatenate(after)[:40], uninterrupted[40:80])
    assert shares[0].get_state()["examples"] == 40 + 3 * 16
