"""The model-families page: which family each workflow is tested on, read from the tests.

A test says what it checks with a marker, `@pytest.mark.checks("logits", "import",
families=ARCHITECTURES)`: workflows first, then the families it runs them on (a list, or a
module constant naming one). Hugging Face architectures are plain names (`llama`, `gpt2`),
the zoo's and a model of one's own `zoo:NAME`. This reads the markers with `ast`, without
importing a test, and writes one table per kind with the tests behind each mark.
"""

from __future__ import annotations

import ast
import pathlib

WORKFLOWS = {
    "import": "import",
    "export": "export",
    "logits": "logits = transformers'",
    "greedy": "greedy tokens = transformers'",
    "sft": "SFT",
    "lora": "LoRA / PEFT",
    "sharded": "sharded step = one device",
    "resume": "exact resume",
    "mtp": "multi-token prediction",
}


def marks(tests: pathlib.Path) -> dict[tuple[str, str], list[str]]:
    """{(workflow, family): [test ids]} from every `pytest.mark.checks` under `tests`."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if not (
                    isinstance(decorator, ast.Call)
                    and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr == "checks"
                ):
                    continue
                workflows = [ast.literal_eval(argument) for argument in decorator.args]
                [families] = [k.value for k in decorator.keywords if k.arg == "families"]
                if isinstance(families, ast.Name):
                    families = constants[families.id]
                test = f"{path.relative_to(tests.parent)}::{node.name}"
                for workflow in workflows:
                    if workflow not in WORKFLOWS:
                        raise ValueError(f"{test}: unknown workflow {workflow!r}")
                    for family in ast.literal_eval(families):
                        found.setdefault((workflow, family), []).append(test)
    return found


def page(tests: pathlib.Path) -> str:
    """The reference page: a table for the Hugging Face architectures, one for the zoo's."""
    found = marks(tests)
    lines = [
        "# Model families by workflow",
        "",
        "What the tests check for each family, read from their `pytest.mark.checks` markers",
        "when the site is built (docs/model_families.py): a mark is a test that runs the",
        "workflow on that family, and the tests behind each are listed below the tables. An",
        "empty cell is not tested, whatever the code may do.",
    ]
    for title, zoo in (("Hugging Face architectures", False), ("The zoo's families", True)):
        families = sorted({f for _, f in found if f.startswith("zoo:") == zoo})
        columns = [w for w in WORKFLOWS if any((w, f) in found for f in families)]
        lines += ["", f"## {title}", ""]
        lines += ["| family | " + " | ".join(WORKFLOWS[w] for w in columns) + " |"]
        lines += ["|---" * (len(columns) + 1) + "|"]
        for family in families:
            cells = ["✓" if (w, family) in found else "" for w in columns]
            lines += [f"| {family.removeprefix('zoo:')} | " + " | ".join(cells) + " |"]
    lines += ["", "## The tests", ""]
    for (workflow, family), names in sorted(found.items()):
        lines += [f"- {WORKFLOWS[workflow]}, {family}: " + ", ".join(f"`{n}`" for n in names)]
    return "\n".join(lines) + "\n"
