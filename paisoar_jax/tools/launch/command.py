"""`python -m paisoar_jax.launch --nproc N [--devices-per-proc K] -- [ARGS | python SCRIPT]`.

Starts N processes of `python -m paisoar_jax.train ARGS` on this machine (or of any script:
`-- python my_script.py ARGS`, whose `paisoar_jax.fit` or `paisoar_jax.initialize()` joins
them), joined by jax.distributed through the PAISOAR_* variables
(paisoar_jax/runtime/distributed.py): a free port on 127.0.0.1 for one node, `--coordinator
HOST:PORT` for several (`--nnodes`, `--node-rank`, one launcher per node). On CPU each
process gets K simulated devices; on a GPU node, K GPUs (default: an equal share).

Every output line is prefixed with `[rank i] `. When a process fails (non-zero exit or a
signal) the others get SIGTERM, then SIGKILL after `--grace` seconds (a process whose peer
died is stuck in a collective and cannot stop by itself), and the launcher exits with the
failing rank's status after printing its last lines. SIGINT/SIGTERM to the launcher go to
every process (each saves the same step once and exits 0, or 130 for Ctrl-C); a third
Ctrl-C press kills them, naming the last saved step.

A stalled rank is named. Each rank beats every second (paisoar_jax/runtime/heartbeat.py) with the
step it last finished; a rank without beats for `--timeout` seconds (SIGSTOP, a frozen node)
is reported in one line with its last step and the newest checkpoint, and every process is
stopped (exit status 1). Once a rank has said where its run directory is, every rank's
output (with the last 8 MB from before) is also written to <run.dir>/logs/rank-N.log; when
those logs are open, the screen stays quiet after a stall or a failure is named, and the
other ranks' stack traces go to the logs only. A failure names the rank whose error came
first (recorded in its beats), with that error's line.

`--max-restarts N` runs the whole job again from its newest checkpoint after a crash, a
killed or stalled rank or a hang (restarts.py); never after a user error (status 2).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from paisoar_jax.errors import INTERRUPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError
from paisoar_jax.runtime import distributed, heartbeat, preemption
from paisoar_jax.runtime.ports import free_port
from paisoar_jax.tools.launch.arguments import parse_arguments
from paisoar_jax.tools.launch.rank_output import Output, RankLog, copy_lines
from paisoar_jax.tools.launch.restarts import Ending, SignalLog, run_with_restarts
from paisoar_jax.tools.launch.restarts import say as _say

TAIL_LINES = 20
PR_SET_PDEATHSIG = 1  # linux/prctl.h
USER_ERROR_WAIT_S = 3.0  # how long the others may take to report a bad input themselves
STALE_S = 10.0  # beats missed this long mark a rank as the stalled one when a peer fails


def local_gpu_count(environ: Mapping[str, str]) -> int:
    """GPUs this node offers to jax, without starting CUDA (that would hold memory)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([item for item in visible.split(",") if item.strip() not in ("", "-1")])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def child_environments(
    args: argparse.Namespace, environ: Mapping[str, str], gpu_count: int, coordinator: str
) -> list[dict[str, str]]:
    """One environment per local process: ranks, coordinator, and its devices."""
    platforms = environ.get("JAX_PLATFORMS", "")
    use_gpu = args.platform == "gpu" or (
        args.platform == "auto"
        and gpu_count > 0
        and (not platforms or "cuda" in platforms or "gpu" in platforms)
    )
    per_process = args.devices_per_proc
    if use_gpu:
        per_process = per_process or gpu_count // args.nproc
        if per_process < 1 or per_process * args.nproc > gpu_count:
            raise UserError(
                f"{args.nproc} processes x {per_process or 1} GPUs do not fit the {gpu_count} "
                "GPUs of this node (--nproc, --devices-per-proc)"
            )
    environments = []
    for local_rank in range(args.nproc):
        environment = dict(environ)
        environment.update(
            {
                distributed.COORDINATOR: coordinator,
                distributed.NUM_PROCESSES: str(args.nnodes * args.nproc),
                distributed.PROCESS_ID: str(args.node_rank * args.nproc + local_rank),
                distributed.TIMEOUT: str(args.timeout),
                "PAISOAR_LOCAL_RANK": str(local_rank),
                "PYTHONUNBUFFERED": "1",  # lines arrive as printed, and none lost on a crash
            }
        )
        if use_gpu:
            first = local_rank * per_process
            ids = ",".join(str(index) for index in range(first, first + per_process))
            environment[distributed.LOCAL_DEVICE_IDS] = ids
        else:
            if args.platform == "cpu":
                environment["JAX_PLATFORMS"] = "cpu"
            if per_process:
                environment[distributed.CPU_DEVICES] = str(per_process)
        environments.append(environment)
    return environments


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (Linux), so none is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    """One launched process, the threads copying its output, its last lines and its beats."""

    rank: int
    process: subprocess.Popen
    heartbeat_file: pathlib.Path
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    threads: list[threading.Thread] = field(default_factory=list)
    log: RankLog = field(default_factory=RankLog)

    def beat(self) -> dict | None:
        """Its last heartbeat; None before the first (or from a script that sends none)."""
        return heartbeat.read(self.heartbeat_file)

    def describe_exit(self) -> str:
        """`exited with status 2` or `was killed by SIGKILL`."""
        code = self.process.returncode
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def exit_status(self) -> int:
        """Its status for the launcher to exit with: the code, or 128 + the signal."""
        code = self.process.returncode
        return code if code > 0 else 128 - code

    def signal_group(self, number: int) -> None:
        """Signals the process and whatever it started (grain workers): its own session."""
        try:
            os.killpg(self.process.pid, number)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(children: list[Child], grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds for what still runs; waits for them."""
    for child in children:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(child.process.poll() is None for child in children):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in children:
        child.signal_group(signal.SIGKILL)
        child.process.wait(timeout=30)


def _fail(exited: Child, children: list[Child], grace: float, screen: Output) -> Ending:
    """Stops every other process and names the rank that failed first, with its error.

    The first rank to exit is not always the cause: a rank that raises makes its peers'
    collectives abort, and one of them may exit before it. So the rank whose heartbeat
    recorded the oldest error is named, with that error's line; without any recorded
    error (a kill), the first to exit. A rank that exits with the bad-input status has
    usually found what every rank finds (a bad setting, an unreachable coordinator): the
    others get a moment to say it themselves.
    """
    if exited.process.returncode == USER_ERROR_EXIT_CODE:
        deadline = time.monotonic() + USER_ERROR_WAIT_S
        while time.monotonic() < deadline and any(c.process.poll() is None for c in children):
            time.sleep(0.05)
    failed, error, retryable = _first_failure(children, exited)
    # What follows (the others' aborts, stack traces) goes to the logs only, where there are.
    screen.muted = all(child.log.file is not None for child in children)
    others = [child for child in children if child.process.poll() is None]
    how = exited.describe_exit() if failed is exited else "failed first"
    said = f": {error}" if error else ""
    # A bad input's line (status 2) is on screen already, from every rank that found it.
    shown = "" if failed.process.returncode == USER_ERROR_EXIT_CODE else said
    _say(f"rank {failed.rank} {how}{shown}; stopping {len(others)} other process(es)", "failure")
    _stop(others, grace)
    failed.signal_group(signal.SIGKILL)  # its workers, if it left any behind
    for thread in failed.threads:
        thread.join(timeout=5)
    lines = "\n".join(f"  {line}" for line in failed.tail) or "  (none: it printed nothing)"
    last = failed.tail[-1].strip() if failed.tail else ""
    if not (shown == "" and last in screen.shown_errors):  # a bad input's line: said once
        _say(f"last lines of rank {failed.rank}:\n{lines}", "failure")
    status = failed.exit_status() if failed.process.returncode else exited.exit_status()
    cause = f"rank {failed.rank} {how}{said}"
    return Ending(status, cause, failed.rank, retry=retryable and status != USER_ERROR_EXIT_CODE)


def _first_failure(children: list[Child], exited: Child) -> tuple[Child, str, bool]:
    """The rank whose recorded error is oldest (else the one that exited), and its line.

    Also whether a restart could help: a divergence would only come back.
    """
    recorded = [
        (beat["failed_at"], child, beat["error"], beat.get("retryable", True))
        for child in children
        if (beat := child.beat()) and beat.get("error") and beat.get("failed_at")
    ]
    if not recorded:
        return exited, "", True
    _, child, error, retryable = min(recorded, key=lambda item: item[0])
    return child, error, retryable


def _stalled(children: list[Child], older_than: float) -> Child | None:
    """The running child whose beats stopped longest ago, if that is over `older_than` s.

    Only a rank that has beaten can stall: one that never did (still importing, or a
    script that does not start paisoar_jax's distributed set-up) is not judged, nor one
    whose last beat said it was exiting.
    """
    now = time.time()
    beats = [(child.beat(), child) for child in children if child.process.poll() is None]
    ages = [
        (now - beat["time"], child)
        for beat, child in beats
        if beat is not None and not beat.get("exiting")  # tearing down, not stalled
    ]
    age, child = max(ages, key=lambda pair: pair[0], default=(0.0, None))
    return child if age > older_than else None


def _run_dir(beats: list[dict | None]) -> str | None:
    """The run directory the ranks' beats report, once one has."""
    return next((beat["run_dir"] for beat in beats if beat and beat.get("run_dir")), None)


def _checkpoint_dir(beats: list[dict]) -> str | None:
    """The checkpoint directory the ranks' beats report, once one has."""
    return next((beat["checkpoint_dir"] for beat in beats if beat.get("checkpoint_dir")), None)


def _open_logs(children: list[Child], screen: Output) -> bool:
    """Moves each rank's output to <run.dir>/logs/rank-N.log once the run directory is known."""
    run_dir = _run_dir([child.beat() for child in children])
    if run_dir is None:
        return False
    with screen.lock:
        for child in children:
            child.log.open(pathlib.Path(run_dir) / "logs" / f"rank-{child.rank}.log")
    return True


def _report_stall(stalled: Child, children: list[Child], args, screen: Output) -> Ending:
    """One line naming the stalled rank, its last step and the newest checkpoint; stops all."""
    # What follows (the peers' aborts, stack traces) goes to the logs only, where there are.
    screen.muted = all(child.log.file is not None for child in children)
    beat, beats = stalled.beat(), [child.beat() or {} for child in children]
    checkpoint_dir = _checkpoint_dir(beats)
    newest = heartbeat.newest_checkpoint(checkpoint_dir)
    saved = (
        f"newest checkpoint: step {newest} in {checkpoint_dir} (a rerun resumes from it)"
        if newest is not None
        else "no checkpoint saved yet"
    )
    run_dir = _run_dir(beats)
    logs = f"; each rank's output is in {run_dir}/logs" if run_dir else ""
    _say(
        f"rank {stalled.rank} (pid {stalled.process.pid}) stopped making progress: no heartbeat "
        f"for {time.time() - beat['time']:.0f} s, last step {beat['step']}; {saved}; stopping "
        f"every process{logs}",
        "failure",
    )
    _stop([child for child in children if child.process.poll() is None], args.grace)
    cause = f"rank {stalled.rank} stopped making progress (last step {beat['step']})"
    return Ending(1, cause, stalled.rank, retry=True)


def _supervise(
    children: list[Child], args: argparse.Namespace, signals: SignalLog, screen: Output
) -> Ending:
    """Waits for the children: the first failure or stall stops them all; signals go on."""
    forwarded, deadline, logs_open, next_watch = 0, None, False, 0.0
    presses, last_press, gap = 0, -float("inf"), preemption.PRESS_GAP_S  # Ctrl-C presses
    clean = {None, 0}  # the statuses of a rank still running or done as it should be
    while True:
        failed = next((child for child in children if child.process.poll() not in clean), None)
        if failed is not None:
            # A peer whose beats stopped is the cause: jax aborts the healthy ranks after it.
            stalled = _stalled([child for child in children if child is not failed], STALE_S)
            if stalled is not None:
                return _report_stall(stalled, children, args, screen)
            return _fail(failed, children, args.grace, screen)
        running = [child for child in children if child.process.returncode is None]
        if not running:  # a stop every rank obeyed ends as theirs did: 0, 130 or 143
            statuses = {child.process.returncode for child in children} - {0}
            status = max((abs(status) % 128 + 128 for status in statuses), default=0)
            return Ending(status)
        if time.monotonic() > next_watch:  # the beats, once a second
            next_watch = time.monotonic() + heartbeat.INTERVAL_S
            logs_open = logs_open or _open_logs(children, screen)
            stalled = _stalled(children, max(args.timeout, STALE_S))
            if stalled is not None:
                return _report_stall(stalled, children, args, screen)
        if len(signals.received) > forwarded:
            number, at = signals.received[forwarded], signals.times[forwarded]
            forwarded += 1
            name = signal.Signals(number).name
            presses = presses + 1 if number == signal.SIGINT and at - last_press >= gap else presses
            last_press = at if number == signal.SIGINT else last_press
            if presses >= preemption.ABORT_PRESSES:  # a person insists: no more waiting
                newest = heartbeat.newest_checkpoint(
                    _checkpoint_dir([child.beat() or {} for child in children])
                )
                saved = f"last saved: step {newest}" if newest is not None else "no step saved"
                _say(f"Ctrl-C pressed {presses} times: killing the processes ({saved})")
                _stop(running, grace=0)
                return Ending(INTERRUPTED_EXIT_CODE, "Ctrl-C pressed three times")
            if forwarded == 1:
                more = "; Ctrl-C three times kills them" if number == signal.SIGINT else ""
                _say(f"{name}: passed on to the processes (they save and exit){more}")
            # Every rank saves the step reached once and exits 0 (SIGTERM) or 130 (SIGINT);
            # one still before its first step exits 128 + the signal. None is a failure.
            clean |= {128 + number, -number}
            for child in running:
                os.kill(child.process.pid, number)  # a repeat is harmless: they save once
            deadline = deadline or time.monotonic() + args.stop_timeout
        if deadline is None and len(running) < len(children):  # one finished: the rest follow
            deadline = time.monotonic() + args.stop_timeout
        if deadline is not None and time.monotonic() > deadline:
            ranks = ", ".join(str(child.rank) for child in running)
            _say(f"rank(s) {ranks} still running {args.stop_timeout:g} s later: killing them")
            _stop(running, args.grace)
            cause = f"rank(s) {ranks} still running {args.stop_timeout:g} s after the others"
            return Ending(1, cause, retry=not forwarded)
        time.sleep(0.1)


def child_command(module: str, arguments: Sequence[str]) -> list[str]:
    """The command each process runs: `python -m MODULE ARGS`, or the script given.

    `-- python my_script.py ARGS` (any python, python3, python3.12 ...) and
    `-- my_script.py ARGS` run the script with this interpreter, as torchrun does; anything
    else is arguments of `--module` (the trainer by default).
    """
    arguments = list(arguments)
    if arguments and re.fullmatch(r"python[\d.]*", os.path.basename(arguments[0])):
        if len(arguments) < 2:
            raise UserError("-- python needs a script (or -m MODULE) to run")
        return [sys.executable, *arguments[1:]]
    if arguments and arguments[0].endswith(".py"):
        return [sys.executable, *arguments]
    return [sys.executable, "-m", module, *arguments]


def launch(args: argparse.Namespace, signals: SignalLog) -> Ending:
    """Starts the processes, copies their output and supervises them: one attempt's end.

    `signals`: the SIGINT/SIGTERM the launcher received, which go on to the processes.
    """
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    environments = child_environments(args, os.environ, local_gpu_count(os.environ), coordinator)
    command = child_command(args.module, args.arguments)
    screen = Output()
    children: list[Child] = []
    beats = pathlib.Path(tempfile.mkdtemp(prefix="paisoar-launch-"))
    try:
        for environment in environments:
            beat_file = beats / f"rank-{environment[distributed.PROCESS_ID]}.json"
            environment[heartbeat.HEARTBEAT_FILE] = str(beat_file)
            process = subprocess.Popen(
                command,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl-C reaches them once, through us
                preexec_fn=_die_with_parent,
            )
            children.append(Child(int(environment[distributed.PROCESS_ID]), process, beat_file))
        pids = ", ".join(f"rank {child.rank}: {child.process.pid}" for child in children)
        _say(f"started {len(children)} processes ({pids}), coordinator {coordinator}")
        for child in children:
            prefix = f"[rank {child.rank}] ".encode()
            for stream, sink in (
                (child.process.stdout, sys.stdout),
                (child.process.stderr, sys.stderr),
            ):
                thread = threading.Thread(
                    target=copy_lines,
                    args=(stream, sink.buffer, prefix, child.log, child.tail, screen),
                    daemon=True,
                )
                thread.start()
                child.threads.append(thread)
        ending = _supervise(children, args, signals, screen)
        last_beats = [child.beat() or {} for child in children]  # before their folder goes
        ending = replace(
            ending, run_dir=_run_dir(last_beats), checkpoint_dir=_checkpoint_dir(last_beats)
        )
    except BaseException:
        _stop([child for child in children if child.process.poll() is None], grace=0)
        raise
    finally:
        shutil.rmtree(beats, ignore_errors=True)
    for child in children:
        for thread in child.threads:
            thread.join(timeout=5)
        child.log.close()
    return ending


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the launcher's exit status."""
    try:
        args = parse_arguments(sys.argv[1:] if argv is None else argv)
        return run_with_restarts(
            lambda signals: launch(args, signals), args.max_restarts, args.restart_backoff
        )
    except UserError as error:
        _say(str(error), "error")
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
