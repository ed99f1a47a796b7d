"""The entries of the API page (docs/reference/api.md) and the example of each, in page order.

Shared by tests/faces/test_api_examples.py and its slow tier: the page lists each public
name as `::: module.Name`; each docstring's `Example:` section holds one fenced Python block.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]
API_PAGE = REPO / "docs" / "reference" / "api.md"


def api_entries() -> list[tuple[str, object]]:
    """(dotted path, object) of each `::: path` on the API page, in the page's order."""
    paths = re.findall(r"^::: ([\w.]+)$", API_PAGE.read_text(), re.M)
    entries = []
    for path in paths:
        module, _, name = path.rpartition(".")
        entries.append((path, getattr(importlib.import_module(module), name)))
    return entries


def example_code(target: object) -> str:
    """The Python of `target`'s docstring's Example section ("" when it has none)."""
    docstring = inspect.getdoc(inspect.unwrap(target)) or ""
    section = docstring.partition("\nExample:\n")[2]
    found = re.search(r"```python\n(.*?)\n\s*```", section, re.S)
    return textwrap.dedent(found.group(1)) if found else ""
