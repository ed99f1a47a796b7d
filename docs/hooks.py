"""MkDocs hook: writes docs/reference/ from the code before each build, so it cannot drift.

Every config key (the table `--help` lists), every command's `--help`, the metrics.jsonl
fields, the exit statuses, the doctor's checks, the shipped configs, the sharding rules and
the model families the tests check (docs/model_families.py); and what plan and the doctor
print (docs/outputs.py); the data flow and mesh pictures (docs/diagrams.py); and the benchmarks
page from benchmarks/RESULTS.md. The Python API page is mkdocstrings' (reference/api.md).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import diagrams  # noqa: E402 (docs/ is no package: its folder goes on the path first)
import model_families  # noqa: E402
import outputs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
COMMANDS = ("train", "plan", "doctor", "bench", "convert", "export", "generate", "launch")


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
    files[ROOT / "docs" / "benchmarks.md"] = (
        f"<!-- generated from benchmarks/RESULTS.md by docs/hooks.py -->\n{title}\n"
        + recorded_runs()
        + rest
    )
    for path, text in files.items():
        # Only what changed: `mkdocs serve` rebuilds when a file it watches is written.
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _cell(text: str) -> str:
    """`text` fit for a table cell (pipes escaped, one line)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_keys() -> str:
    """The config keys page: `--help`'s table of every key, default and meaning."""
    from paisoar_jax.config.keys import key_table

    lines = [
        "# Config keys",
        "",
        "Every key of a run's config, its default and its meaning: the table `python -m",
        "paisoar_jax.train --help` lists, generated from the comments in",
        "`paisoar_jax/config/sections.py`. Set one as `section.key=value` after the config.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for key, default, meaning in key_table():
        lines.append(f"| `{key}` | `{_cell(default)}` | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def commands() -> str:
    """The commands page: each command's `--help`, as it prints it."""
    lines = ["# Commands", "", "Each command's `--help`, as it prints it."]
    for name in COMMANDS:
        module = importlib.import_module(f"paisoar_jax.{name}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
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
