"""MkDocs hook: writes docs/reference/ from the code before each build, so it cannot drift.

Every config key (the table `--help` lists), every command's `--help`, the metrics.jsonl
fields, the exit statuses, the doctor's checks, the shipped configs, the sharding rules and
the model families the tests check (docs/model_families.py); and what plan and the doctor
print (docs/outputs.py); the data flow and mesh pictures (docs/diagrams.py); and the benchmarks
page from benchmarks/RESULTS.md. The Python API page is mkdocstrings' (reference/api.md).
"""

from __future__ import annotations

import contextlib
import html
import importlib
import io
import os
import pathlib
import subprocess
import sys
from unittest import mock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import diagrams  # noqa: E402 (docs/ is no package: its folder goes on the path first)
import model_families  # noqa: E402
import outputs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
COMMANDS = ("train", "plan", "doctor", "bench", "convert", "export", "generate", "launch")


def on_config(config, **kwargs):
    """The header names the version, and the repository when the checkout has a remote."""
    from paisoar_jax import __version__

    config["site_name"] = f"paisoar_jax {__version__}"
    remote = subprocess.run(
        ["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True, text=True
    )
    url = remote.stdout.strip()
    if remote.returncode == 0 and url.startswith("https://"):  # a page links only to the web
        config["repo_url"] = url.removesuffix(".git")
        config["repo_name"] = "paisoar_jax"
    return config


def on_pre_build(config, **kwargs) -> None:
    """Writes the generated pages (mkdocs calls it before it reads the docs)."""
    outputs.write_outputs()
    pages = {
        "config.md": config_keys(),
        "commands.md": commands(),
        "metrics.md": metrics_fields(),
        "exit-statuses.md": exit_statuses(),
        "doctor.md": doctor_checks(),
        "shipped-configs.md": shipped_configs(),
        "model-families.md": model_families.page(ROOT / "tests"),
        "sharding-rules.md": sharding_rules(),
    }
    files = {REFERENCE / name: text for name, text in pages.items()}
    pictures = ROOT / "docs" / "images" / "generated"
    files |= {pictures / name: svg for name, svg in diagrams.pictures().items()}
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    title, _, rest = results.partition("\n")
    summary, chart = benchmark_summary(results)
    files[pictures / "benchmark-ratios.svg"] = chart
    files[ROOT / "docs" / "benchmarks.md"] = (
        f"<!-- generated from benchmarks/RESULTS.md by docs/hooks.py -->\n{title}\n"
        + summary
        + recorded_runs()
        + "\n## Lab notebook\n"
        + rest
    )
    for path, text in files.items():
        # Only what changed: `mkdocs serve` rebuilds when a file it watches is written.
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _cell(text: str) -> str:
    """`text` (a comment from the code) fit for a table cell, as the reader should see it.

    One line; `<dir>` and the like kept as text (not taken for HTML tags); `code` spans as
    HTML code elements, so a `|` inside one neither splits the row nor shows a backslash.
    """
    parts = str(text).replace("\n", " ").split("`")
    shown = []
    for index, part in enumerate(parts):
        escaped = html.escape(part, quote=False).replace("|", "&#124;")
        shown.append(f"<code>{escaped}</code>" if index % 2 else escaped)
    return "".join(shown)


def _default(value: str) -> str:
    """A default in its cell: as typed, or a word for the empty string."""
    return f"<code>{_cell(value)}</code>" if value else "(empty)"


def config_keys() -> str:
    """The config keys page: every key by section, with its anchor, default, values, meaning."""
    from paisoar_jax.config.keys import FAMILIES, SECTIONS, key_table

    lines = [
        "# Config keys",
        "",
        "Every key of a run's config: its default, the values it takes and what it means, the",
        "table `python -m paisoar_jax.train --help` lists, generated from the comments in",
        "`paisoar_jax/config/`. Set one as `section.key=value` after the config (or in a YAML",
        "file: [Configs and overrides](../how-to/configs.md)). Link to a key as",
        "`config.md#train.steps`.",
        "",
        "Sections: " + ", ".join(f"[{name}](#{name})" for name in SECTIONS) + ".",
    ]
    rows, anchored = key_table(), set()
    for section, classes in SECTIONS.items():
        lines += ["", f"## {section}"]
        for owner in classes:
            family = FAMILIES.get(owner, "")
            if len(classes) > 1:
                lines += ["", f"### {section} keys of {family}"]
            summary = " ".join((owner.__doc__ or "").strip().split("\n\n")[0].split())
            lines += ["", summary, "", "| key | default | values | meaning |", "|---|---|---|---|"]
            for row in rows:
                if row.key.partition(".")[0] != section or row.family != family:
                    continue
                # A key both model families have: the second one's anchor names its family.
                anchor = f"{row.key}-{family.split(',')[0]}" if row.key in anchored else row.key
                anchored.add(row.key)
                lines.append(
                    f'| <a id="{anchor}"></a>`{row.key}` | {_default(row.default)} | '
                    f"{_cell(row.allowed)} | {_cell(row.meaning)} |"
                )
    return "\n".join(lines) + "\n"


def commands() -> str:
    """The commands page: each command's `--help`, as it prints it."""
    lines = ["# Commands", "", "Each command's `--help`, as it prints it."]
    for name in COMMANDS:
        module = importlib.import_module(f"paisoar_jax.{name}")
        out = io.StringIO()
        # argparse wraps its help to $COLUMNS: the width of the page's code column.
        with (
            mock.patch.dict(os.environ, {"COLUMNS": "88"}),
            contextlib.redirect_stdout(out),
            contextlib.suppress(SystemExit),
        ):
            module.main(["--help"])
        lines += ["", f"## {name}", "", "```text", out.getvalue().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def metrics_fields() -> str:
    """The metrics.jsonl page, from RECORD_FIELDS."""
    from paisoar_jax.observe.metrics import RECORD_FIELDS

    lines = [
        "# metrics.jsonl",
        "",
        "Each line of `<run.dir>/metrics.jsonl` is one JSON object: a log step's record.",
        "The fields (`<name>` stands for part of a field's name):",
        "",
        "| field | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{field}` | {_cell(meaning)} |" for field, meaning in RECORD_FIELDS.items()]
    return "\n".join(lines) + "\n"


def exit_statuses() -> str:
    """The exit statuses page, from EXIT_STATUSES."""
    from paisoar_jax.errors import EXIT_STATUSES

    lines = ["# Exit statuses", "", "| status | meaning |", "|---|---|"]
    lines += [f"| {status} | {_cell(meaning)} |" for status, meaning in EXIT_STATUSES.items()]
    return "\n".join(lines) + "\n"


def doctor_checks() -> str:
    """The doctor's page: its command's docstring and each check's first line."""
    from paisoar_jax.tools.doctor import command

    lines = ["# The doctor's checks", "", "```text", command.__doc__.strip(), "```", ""]
    lines += ["In the order it reports them:", ""]
    for check in command.CHECKS:
        summary = (check.__doc__ or "").strip().splitlines()[0]
        lines.append(f"- `{check.__name__.replace('_', '-')}`: {summary}")
    return "\n".join(lines) + "\n"


def shipped_configs() -> str:
    """The shipped configs page: each YAML file of paisoar_jax/configs."""
    from paisoar_jax.config import CONFIG_DIR

    lines = [
        "# Shipped configs",
        "",
        "`--config NAME` (or `paisoar_jax.fit(NAME, ...)`) reads one of these; overrides follow.",
    ]
    for path in sorted(pathlib.Path(CONFIG_DIR).glob("*.yaml")):
        lines += ["", f"## {path.stem}", "", "```yaml", path.read_text().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def sharding_rules() -> str:
    """The logical-axis table: where each named dimension of a parameter or activation goes."""
    from paisoar_jax.parallel.sharding import ACTIVATION_RULES, parameter_rules

    by_zero = {zero: parameter_rules(zero) for zero in (0, 1, 3)}
    state = parameter_rules(1, optimizer_state=True)
    lines = [
        "# Sharding rules",
        "",
        "The table parallel/sharding.py holds: each logical axis name a zoo model gives a",
        "dimension of its parameters, and the mesh axes that dimension is split over (none:",
        "whole on every device), by `mesh.zero`; then the activations' names, which the models",
        "constrain inside the step. Generated from the code at each build.",
        "",
        "| logical axis | params (zero 0, 1) | params (zero 3) | optimizer state (zero >= 1) |",
        "|---|---|---|---|",
    ]
    show = lambda axes: ", ".join(axes) if axes else "whole"  # noqa: E731
    for name in by_zero[0]:
        lines.append(
            f"| `{name}` | {show(by_zero[0][name])} | {show(by_zero[3][name])} | "
            f"{show(state[name])} |"
        )
    lines += ["", "| activation axis | mesh axes |", "|---|---|"]
    for name, axes in ACTIVATION_RULES.items():
        lines.append(f"| `{name}` | {show((axes,) if isinstance(axes, str) else axes)} |")
    return "\n".join(lines) + "\n"


def benchmark_summary(results: str) -> tuple[str, str]:
    """The one-screen summary of RESULTS.md's first table: each workload's ratio to PyTorch.

    Returns the summary's markdown and its bar chart (SVG).
    """
    rows = []
    for line in results.split("\n\n| date |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]:
        date, device, commit, workload, ours, peer, ratio, _ = (
            cell.strip().replace("**", "") for cell in line.strip("|").split("|")
        )
        card = device.split("(")[0].strip()
        rows.append((date, card, commit, workload, ours, peer, float(ratio.rstrip("x"))))
    lines = [
        "",
        "## Summary",
        "",
        "Each workload's speed as a ratio to the PyTorch peer (bf16 + torch.compile) run on the",
        "same card in the same device call: above 1.0x, faster than PyTorch. The lab notebook",
        "below holds every measurement with its command, the estimates made without a GPU, and",
        "what each change was worth. The configs shipped since (issue 48) carry the settings of",
        "the faster rows; no GPU has measured a newer commit yet.",
        "",
        "![Speed against the PyTorch peer](images/generated/benchmark-ratios.svg)",
        "",
        "| workload | card | date, commit | ours | PyTorch | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for date, card, commit, workload, ours, peer, ratio in rows:
        lines.append(
            f"| {workload} | {card} | {date}, {commit} | {ours} | {peer.split(' (')[0]} | "
            f"{ratio:.2f}x |"
        )
    chart = diagrams.ratio_chart([(_short(row[3]), row[6]) for row in rows])
    return "\n".join(lines) + "\n", chart


def _short(workload: str) -> str:
    """A workload's label for the chart: its config, then what set it apart."""
    config, _, settings = workload.partition(",")
    settings = settings.replace("`", "").replace("model.", "").strip()
    return f"{config.split()[0]}: {settings}"


def recorded_runs() -> str:
    """A table of every GPU run benchmarks/<card>_runs/*.jsonl holds, one row per line."""
    import json

    lines = [
        "",
        "## Every recorded GPU run",
        "",
        "Generated from the files the device calls wrote (benchmarks/*_runs/DATE.jsonl), one",
        "row per recorded item: ours (`bench`) and the peers' in the same call. A run that",
        "was killed has no figures. Peak memory: ours in GB (1e9 bytes, jax's peak_bytes_in_use),",
        "the PyTorch peers' as their scripts print it.",
        "",
        "| date | run | step ms | tokens/s or images/s | MFU | compile or warm-up s | peak mem |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(ROOT.glob("benchmarks/*_runs/*.jsonl")):
        for record in map(json.loads, path.read_text().splitlines()):
            result = record.get("result") or {}
            rate = (
                result.get("tokens_per_s")
                or result.get("images_per_s")
                or result.get("examples_per_s")
            )
            mfu = result.get("mfu", result.get("mfu_vs_989"))
            peak = result.get("peak_memory_gb", result.get("peak_mem_gb"))
            cells = [
                path.stem,
                f"`{record['name']}`",
                f"{result['step_ms']:.2f}" if "step_ms" in result else "killed",
                f"{rate:,.0f}" if rate else "",
                f"{mfu:.1%}" if mfu else "",
                f"{result.get('compile_s', result.get('warmup_s', 0)):.1f}" if result else "",
                f"{peak:.2f}" if peak else "",
            ]
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"
