"""Every code block of the README and the docs runs in a test or says why it is a sketch.

A block's marker names the test that takes it (`doc_block(NAME)`); this file holds each
name to a test, checks the blocks that are maps of the code and the ones that print, and
tests/slow/end_to_end/test_doc_blocks_slow.py runs the pages' commands on tiny shapes.
"""

import importlib
import re
import sys

import pytest
from conftest import REPO, run_module
from doc_blocks import argv, command_lines, doc_block, doc_blocks

TESTS = REPO / "tests"


def docs_module(name: str):
    """A module of docs/ (the site's build helpers, no package): imported from its folder."""
    if str(REPO / "docs") not in sys.path:
        sys.path.insert(0, str(REPO / "docs"))
    return importlib.import_module(name)


def names_taken_by_tests() -> set[str]:
    """The quoted names in the test files that take blocks (those importing doc_blocks)."""
    names = set()
    for path in TESTS.rglob("*.py"):
        text = path.read_text()
        if "from doc_blocks import" in text:
            names |= set(re.findall(r"\"([\w-]+)\"", text))
    return names


def test_every_block_is_marked_and_every_test_name_is_taken_by_a_test():
    blocks = doc_blocks()
    assert len(blocks) >= 50, len(blocks)  # the parser sees the pages' blocks
    unmarked = [f"{block.page}:{block.line}" for block in blocks if block.kind is None]
    assert not unmarked, f"blocks without <!-- test: NAME --> or <!-- sketch: WHY -->: {unmarked}"
    sketches = [block for block in blocks if block.kind == "sketch"]
    assert all(len(block.label) > 10 for block in sketches)  # each says why
    marked = [block.label for block in blocks if block.kind == "test"]
    assert len(marked) == len(set(marked)), sorted(marked)  # one block per name
    taken = names_taken_by_tests()
    assert not set(marked) - taken, f"no test takes: {sorted(set(marked) - taken)}"
    assert len(sketches) < len(marked)  # most of what the docs show runs


def test_an_indented_block_is_not_left_behind_unmarked():
    """A four-space block outside a list would be code nobody runs: the pages fence theirs."""
    from doc_blocks import hand_written_pages

    for page in hand_written_pages():
        lines, fenced = page.read_text().splitlines(), False
        for index, line in enumerate(lines):
            fenced ^= line.startswith("```")
            starts_block = index > 0 and not lines[index - 1].strip() and line.startswith("    ")
            after_list = index > 1 and lines[index - 2].lstrip().startswith(("-", "*", "1."))
            assert fenced or not starts_block or after_list, f"{page.name}:{index + 1}: {line}"


@pytest.mark.parametrize("name", ["package-map", "architecture-flow", "data-flow"])
def test_the_maps_of_the_code_name_files_and_folders_that_exist(name):
    text = doc_block(name).text
    paths = re.findall(r"(?<![\w/])((?:[a-z_]+/)+(?:[a-z_]+\.py)?)", text)  # nested too
    paths += [f"paisoar_jax/{file}" for file in re.findall(r"(?<![/\w])([a-z_]+\.py)\b", text)]
    assert len(paths) >= 10, paths
    for path in paths:
        where = REPO / "paisoar_jax" / path if not path.startswith("paisoar_jax") else REPO / path
        assert where.exists() or (REPO / path).exists(), f"{name} names {path}"


def test_the_home_page_and_the_readme_give_the_same_two_commands():
    readme = doc_block("readme-train").text + doc_block("readme-tests").text
    assert doc_block("index-commands").text == readme
    assert doc_block("first-run-train").text == doc_block("readme-train").text


def test_ci_runs_the_readmes_test_command():
    """The README's test command is the one .ci/run runs first (its fast tier)."""
    [line] = command_lines(doc_block("readme-tests"))
    install, _, test = line.partition(" && ")
    assert install == 'pip install -e ".[test]"'
    ci = (REPO / ".ci" / "run").read_text()
    assert '-m pip install -q -e ".[test]"' in ci
    _, words = argv(test)
    assert words[:4] == ["python", "-m", "pytest", "-q"]
    assert f"tier fast {' '.join(words[4:])}" in ci


