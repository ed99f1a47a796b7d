"""The launcher's command line: `--nproc N [options] -- [train arguments | python SCRIPT]`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from paisoar_jax.errors import UserError
from paisoar_jax.runtime import environments

PROGRAM = "paisoar_jax.launch"
USAGE = f"python -m {PROGRAM} --nproc N [options] --\n       [train arguments | python SCRIPT ARGS]"
DESCRIPTION = "N processes of paisoar_jax.train, or of a script of your own, joined as one job."


def parse_arguments(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Launcher options before `--`, the child's arguments after it.

    On a node of a SkyPilot task, its variables give --nnodes, --node-rank and
    --coordinator (the first of SKYPILOT_NODE_IPS) where they are not given.
    """
    argv = list(argv)
    child_arguments = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog=PROGRAM, usage=USAGE, description=DESCRIPTION)
    parser.add_argument("--nproc", type=int, required=True, help="processes on this node")
    parser.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="CPU: simulated devices per process (default: jax's); GPU: GPUs per process "
        "(default: the node's GPUs / nproc)",
    )
    parser.add_argument(
        "--nnodes", type=int, default=None, help="nodes, one launcher each (default: 1)"
    )
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index")
    parser.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT on node 0 (needed with --nnodes > 1; default: a free port on 127.0.0.1)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=300,
        help="seconds the processes wait for each other: to join, and for a stalled rank",
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="after a failure: seconds from SIGTERM to SIGKILL"
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=600.0,
        help="seconds the others may run on after a signal or a first clean exit",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job from its newest checkpoint after a crash, a killed or "
        "stalled rank or a hang, up to N times (never after a user error, status 2)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=2.0,
        help="seconds before the first restart, doubled for each next one (at most 60)",
    )
    parser.add_argument("--module", default="paisoar_jax.train", help="python -m MODULE to run")
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    args.arguments = args.arguments + child_arguments
    try:
        _nodes_from_skypilot(args, os.environ if environ is None else environ)
    except UserError as error:
        parser.error(str(error))
    for name in ("nproc", "nnodes", "timeout"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is not in 0 .. {args.nnodes - 1}")
    if args.nnodes > 1 and not args.coordinator:
        parser.error("--nnodes > 1 needs --coordinator HOST:PORT (an address of node 0)")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        parser.error("--devices-per-proc must be >= 1")
    if args.max_restarts < 0 or not 0 <= args.restart_backoff < float("inf"):
        parser.error("--max-restarts and --restart-backoff must be >= 0")
    return args


def _nodes_from_skypilot(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """--nnodes, --node-rank and --coordinator not given: a SkyPilot node's, else 1 node."""
    nodes = environments.skypilot_nodes(environ)
    count, rank, coordinator = nodes[:3] if nodes else (1, 0, None)
    args.nnodes = count if args.nnodes is None else args.nnodes
    args.node_rank = rank if args.node_rank is None else args.node_rank
    args.coordinator = args.coordinator or coordinator
