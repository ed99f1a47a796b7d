"""paisoar_jax: one YAML config turns a model and an optax optimizer into a fast JAX run.

Sharded over a device mesh, mixed precision, checkpointed; see README.md for the tour. The
public API (paisoar_jax/api.py and the helpers a model of one's own uses):

    fit(config, overrides, *, model, loss, optimizer, data, eval_data, eval_sets)  train;
                                           returns a FitResult: the summary and .model, the
                                           trained module
    Eval(data, every=STEPS)                an eval set of fit's eval_sets with its own cadence
    prepare(config, overrides, *, model, ...)  fit's pieces for a loop of one's own, a Prepared:
                                           .state, .batches(), .train_step, .evaluate,
                                           .should_stop, .save, .log, .model
    load(run_dir_or_step, model=factory)   the trained module again, from disk (a zoo
                                           run or an import needs no factory)
    plan_fit(...), bench_fit(...)          the plan and the measured speed of the same run
    export_run(run_dir, output)            a run's weights, for checkpoint.init_from
    Generator(run_or_export)               a zoo or imported decoder's batched generation:
                                           .complete(texts), .generate(token lists)
    initialize()                           join a multi-process run (fit does it itself)
    load_config(path, overrides), Config   the run's configuration
    remat_block(block)                     checkpoint a block with the run's remat.policy
    scan_layers(step, x, stacked)          run a stack of identical blocks (pipelined when
                                           mesh.stage > 1, else jax.lax.scan)
    input_slot()                           (this process's share of each batch, shares)
    token_windows(dir, seq_len, ...)       (train, eval) examples of a converted dataset:
                                           windows, loss masks, packed documents
    source_examples("images:DIR", image_size=64)  (train, eval) examples of any
                                           data.source: image folders, arrayrecord:, hf:
    force_policy(module, "fp32"), fp32_function   keep parts of a model in fp32
    UserError                              bad input (one line, exit status 2 from the CLI)

Names are imported on first use, so `python -m paisoar_jax.train --help` starts fast; type
checkers and editors see them all, typed (the package ships py.typed).
Importing the package changes nothing of the process (no environment variable, no jax
setting): the platform is chosen where a run starts (runtime/platform.py).
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ loads them
    from paisoar_jax.api import (
        Eval,
        FitResult,
        bench_fit,
        export_run,
        fit,
        initialize,
        load,
        plan_fit,
        prepare,
    )
    from paisoar_jax.config import Config, load_config
    from paisoar_jax.data.source_examples import source_examples
    from paisoar_jax.data.sources import token_windows
    from paisoar_jax.errors import UserError
    from paisoar_jax.inference.generator import Generator
    from paisoar_jax.numerics.precision import force_policy, fp32_function
    from paisoar_jax.numerics.remat import remat_block
    from paisoar_jax.parallel.pipeline import scan_layers
    from paisoar_jax.parallel.sharding import input_slot
    from paisoar_jax.run.prepared import Prepared


_EXPORTS = {
    "fit": "paisoar_jax.api",
    "FitResult": "paisoar_jax.api",
    "Eval": "paisoar_jax.api",
    "load": "paisoar_jax.api",
    "prepare": "paisoar_jax.api",
    "plan_fit": "paisoar_jax.api",
    "bench_fit": "paisoar_jax.api",
    "initialize": "paisoar_jax.api",
    "export_run": "paisoar_jax.api",
    "Generator": "paisoar_jax.inference.generator",
    "load_config": "paisoar_jax.config",
    "Config": "paisoar_jax.config",
    "remat_block": "paisoar_jax.numerics.remat",
    "scan_layers": "paisoar_jax.parallel.pipeline",
    "input_slot": "paisoar_jax.parallel.sharding",
    "token_windows": "paisoar_jax.data.sources",
    "source_examples": "paisoar_jax.data.source_examples",
    "force_policy": "paisoar_jax.numerics.precision",
    "fp32_function": "paisoar_jax.numerics.precision",
    "UserError": "paisoar_jax.errors",
    "Prepared": "paisoar_jax.run.prepared",
}
__all__ = [  # written out, so that linters and type checkers read it
    "fit",
    "FitResult",
    "Eval",
    "load",
    "prepare",
    "plan_fit",
    "bench_fit",
    "initialize",
    "export_run",
    "Generator",
    "load_config",
    "Config",
    "remat_block",
    "scan_layers",
    "input_slot",
    "token_windows",
    "source_examples",
    "force_policy",
    "fp32_function",
    "UserError",
    "Prepared",
    "__version__",
]


def __dir__() -> list[str]:
    return sorted(__all__)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paisoar_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