def test_an_unknown_key_prints_what_the_page_shows(tmp_path):
    [shown] = command_lines(doc_block("unknown-key"))
    result = run_module("train", "train.stepz=1", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    [printed] = result.stderr.strip().splitlines()
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    assert re.fullmatch(pattern, printed), printed


def test_the_readme_install_is_the_packages_own(tmp_path):
    """The README's first command: the install part is this project; the rest trains."""
    [line] = command_lines(doc_block("readme-train"))
    install, _, run = line.partition(" && ")
    assert install == "pip install -e ." and run == "python -m paisoar_jax.train"
    assert 'name = "paisoar-jax"' in (REPO / "pyproject.toml").read_text()
    help_text = run_module("train", "--help", cwd=tmp_path, timeout=120)
    assert help_text.returncode == 0 and "train.steps" in help_text.stdout


def test_the_configs_page_names_every_section_and_choice():
    """The sections, optimizers and schedules the configs page lists are the code's."""
    import dataclasses
    import typing

    from paisoar_jax.config import Config
    from paisoar_jax.config.sections import OptimConfig

    page = (REPO / "docs" / "how-to" / "configs.md").read_text().split("**Overrides.**")[0]
    listed = re.findall(r"`(\w+)`", page.split("its sections", 1)[1].split("each field")[0])
    assert listed == [field.name for field in dataclasses.fields(Config)]
    hints = typing.get_type_hints(OptimConfig)
    for key in ("name", "schedule"):
        for choice in typing.get_args(hints[key]):
            assert choice in page.split(f"`optim.{key}`", 1)[1].split("`optim.")[0], choice


def test_every_importable_architecture_is_tested_for_import_export_and_logits():
    """The model-families page (docs/model_families.py) from the tests' checks markers: each
    architecture hf-import reads has a test of each of the three, or the page shows a gap."""
    model_families = docs_module("model_families")

    from paisoar_jax.models.families import ARCHITECTURES

    found = model_families.marks(TESTS)
    for architecture in ARCHITECTURES:
        for workflow in ("import", "export", "logits"):
            assert (workflow, architecture) in found, (workflow, architecture)
    assert ("sharded", "zoo:gpt") in found and ("resume", "zoo:gpt") in found
    page = model_families.page(TESTS)
    assert "| qwen3_moe | ✓ | ✓ | ✓ |" in page  # a table row, marks in the order of columns


def test_the_plan_and_doctor_outputs_are_printed_by_the_pages_commands():
    """The pages include what docs/outputs.py ran at build: the plan of the page's command
    (two layers), and the doctor on a run the page describes; the build test reads them."""
    outputs = docs_module("outputs")

    assert doc_block("plan-output").text.strip() == '--8<-- "docs/generated/plan.txt"'
    assert doc_block("doctor-output").text.strip() == '--8<-- "docs/generated/doctor.txt"'
    [shown] = command_lines(doc_block("plan"))
    page_words = [word for word in argv(shown)[1][3:] if not word.startswith("[")]
    assert set(page_words) - {"mesh.data=1"} <= set(outputs.PLAN[1:])  # the page's, cut short
    assert "optim.lr=30" in outputs.TOO_FAST and outputs.DOCTOR[1] in " ".join(outputs.TOO_FAST)


def test_the_bottleneck_pages_table_names_the_doctors_checks():
    from paisoar_jax.tools.doctor import command

    page = (REPO / "docs" / "how-to" / "bottleneck.md").read_text()
    named = set(re.findall(r"^\| ([a-z]+(?:-[a-z]+)*) \|", page, re.M)) - {"finding"}
    checks = {check.__name__.replace("_", "-") for check in command.CHECKS}
    assert named == checks, (sorted(named - checks), sorted(checks - named))


def test_the_pictures_are_drawn_from_the_code():
    """docs/diagrams.py: the flow's modules exist; the mesh picture names every axis of the
    code's table with what it splits; both are SVG a browser renders without a script."""
    diagrams = docs_module("diagrams")

    from paisoar_jax.config.mesh import AXES

    for _, modules in diagrams.FLOW:
        for module in modules.split(", "):
            assert (REPO / "paisoar_jax" / module).exists(), module
    mesh = diagrams.mesh_axes()
    for axis in AXES:
        assert f"mesh.{axis.name}<" in mesh and axis.splits.split()[0] in mesh, axis.name
    for svg in (mesh, diagrams.data_flow()):
        assert svg.startswith("<svg xmlns='http://www.w3.org/2000/svg'") and "<script" not in svg
    pages = {"index.md": "data-flow.svg", "explanation/data-flow.md": "data-flow.svg"}
    pages["how-to/meshes.md"] = "mesh-axes.svg"
    for page, picture in pages.items():
        assert f"images/generated/{picture})" in (REPO / "docs" / page).read_text(), page


def test_the_files_a_run_may_write_are_the_codes():
    """The run-directory page's table of files written when needed: each name is in the code."""
    page = (REPO / "docs" / "reference" / "run-directory.md").read_text()
    names = re.findall(r"^\| `([\w.]+)/?`(?:, `([\w.]+)`)? \|", page, re.M)
    names = [name for pair in names for name in pair if name]
    assert len(names) >= 6, names
    code = " ".join(path.read_text() for path in (REPO / "paisoar_jax").rglob("*.py"))
    for name in names:
        assert name in code, name
