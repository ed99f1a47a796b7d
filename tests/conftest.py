"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared helpers."""

import os
import pathlib
import shutil
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile once per test run: every test and every `python -m paisoar_jax.*` child shares one
# persistent compilation cache in a folder of this run (removed at its end), so a program
# that several tests build compiles once. PAISOAR_TEST_CACHE names a folder to keep instead
# (a developer's warm reruns); the README's timings are cold, without it. A folder already
# in JAX_COMPILATION_CACHE_DIR is used and kept: a user's own, or the run's folder that
# pytest-xdist's workers inherit from the process that started them (which removes it).
KEEP_CACHE = "PAISOAR_TEST_CACHE" in os.environ or "JAX_COMPILATION_CACHE_DIR" in os.environ
CACHE_DIR = pathlib.Path(
    os.environ.get("PAISOAR_TEST_CACHE")
    or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    or tempfile.mkdtemp(prefix="paisoar-cache-")
)
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import absl.flags  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# grain worker processes read absl flags; they must count as parsed once jax is imported.
absl.flags.FLAGS.mark_as_parsed()

REPO = pathlib.Path(__file__).resolve().parents[1]

# A model small enough to compile in seconds, big enough for every mesh in the tests
# (width and MLP divide by 8, heads by 2).
TINY = [
    "model.seq_len=32",
    "model.layers=2",
    "model.width=64",
    "model.heads=4",
    "train.global_batch=16",
    "train.sample_bytes=0",
    "run.progress=false",
    "run.tensorboard=false",
]

# TINY logged every step, saved every 2, no eval, a constant lr: a run cut at step k and
# resumed follows the schedule of one run never cut (the launch, restart and cluster tests).
RESUMABLE = [
    *TINY,
    "train.log_every=1",
    "train.eval_every=0",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "checkpoint.every=2",
    "checkpoint.keep=10",
]

# The settings of `paisoar_jax.fit` tests with a model of one's own.
FIT_BASE = [
    "train.global_batch=16",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.warmup_steps=0",
    "run.progress=false",
    "run.tensorboard=false",
]

