"""The package's shape (docs/architecture.md): every module imports; the core imports no tool."""

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "paisoar_jax"
TOOLS = {"plan", "hlo", "doctor", "findings", "bench", "overhead", "convert", "export"}
TOOLS |= {"launch", "rank_output", "cli"}
FRONT_DOORS = {"__init__", "api", "train"}  # the public entry points use either side


def module_names():
    """Every module of the package, dotted (paisoar_jax.data.pipeline, ...)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(name):
    """The top-level package modules a module imports, function-local imports included."""
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paisoar_jax"):
            parts = node.module.split(".")
            imported |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("paisoar_jax.")
            }
    return imported


@pytest.mark.parametrize("name", list(module_names()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_core_never_imports_a_tool():
    # The scan sees function-local imports too: api imports plan inside plan_fit.
    assert "plan" in package_imports("paisoar_jax.api")
    offenders = {}
    for name in module_names():
        top = name.split(".")[1] if "." in name else "__init__"
        if top in TOOLS or top in FRONT_DOORS:
            continue
        tools = package_imports(name) & TOOLS
        if tools:
            offenders[name] = sorted(tools)
    assert not offenders, f"core modules importing tools: {offenders}"


def test_every_tool_named_here_exists():
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert TOOLS | FRONT_DOORS <= modules
