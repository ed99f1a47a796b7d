"""The documentation: a README a newcomer reads in minutes, and a site that builds strictly.

The site is built as CI builds it (`mkdocs build --strict`: a broken link, a missing page or
an unresolved API reference fails), its reference pages written from the code by
docs/hooks.py; every config key `--help` lists is on it, and its search index finds them.
Then the built pages are read as a reader meets them: the API page's headings, signatures
and parameter tables, the config reference's sections and anchors, pages in sections with
short paragraphs, code that fits the column, and the pages a newcomer looks for first.
"""

import html
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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for the tests that read it."""
    folder = tmp_path_factory.mktemp("site")
    build_site(folder)
    return folder


def test_the_site_builds_strictly_with_its_pages_and_every_config_key(site):
    pages = list(site.rglob("index.html"))
    assert len(pages) >= 30, len(pages)
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = " ".join(doc["title"] + " " + doc["text"] for doc in index["docs"])
    missing = [row.key for row in key_table() if row.key not in text]
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


def article(site, page: str) -> str:
    """The HTML of a built page's article (`page`: its folder, "" for the home page)."""
    text = (site / page / "index.html").read_text()
    return text[text.index("<article") : text.index("</article>")]


def plain(fragment: str) -> str:
    """A fragment of HTML as the reader sees its text."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_the_api_page_gives_each_public_name_a_heading_signature_and_parameters(site):
    """Before: the 19 entries rendered their docstrings with no heading, no signature and no
    parameter table, one line as a stray admonition; search found plan_fit on no API page."""
    import paisoar_jax

    page = article(site, "reference/api")
    entries = re.split(r"(?=<h3 id=\"paisoar_jax\.)", page)[1:]
    names = {re.match(r'<h3 id="paisoar_jax\.[\w.]*?(\w+)"', entry)[1]: entry for entry in entries}
    assert set(paisoar_jax.__all__) - {"__version__"} <= set(names), sorted(names)
    for name, entry in names.items():
        assert "doc-signature" in entry, f"{name}: no signature"
        assert "language-python" in entry or "highlight" in entry, f"{name}: no example"
        assert "Parameters:" in plain(entry), f"{name}: no parameter table"
    assert "admonition" not in page  # no docstring line taken for a note
    for group in ("Training", "Your own loop", "Inspection and export", "Generation"):
        assert f">{group}<" in page.replace('<a class="headerlink"', "<"), group
    index = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    titles = " ".join(doc["title"] for doc in index if doc["location"].startswith("reference/api"))
    for name in set(paisoar_jax.__all__) - {"__version__"}:
        assert re.search(rf"\b{name}\b", titles), f"search has no heading for {name}"


def test_the_config_reference_is_sectioned_with_an_anchor_and_a_meaning_per_key(site):
    from paisoar_jax.config.keys import SECTIONS

    page = article(site, "reference/config")
    for section in SECTIONS:
        assert f'<h2 id="{section}">' in page, section
    for row in key_table():
        assert f'id="{row.key}"' in page, row.key  # config.md#train.steps links to it
    cells = re.findall(r"<tr>\s*<td>(.*?)</td>.*?<td>(.*?)</td>\s*</tr>", page, re.S)
    assert len(cells) >= len(key_table())
    assert all(len(plain(meaning).strip()) > 10 for _, meaning in cells), "a key without meaning"


def hand_written_page_folders(site) -> list[str]:
    """The built folders of the tutorials, how-to and explanation pages."""
    return sorted(
        str(path.parent.relative_to(site))
        for kind in ("tutorials", "how-to", "explanation")
        for path in (site / kind).glob("*/index.html")
    )


def test_pages_are_in_sections_with_paragraphs_a_reader_can_take_in(site):
    """Before: 23 of 24 how-to pages had no heading, paragraphs ran to 461 words."""
    pages = hand_written_page_folders(site) + ["", "install", "faq", "reference/glossary"]
    assert len(pages) >= 35, pages
    for page in pages:
        text = article(site, page)
        words = len(plain(re.sub(r"<pre.*?</pre>", "", text, flags=re.S)).split())
        assert words <= 300 or "<h2" in text, f"{page}: {words} words without a section"
        for paragraph in re.findall(r"<p>(.*?)</p>", text, re.S):
            assert len(plain(paragraph).split()) <= 160, f"{page}: {plain(paragraph)[:80]}"
        first = re.search(r"<p>(.*?)</p>", text, re.S)
        assert not (first and first[1].startswith("<strong>")), f"{page} opens in bold"


def test_code_fits_the_column(site):
    """Before: 87 of 108 code blocks scrolled sideways (lines of 85-122 characters)."""
    blocks, wide = 0, []
    for page in site.rglob("index.html"):
        for block in re.findall(r"<pre[^>]*>(.*?)</pre>", page.read_text(), re.S):
            blocks += 1
            longest = max((len(line) for line in plain(block).splitlines()), default=0)
            if longest > 90:
                wide.append(f"{page.parent.relative_to(site)}: {longest}")
    assert blocks >= 150, blocks
    assert len(wide) <= blocks // 20, wide  # a few outputs and manifests, at most 5%


def test_the_pages_a_newcomer_looks_for_first(site):
    """An install page, a glossary, a FAQ and a changelog; the version in the header; every
    navigation label the title of its page."""
    from paisoar_jax import __version__

    install = plain(article(site, "install"))
    for needed in ("git clone", "3.11", "cuda12", "cuda13", ".[test]", "jax.devices()"):
        assert needed in install, needed
    glossary = article(site, "reference/glossary")
    for term in ("MFU", "remat", "FSDP", "ZeRO stages", "dcn, ici", "Orbax", "grain", "zoo"):
        assert f"<strong>{term}.</strong>" in glossary, term
    for site_link in ("docs.jax.dev", "flax.readthedocs.io", "optax", "grain", "orbax"):
        assert site_link in glossary, site_link
    assert "<h2" in article(site, "faq") and "2026-" in plain(article(site, "changelog"))
    home = (site / "index.html").read_text()
    assert f"paisoar_jax {__version__}" in home  # the header names the version
    navigation = re.findall(
        r'md-nav__link.*?href="([^"#]*)".*?md-ellipsis">\s*(.*?)\s*<', home, re.S
    )
    for link, label in navigation:
        target = (site / "index.html").parent / link / "index.html"
        if not link or not target.is_file():
            continue
        title = plain(re.search(r"<h1[^>]*>(.*?)</h1>", target.read_text(), re.S)[1]).strip("¶ ")
        assert html.unescape(label) == title or link in ("./", "."), (link, label, title)
