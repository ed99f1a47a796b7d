"""What `plan` and the doctor print, run at each site build and shown on their pages as is.

`python -m paisoar_jax.plan` on GPT-2's shape (two layers, so it compiles in seconds) over 8
simulated devices, and the doctor on a real tiny run whose learning rate is 30: the pages
show the lines these commands print today, not a copy typed once. The outputs are kept in
docs/generated/ with a hash of the package's sources, and run again when that changes.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ROOT / "docs" / "generated"

PLAN = ["plan", "--config", "gpt2_124m", "--devices", "8", "mesh.data=1", "mesh.fsdp=8"]
PLAN += ["--link", "nvlink", "model.layers=2"]
TOO_FAST = ["train", "optim.lr=30", "train.steps=30", "train.log_every=5", "train.eval_every=0"]
TOO_FAST += ["model.layers=2", "run.progress=false", "run.tensorboard=false"]
TOO_FAST += ["checkpoint.enabled=false", "run.dir=runs/too-fast"]
DOCTOR = ["doctor", "runs/too-fast"]
WIDTH = 88  # the code column's characters (docs/stylesheets/extra.css)


def sources_hash() -> str:
    """A hash of the package's code and shipped configs: the outputs' cache key."""
    digest = hashlib.sha256(repr((PLAN, TOO_FAST, DOCTOR, WIDTH)).encode())
    for path in sorted([*ROOT.glob("paisoar_jax/**/*.py"), *ROOT.glob("configs/*.yaml")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run(command: list[str], cwd: pathlib.Path) -> str:
    """`python -m paisoar_jax.<command>` in cwd; what it printed, or an error saying why."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
    result = subprocess.run(
        [sys.executable, "-m", f"paisoar_jax.{command[0]}", *command[1:]],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed: {result.stderr[-2000:]}")
    return result.stdout


def shown(command: list[str], printed: str) -> str:
    """The command as a reader types it, then what it printed, in the page's 88 columns.

    A longer line is folded as a narrower terminal would show it, its continuation indented
    under the line's own text; the command is folded with a backslash, as one types it.
    """
    typed = textwrap.wrap(
        f"$ python -m paisoar_jax.{shlex.join(command)}", WIDTH - 2, subsequent_indent="    "
    )
    lines = [*(line + " \\" for line in typed[:-1]), typed[-1]]
    for line in printed.rstrip().splitlines():
        if len(line) <= WIDTH:  # as printed, its columns aligned
            lines.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        lines += textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def write_outputs() -> None:
    """docs/generated/{plan,doctor}.txt, run again when the package changed."""
    key = sources_hash()
    stamp = GENERATED / "sources.sha256"
    if stamp.is_file() and stamp.read_text() == key:
        return
    GENERATED.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        work = pathlib.Path(folder)
        (GENERATED / "plan.txt").write_text(shown(PLAN, run(PLAN, work)))
        run(TOO_FAST, work)
        (GENERATED / "doctor.txt").write_text(shown(DOCTOR, run(DOCTOR, work)))
    stamp.write_text(key)