# The image counterpart: a ResNet-18 with 8 base channels on 16 px synthetic images.
TINY_RESNET = [
    "model.name=resnet",
    "model.variant=resnet18",
    "model.width=8",
    "model.image_size=16",
    "model.num_classes=10",
    "data.source=synthetic",
    "optim.name=sgd",
    "optim.lr=0.1",
    "train.global_batch=16",
    "run.progress=false",
    "run.tensorboard=false",
]


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m paisoar_jax.*` children: 8 CPU devices, shared cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def pytest_addoption(parser):
    parser.addoption(
        "--all", action="store_true", help="run both tiers: the fast suite and the slow tests"
    )


# For the fast tier only: the CPU backend's code generated without LLVM's optimisations.
# Its programs are tiny and compiled once or twice each, so compiling is most of their time:
# this cuts the tier by a quarter. The slow tier keeps the defaults: it runs hundreds of
# steps, and XLA CPU's in-process collectives, slower unoptimised, can miss their rendezvous
# deadline on a loaded machine and abort. Users' runs never see it.
FAST_TIER_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    # Before any test touches a device (the backend reads XLA_FLAGS when it starts); the
    # `python -m paisoar_jax.*` children inherit it.
    if _fast_tier_only(config) and FAST_TIER_XLA_FLAGS not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + FAST_TIER_XLA_FLAGS


TESTS = pathlib.Path(__file__).resolve().parent
# The tiers are folders: tests/<wing>/ and tests/end_to_end/ are the fast tier (the README's
# command), tests/slow/ the second tier (-m slow or --all), tests/gpu_aot/ the compiles for a
# GPU target (-m gpu_aot, with the gpu-aot extra's CUDA plugin). Their tests get the mark of
# their folder here, so `-m slow` and `-m gpu_aot` select them.
TIER_FOLDERS = {"slow": TESTS / "slow", "gpu_aot": TESTS / "gpu_aot"}
# Test modules import helpers from their fast-tier twin (tests/slow/engine/test_step_slow.py
# from tests/engine/test_step.py): every test folder is importable whatever the order.
for _folder in sorted(TESTS.rglob("*")):
    if _folder.is_dir() and _folder.name != "__pycache__" and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def _names_its_tier(config, tier: str) -> bool:
    """Whether the command line names a test by id, or a file or folder of `tier`."""
    for argument in config.args:
        if "::" in argument:
            return True
        path = pathlib.Path(argument.split("::")[0]).resolve()
        if path == TIER_FOLDERS[tier] or TIER_FOLDERS[tier] in path.parents:
            return True
    return False


def _fast_tier_only(config) -> bool:
    asked = config.getoption("--all") or config.getoption("markexpr")
    return not (asked or _names_its_tier(config, "slow"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The fast tier by default: the tests in tests/slow/ run with -m slow or --all (or named).

    The tests in tests/gpu_aot/ (compiles for a GPU target: they need the gpu-aot extra's
    CUDA plugin) run only when asked for, with -m gpu_aot (or named).
    """
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        for mark, folder in TIER_FOLDERS.items():
            if folder in path.parents:
                item.add_marker(getattr(pytest.mark, mark))
    wants_gpu = "gpu_aot" in (config.getoption("markexpr") or "")
    if not (wants_gpu or _names_its_tier(config, "gpu_aot")):
        gpu = [item for item in items if item.get_closest_marker("gpu_aot")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu_aot")]
    if not _fast_tier_only(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_sessionfinish(session, exitstatus):
    if not KEEP_CACHE:
        shutil.rmtree(CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devices = jax.devices()
    assert len(devices) == 8, "tests expect 8 simulated CPU devices"
    return devices


PYTHON = sys.executable


def run_module(module, *args, cwd, timeout=300):
    """Runs `python -m paisoar_jax.<module> args...` as a user would; the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [PYTHON, "-m", f"paisoar_jax.{module}", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_modules(commands, cwd, timeout=300):
    """Runs several `python -m paisoar_jax.<module> args...` at once; their CompletedProcesses.

    For refusals: each process spends its time starting Python and jax, so the cores
    start many of them side by side in the time of a few. Each runs in its own folder of
    `cwd` (0/, 1/, ...), as it would alone.
    """
    import subprocess

    processes = []
    try:
        for index, (module, *args) in enumerate(commands):
            folder = pathlib.Path(cwd) / str(index)
            folder.mkdir()
            processes.append(
                subprocess.Popen(
                    [PYTHON, "-m", f"paisoar_jax.{module}", *args],
                    cwd=folder,
                    env=subprocess_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            status = process.returncode
            results.append(subprocess.CompletedProcess(process.args, status, stdout, stderr))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def train(config, workload=None):
    """The summary of a run of `config` in this process (the loop's `run`, as the CLI runs)."""
    from paisoar_jax.run.loop import run

    return run(config, workload).summary


def task_for(config):
    """The task of `config`'s zoo model."""
    from paisoar_jax.tasks.zoo import zoo_workload

    return zoo_workload(config).task


def plan_run(overrides, devices, base=TINY):
    """(config, mesh, layout, lr_schedule) for TINY + overrides on `devices`: no arrays yet."""
    from paisoar_jax.config import load_config
    from paisoar_jax.run.setup import setup
    from paisoar_jax.tasks.zoo import zoo_workload

    config = load_config(None, list(base) + list(overrides))
    run = setup(config, zoo_workload(config), devices)
    return config, run.mesh, run.layout, run.lr_schedule


def build_run(overrides, devices, base=TINY):
    """(config, mesh, layout, state, train_step) for TINY + overrides on `devices`."""
    from paisoar_jax.engine.state import init_state
    from paisoar_jax.engine.step import jit_train_step

    config, mesh, layout, schedule = plan_run(overrides, devices, base)
    with jax.set_mesh(mesh):
        state = init_state(config.train.seed, layout)
        task = task_for(config)
        train_step = jit_train_step(layout, task, schedule, config.train.grad_accum, mesh)
    return config, mesh, layout, state, train_step


def step_losses(overrides, devices, steps=3):
    """(the losses of `steps` train steps on token_batches, (initial, final) params)."""
    _, _, _, state, train_step = build_run(overrides, devices)
    initial, values = jax.device_get(state.params), []
    for batch in token_batches(steps):
        state, metrics = train_step(state, batch)
        values.append(float(metrics["loss"]))
    return values, (initial, jax.device_get(state.params))


def losses(run_dir, steps=None) -> dict:
    """{step: loss} of run_dir/metrics.jsonl; with `steps`, it must hold 1 .. steps once each."""
    records = run_records(run_dir)
    if steps is not None:
        assert [record["step"] for record in records] == list(range(1, steps + 1))
    return {record["step"]: record["loss"] for record in records}


def resumable_run(run_dir, overrides, steps, *, process=False):
    """{step: loss} of a TINY + overrides run to `steps` in run_dir (resuming what is there).

    It logs every step and saves every 3, with a constant learning rate, so a run cut at 3
    and resumed to 6 follows the schedule of one run of 6. `process`: as `python -m
    paisoar_jax.train` in a process of its own (the CLI's start, signals and exit), else in
    this one.
    """
    from paisoar_jax.config import load_config

    settings = [*TINY, *overrides, f"train.steps={steps}", "train.log_every=1"]
    settings += ["train.eval_every=0", "checkpoint.every=3", f"run.dir={run_dir}"]
    # The same learning rates however long the run: no warmup (it is min(warmup, steps)).
    settings += ["optim.schedule=constant", "optim.warmup_steps=0"]
    if process:
        result = run_module("train", *settings, cwd=pathlib.Path(run_dir).parent, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        train(load_config(None, settings))
    return losses(run_dir)


@pytest.fixture
def tiny_losses(tmp_path):
    """The shared tiny run: tiny_losses(overrides, steps=6, name="run", process=True) trains
    TINY + overrides in tmp_path/name (resuming what is there) and returns {step: loss}."""

    def run(overrides=(), steps=6, name="run", process=True):
        return resumable_run(tmp_path / name, list(overrides), steps, process=process)

    return run


def token_batches(count, batch=16, seq_len=32, seed=0):
    """Fixed random int32 token batches of shape (batch, seq_len + 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (batch, seq_len + 1), dtype=np.int32) for _ in range(count)]


def run_records(run_dir):
    """The records of run_dir/metrics.jsonl, in order."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="session")
def token_dataset(tmp_path_factory):
    """A converted byte-level dataset of a few standard-library files, in 2 shards."""
    import sysconfig

    from paisoar_jax.tools.convert import main as convert

    root = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "json"
    output = tmp_path_factory.mktemp("tokens") / "dataset"
    status = convert(
        ["text", "--input", str(root / "*.py"), "--output", str(output), "--shards", "2"]
    )
    assert status == 0
    return output


def assert_trees_close(actual, expected, rtol: float, what: str = "") -> None:
    """Each leaf of `actual` equals `expected`'s within rtol of that leaf's largest magnitude.

    A sharded computation sums in another order than one device, so each element carries an
    error of a few ulps of the *terms* it summed, not of its own value: an element-wise
    relative check fails on near-zero results (a gradient of 1e-9 among ones of 1e-2) on any
    fresh venv or busy machine. Measured against the leaf's scale, rtol 1e-4 still catches a
    wrong shard, a missing reduction or a dropped micro-batch, which are off by the scale.
    """
    import jax
    import numpy as np

    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.abs(b).max()) if b.size else 0.0
        np.testing.assert_allclose(
            a, b, rtol=0, atol=rtol * scale, err_msg=f"{what}{jax.tree_util.keystr(path)}"
        )


def assert_steps_match(actual, expected, rtol: float = 0.1) -> None:
    """Params after optimizer steps equal the reference's within rtol of each leaf's steps.

    `actual`/`expected` are (initial, final) pairs; the initial params must be identical.
    Each leaf is compared on the scale of how far the reference's steps moved it (its
    largest move): a lost, doubled or misplaced update is off by all of a step. Adam
    divides a gradient by its own size, so a near-zero gradient's float noise (another sum
    order) moves its element by a few percent of a step (2.6% seen, Llama's embedding):
    the gradients themselves are compared to float tolerance elsewhere.
    """
    import jax
    import numpy as np

    (initial, final), (expected_initial, expected_final) = actual, expected
    assert_trees_close(initial, expected_initial, 0.0, "initial")
    leaves = zip(
        jax.tree_util.tree_leaves_with_path(final),
        jax.tree.leaves(expected_final),
        jax.tree.leaves(expected_initial),
        strict=True,
    )
    moved_any = False
    for (path, got), want, start in leaves:
        got, want, start = (np.asarray(x, np.float64) for x in (got, want, start))
        step = float(np.abs(want - start).max()) if want.size else 0.0
        moved_any |= step > 0
        np.testing.assert_allclose(
            got, want, rtol=0, atol=rtol * step, err_msg=f"params{jax.tree_util.keystr(path)}"
        )
    assert moved_any, "the steps moved no parameter: the comparison would be vacuous"


# ChatML, its assistant text inside {% generation %} tags (transformers' assistant masks)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "the cat sat on a mat dog ran far what is two plus three five hello how are you".split()


def trained_bpe(special_tokens: list[str]):
    """A byte-level BPE tokenizer of 300 ids trained on WORDS, special tokens first."""
    import numpy as np
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 12)) for _ in range(300)]
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def tiny_llama_import(root: pathlib.Path):
    """A random Llama with a BPE tokenizer in root/hf, as transformers saves them, and its
    import in root/imported; returns the (transformers) tokenizer."""
    import torch
    import transformers

    from paisoar_jax.tools import hf

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained_bpe(["<|endoftext|>"]),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    hf.hf_import(root / "hf", root / "imported")
    return tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer with ChatML's special tokens and template, as HF saves it."""
    import transformers

    tokenizer = trained_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    directory = tmp_path_factory.mktemp("chat") / "tokenizer"
    fast.save_pretrained(directory)
    return directory


def random_chats(count, seed=0):
    """`count` chats of 1 to 3 user and assistant turns, every other one with a system turn."""
    import numpy as np

    rng = np.random.default_rng(seed)
    chats = []
    for index in range(count):
        messages = [{"role": "system", "content": "be brief"}] if index % 2 else []
        for _ in range(rng.integers(1, 4)):
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS, 4))})
            messages.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, 3))})
        chats.append({"messages": messages})
    return chats
