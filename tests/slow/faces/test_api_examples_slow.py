"""The slow tier beside tests/faces/test_api_examples.py: every example of the API page runs.

In the page's order, in one program and one folder, as a reader trying them one after the
other would: fit's example trains the run that load's, Generator's and export_run's read.
"""

import subprocess
import sys

from api_entries import api_entries, example_code
from conftest import subprocess_env


def test_every_example_of_the_api_page_runs_in_order(tmp_path):
    parts = ["import paisoar_jax"]
    for path, target in api_entries():
        parts += [f"print('--- {path}', flush=True)", example_code(target)]
    (tmp_path / "examples.py").write_text("\n\n".join(parts) + "\n")
    ran = subprocess.run(
        [sys.executable, "examples.py"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-3000:])
    shown = [line for line in ran.stdout.splitlines() if line.startswith("--- ")]
    assert len(shown) == len(api_entries())  # every example reached its end
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").is_file()  # fit's run
    assert (tmp_path / "exports" / "tiny").is_dir()  # export_run's
    assert "optim.lr must be > 0" in ran.stdout  # UserError's line
