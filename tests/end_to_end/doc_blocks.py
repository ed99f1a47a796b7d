"""The code blocks of README.md and the hand-written docs pages, each with its marker.

Every fenced block is preceded by an HTML comment that says what becomes of it:
`<!-- test: NAME -->` (a test takes the block by NAME with `doc_block` and runs or checks
it) or `<!-- sketch: WHY -->` (not run, and why: a GPU cluster, a model of 8B, a server).
The reference pages docs/hooks.py writes from the code are not hand-written, so not here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?:<!-- (test|sketch): (.*?) -->\n)?```(\w*)\n(.*?)^```$", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its marker (kind and name or reason) and its text."""

    page: str
    line: int
    kind: str | None  # "test", "sketch" or None (unmarked)
    label: str  # the test's name, or the sketch's reason
    language: str
    text: str


def hand_written_pages() -> list[pathlib.Path]:
    """README.md and the docs pages kept in git (the generated ones are in .gitignore)."""
    generated = {
        line.strip() for line in (REPO / ".gitignore").read_text().splitlines() if line.strip()
    }
    pages = sorted((REPO / "docs").rglob("*.md"))
    pages = [page for page in pages if str(page.relative_to(REPO)) not in generated]
    return [REPO / "README.md", *pages]


def doc_blocks() -> list[Block]:
    """Every fenced block of the hand-written pages."""
    blocks = []
    for page in hand_written_pages():
        text = page.read_text()
        for match in FENCE.finditer(text):
            kind, label, language, body = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            page_name = str(page.relative_to(REPO))
            blocks.append(Block(page_name, line, kind, label or "", language, body))
    return blocks


def doc_block(name: str) -> Block:
    """The one block marked `<!-- test: NAME -->`."""
    found = [block for block in doc_blocks() if block.kind == "test" and block.label == name]
    assert len(found) == 1, f"{len(found)} blocks are marked test: {name}"
    return found[0]


def command_lines(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = block.text.replace("\\\n", " ")
    lines = [line.split(" #", 1)[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def without_optional(line: str) -> str:
    """The line without its optional parts: "[--json]", "[--greedy | ...]", "[same ...]"."""
    return re.sub(r" \[(?:--|same )[^\]]*\]", "", line)


def argv(line: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments before the command, the command's words) of one line."""
    words = shlex.split(line)
    environment = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        environment[name] = value
    return environment, words
