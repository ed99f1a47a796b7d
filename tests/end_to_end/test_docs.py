"""The documentation: a README a newcomer reads in minutes, and a site that builds strictly.

The site is built as CI builds it (`mkdocs build --strict`: a broken link, a missing page or
an unresolved API reference fails), its reference pages written from the code by
docs/hooks.py; every config key `--help` lists is on it, and its search index finds them.
"""

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

from paisoar_jax.config.keys import key_table


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first = "\n".join(lines[:40])
    assert "\npip install -e . && python -m paisoar_jax.train\n" in first
    assert '\npip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile\n' in first
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)]+)\)", "\n".join(lines)):
        assert (REPO / link).is_file(), link  # every page the README points to exists


def build_site(site) -> None:
    """`mkdocs build --strict` into `site`, as CI builds it (an environment of its own)."""
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert build.returncode == 0, build.stderr[-3000:]


def test_the_site_builds_strictly_with_its_pages_and_every_config_key(tmp_path):
    site = tmp_path / "site"
    build_site(site)
    pages = list(site.rglob("index.html"))
    assert len(pages) >= 30, len(pages)
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = " ".join(doc["title"] + " " + doc["text"] for doc in index["docs"])
    missing = [key for key, _, _ in key_table() if key not in text]
    assert not missing, missing
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("api.fit", "api.prepare", "run.result.FitResult", "inference.generator.Generator"):
        assert f'id="paisoar_jax.{name}"' in api, name  # mkdocstrings rendered its docstring
    own_model = re.sub(
        r"<[^>]+>", "", (site / "tutorials" / "own-model" / "index.html").read_text()
    )
    assert "result = paisoar_jax.fit(" in own_model  # the README's program, included
    text = lambda page: re.sub(r"<[^>]+>", "", (site / page / "index.html").read_text())  # noqa: E731
    # What plan and the doctor printed at this build (docs/outputs.py), on their pages.
    assert "memory per device" in text("how-to/plan") and "collectives per step" in text(
        "how-to/plan"
    )
    assert "1. exploding: the loss exploded" in text("how-to/bottleneck")
    benchmarks = text("benchmarks")  # every recorded GPU run, a row each, then RESULTS.md
    assert "Every recorded GPU run" in benchmarks and "gpt2_unrolled_chunked" in benchmarks
    for picture in ("data-flow.svg", "mesh-axes.svg"):  # docs/diagrams.py drew them
        assert (site / "images" / "generated" / picture).read_text().startswith("<svg")
    families = (site / "reference" / "model-families" / "index.html").read_text()
    assert "<td>qwen3_moe</td>" in families


def test_the_first_run_picture_is_drawn_from_a_runs_metrics(tmp_path, devices):
    """docs/plot_run.py, which drew docs/images/first-run.png, on a tiny run of this test."""
    from conftest import TINY, train

    from paisoar_jax.config import load_config

    run_dir = tmp_path / "run"
    settings = [*TINY, "train.steps=4", "train.log_every=1", "train.eval_every=2"]
    train(load_config(None, [*settings, "checkpoint.enabled=false", f"run.dir={run_dir}"]))
    script = subprocess.run(
        [sys.executable, str(REPO / "docs" / "plot_run.py"), str(run_dir), str(tmp_path / "a.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0, script.stderr[-2000:]
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")
    assert (REPO / "docs" / "images" / "first-run.png").read_bytes().startswith(b"\x89PNG")


def test_the_readmes_gpu_figures_are_the_recorded_ones():
    """Each row of the README's GPU table: its three figures on one row of RESULTS.md."""
    readme = (REPO / "README.md").read_text().split("## Measured on a GPU", 1)[1]
    section = readme.split("New to the code", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) >= 3, rows
    recorded = (REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()
    for row in rows:
        figures = [cell.strip() for cell in row.strip("|").split("|")][1:]
        assert any(
            all(figure in line.replace("**", "") for figure in figures) for line in recorded
        ), row


@pytest.mark.parametrize("page", ["how-to/lora.md", "how-to/experts.md", "how-to/speed.md"])
def test_the_gpu_figures_of_a_page_are_recorded_ones(page):
    """Memory, time and throughput a page quotes from a GPU plan or run: each on RESULTS.md."""
    text = (REPO / "docs" / page).read_text()
    figures = re.findall(r"\b\d[\d,]*(?:\.\d+)?(?:k tokens/s| GiB| MiB| ms|k\b|M\b)", text)
    assert figures, page
    recorded = (REPO / "benchmarks" / "RESULTS.md").read_text().replace("**", "")
    numbers = [figure.split()[0].rstrip("kM") for figure in figures]
    missing = [
        n for n in numbers if not re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d,])", recorded)
    ]
    assert not missing, (page, missing)


def test_the_images_page_promises_what_the_digits_test_checks():
    page = (REPO / "docs" / "how-to" / "images.md").read_text()
    checked = (REPO / "tests" / "slow" / "tasks" / "test_tasks_slow.py").read_text()
    assert "to over 95%" in page and 'final["eval_accuracy"] >= 0.95' in checked
