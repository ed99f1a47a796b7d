"""`python -m paisoar_jax.evaluate SOURCE --tasks a,b`: lm-evaluation-harness on our model.

SOURCE is a run directory (its newest checkpoint), a checkpoint step or an export; the
model is placed on the devices as its config says and answers the harness's requests
there (inference/harness.py, the `paisoar_jax` harness model): no export to transformers,
no second environment. The results print as lm-eval's table and are appended, one JSON
line per evaluation, to harness.jsonl in the run directory (or the export's):
{"weights", "tasks", "results": {task: {metric: value}}, "config": {...}}.

    python -m paisoar_jax.evaluate runs/sft --tasks hellaswag,arc_easy --limit 100
    python -m paisoar_jax.evaluate runs/sft --tasks my_task --include-path tasks/

lm-eval's own command line runs with the model registered when its first word is one of
lm-eval's commands (run, ls, validate):

    python -m paisoar_jax.evaluate run --model paisoar_jax --model_args path=runs/sft --tasks x
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from paisoar_jax import output
from paisoar_jax.cli import exit_status
from paisoar_jax.errors import UserError

PROGRAM = "paisoar_jax.evaluate"
LM_EVAL_COMMANDS = ("run", "ls", "validate")  # lm-eval's own subcommands


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LM_EVAL_COMMANDS:
        return _lm_eval_command_line(argv)
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path, help="a run, checkpoint step or export")
    parser.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="the first N of each task")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--include-path", default=None, help="a folder of your task YAMLs")
    parser.add_argument("--apply-chat-template", action="store_true")
    args = parser.parse_args(argv)

    def work() -> None:
        try:
            from lm_eval.utils import make_table

            from paisoar_jax.inference.harness import RESULTS_FILE, evaluate, results_record
        except ImportError:
            raise UserError(
                "evaluation runs lm-evaluation-harness: pip install 'paisoar-jax[eval]'"
            ) from None
        tasks = [task for task in args.tasks.split(",") if task]
        results = evaluate(
            args.source,
            tasks,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            batch_size=args.batch_size,
            include_path=args.include_path,
            apply_chat_template=args.apply_chat_template,
        )
        output.result(make_table(results))
        directory = args.source if args.source.is_dir() else args.source.parent
        while not (directory / "config.yaml").is_file() and directory != directory.parent:
            directory = directory.parent  # a step's run directory
        record = results_record(str(args.source), tasks, results)
        with open(directory / RESULTS_FILE, "a") as file:
            file.write(json.dumps(record) + "\n")

    return exit_status(PROGRAM, work)


def _lm_eval_command_line(argv: list[str]) -> int:
    """lm-eval's own command line, with the `paisoar_jax` model registered."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import paisoar_jax.inference.harness  # noqa: F401 (registers the model)

    setup_logging()
    sys.argv = [PROGRAM, *argv]  # lm-eval's parser reads them there
    harness = HarnessCLI()
    harness.execute(harness.parse_args())
    return 0
