"""The package's shape (docs/explanation/architecture.md): every module imports, one way.

Tools (paisoar_jax/tools/) use the core; the core never imports a tool; config imports
nothing of the package but its error type; a `python -m paisoar_jax.<tool>` module is only
the door to its tool.
"""

import ast
import importlib
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "paisoar_jax"
# tools/: modules of their own, and packages of several (each holding the modules named).
TOOLS = {"bench", "overhead", "convert", "export", "generate", "scaling", "evaluate"}
TOOL_PACKAGES = {
    "plan": {"core", "command", "table", "reports", "variants", "fit_search", "context_split"}
    | {"hlo", "gpu_target", "gpu_kernels"},  # the compiled step's analysis, which bench reads too
    "doctor": {
        "command",
        "findings",
        "gradient_findings",
        "memory_findings",
        "moe_findings",
        "scale_findings",
        "loss_findings",
        "scaling_findings",
    },
    "launch": {"arguments", "command", "rank_output", "restarts"},
    "hf": {"checkpoints", "peft", "reader"},
}
COMMANDS = {
    "plan",
    "doctor",
    "bench",
    "convert",
    "export",
    "launch",
    "generate",
    "evaluate",
}  # python -m paisoar_jax.X
FRONT_DOORS = {"paisoar_jax", "paisoar_jax.api", "paisoar_jax.train"}
FRONT_DOORS |= {f"paisoar_jax.{name}" for name in COMMANDS}  # entry points use either side


def module_names():
    """Every module of the package, dotted (paisoar_jax.data.pipeline, ...)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name):
    """The file of dotted module `name`."""
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    return path if path.exists() else PACKAGE.parent / name.replace(".", "/") / "__init__.py"


def package_imports(name, runtime_only=False):
    """The package modules `name` imports, dotted, function-local imports included.

    `runtime_only`: without the imports of `if TYPE_CHECKING:` blocks (what type checkers
    read; importing the module never runs them)."""
    imported = set()
    known = set(module_names())
    tree = ast.parse(module_path(name).read_text())
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paisoar_jax"):
            for alias in node.names:  # `from paisoar_jax.tools import plan` names a module
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("paisoar_jax")}
    return imported


def is_tool(name):
    return name == "paisoar_jax.tools" or name.startswith("paisoar_jax.tools.")


@pytest.mark.parametrize("name", list(module_names()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_core_never_imports_a_tool():
    # The scan sees function-local imports too: api imports the plan tool inside plan_fit.
    assert "paisoar_jax.tools.plan" in package_imports("paisoar_jax.api")
    offenders = {}
    for name in module_names():
        if is_tool(name) or name in FRONT_DOORS:
            continue
        tools = sorted(filter(is_tool, package_imports(name)))
        if tools:
            offenders[name] = tools
    assert not offenders, f"core modules importing tools: {offenders}"


def imports_with_packages(name, known):
    """What importing `name` runs: the modules it imports and the packages above them
    (Python runs a package's __init__ before its module), its own packages left out."""
    found = set()
    for imported in package_imports(name, runtime_only=True) - {name}:
        parts = imported.split(".")
        parents = {".".join(parts[:end]) for end in range(2, len(parts))}
        found |= {imported} | {
            parent for parent in parents if parent in known and not name.startswith(parent)
        }
    return found


def test_no_module_imports_itself_through_others():
    """No import cycle, however long, function-local imports and packages' __init__ included
    (bench and overhead, convert and hf, plan and its variants were cycles)."""
    known = set(module_names())
    graph = {name: imports_with_packages(name, known) & known for name in known}
    in_cycles = []
    for name in sorted(known):
        reached, frontier = set(), set(graph[name])
        while frontier:
            reached |= frontier
            frontier = set().union(*(graph[other] for other in frontier)) - reached
        if name in reached:
            in_cycles.append(name)
    assert not in_cycles, in_cycles


def test_config_is_a_leaf():
    for name in module_names():
        if name == "paisoar_jax.config" or name.startswith("paisoar_jax.config."):
            others = {
                imported
                for imported in package_imports(name)
                if imported != "paisoar_jax.errors"
                and not imported.startswith("paisoar_jax.config")
            }
            assert not others, f"{name} imports {sorted(others)}"


def test_the_tools_live_in_tools_and_each_command_is_only_its_door():
    assert {path.stem for path in (PACKAGE / "tools").glob("*.py")} == TOOLS | {"__init__"}
    packages = {
        path.name for path in (PACKAGE / "tools").iterdir() if (path / "__init__.py").is_file()
    }
    assert packages == set(TOOL_PACKAGES)
    for package, modules in TOOL_PACKAGES.items():
        found = {path.stem for path in (PACKAGE / "tools" / package).glob("*.py")}
        assert found == modules | {"__init__"}, package
    for command in COMMANDS:
        name = f"paisoar_jax.{command}"
        (door,) = package_imports(name)  # the tool, or its package's command line
        assert door in (f"paisoar_jax.tools.{command}", f"paisoar_jax.tools.{command}.command")
        assert len(module_path(name).read_text().splitlines()) < 12, name


def test_every_line_for_the_user_goes_through_output():
    printing = [
        name
        for name in module_names()
        if name != "paisoar_jax.output"
        for node in ast.walk(ast.parse(module_path(name).read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
    ]
    assert not printing, f"print outside paisoar_jax/output.py: {sorted(set(printing))}"


def test_the_library_never_imports_torch_or_transformers():
    for name in module_names():
        for node in ast.walk(ast.parse(module_path(name).read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            else:
                continue
            roots = {item.split(".")[0] for item in imported}
            assert not roots & {"torch", "transformers"}, f"{name} imports {sorted(roots)}"


def test_every_function_reads_in_one_screen():
    """Under 80 lines each (issue 49: a newcomer reads one without scrolling twice)."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name in module_names()
        for node in ast.walk(ast.parse(module_path(name).read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 >= 80
    ]
    assert not long, long


def test_every_task_has_every_member_the_task_protocol_declares():
    """workload.Task is the whole contract: the language, image and fit tasks each have all
    its members, and the step and eval read them as declared (no getattr with a default)."""
    import inspect
    import typing

    from paisoar_jax.tasks.builtin import ImageClassification, LanguageModelling
    from paisoar_jax.tasks.custom import CustomTask
    from paisoar_jax.tasks.workload import Task

    declared = set(typing.get_type_hints(Task)) | {
        name for name, value in vars(Task).items() if inspect.isfunction(value)
    }
    assert {"loss_weight", "reports_perplexity", "closing_sample"} <= declared
    for task in (CustomTask, ImageClassification, LanguageModelling):
        missing = sorted(name for name in declared if not hasattr(task, name))
        # The fit task's metric names are its instance's: known once its loss is traced.
        assert missing == (["metric_names"] if task is CustomTask else []), task.__name__
    for path in PACKAGE.rglob("*.py"):
        assert 'getattr(task, "' not in path.read_text(), path


def test_every_door_starts_a_run_through_startup_start():
    """The command line (cli.run) and the library (fit, initialize) begin a run with the one
    start-up function, so the order of its steps cannot differ between them."""
    import inspect

    from paisoar_jax import api, cli

    for door in (cli.run, api._started, api.initialize):
        assert "start(" in inspect.getsource(door), door.__qualname__
    for door in (api.fit, api.prepare):  # the library's runs start through api._started
        assert "_started(" in inspect.getsource(door), door.__qualname__
    for path in PACKAGE.rglob("*.py"):
        if path.name != "startup.py":
            assert "mark_as_parsed" not in path.read_text(), path


def test_functions_and_modules_stay_readable_in_one_sitting():
    """No function over 80 lines, no module over 500: a longer one is split by concern."""
    longest, largest = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            largest.append(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > 80:
                    longest.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not longest, longest
    assert not largest, largest


def test_no_entry_point_prepares_hf_data_itself():
    """`data.source=hf:` is tokenized by the task that opens it (data/hf_sources.py), so a
    door that opens the data (train, fit, bench, overhead) cannot forget it. The one other
    reader is `source_examples`, which hands a user the examples themselves."""
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("hf_sources.py", "builtin.py", "source_examples.py"):
            assert "hf_sources.prepare" not in path.read_text(), path


def test_the_architecture_page_names_what_exists_and_every_wing():
    """docs/explanation/architecture.md stays true: each module path it names exists, each wing (a
    folder of the package with an __init__) is on it, its __init__ saying what it owns."""
    page = (PACKAGE.parent / "docs" / "explanation" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]*(?:\.py)?)", page))
    missing = [
        path
        for path in named
        if not path.startswith(("tests/", "docs/", "paisoar_jax/", "examples/"))
        and (path.endswith(".py") or path.endswith("/"))
        and not (PACKAGE / path).exists()
    ]
    assert not missing, missing
    tests = [path for path in named if path.startswith("tests/") and path.endswith(".py")]
    assert tests and all((PACKAGE.parent / path).exists() for path in tests), tests
    wings = [path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()]
    for wing in wings:
        assert f"\n  {wing}/" in page, wing  # a line of the package's map
        docstring = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text()))
        assert docstring, wing
    top = [path.stem for path in PACKAGE.glob("*.py") if len(path.read_text().splitlines()) > 40]
    # The faces (cli: the doors' shared parsing and exit statuses); the doors are short.
    assert sorted(top) == ["__init__", "api", "cli", "errors", "output"]


# The functions of the core that may take the whole Config (docs/explanation/architecture.md, "The
# config, resolved once"): the doors, the start of a run, the workload builders and setup.
# Below them each piece gets its section or a built object.
TAKE_THE_WHOLE_CONFIG = {
    "train.py::_train",
    "run/startup.py::start",
    "run/loop.py::run",
    "tasks/fit_parts.py::build_workload",
    "tasks/zoo.py::zoo_workload",
    "run/setup.py::setup",
}


def takes_the_whole_config(node: ast.FunctionDef) -> bool:
    """A parameter typed Config (alone, optional or quoted), or one named config untyped."""
    arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    for argument in arguments:
        annotation = ast.unparse(argument.annotation) if argument.annotation else ""
        typed = re.fullmatch(r"['\"]?Config['\"]?( \| None)?", annotation)
        if typed or (argument.arg == "config" and not annotation):
            return True
    return False


def test_only_the_doors_and_setup_take_the_whole_config():
    """Outside tools/, api.py and config/, the Config is taken apart in the few functions
    listed (issue 60: 41 functions took it, most to read one section or pass it on)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("tools/", "config/")) or relative == "api.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if takes_the_whole_config(node):
                    found.add(f"{relative}::{node.name}")
    assert found == TAKE_THE_WHOLE_CONFIG, (
        f"new: {sorted(found - TAKE_THE_WHOLE_CONFIG)}; "
        f"gone: {sorted(TAKE_THE_WHOLE_CONFIG - found)}"
    )
    assert len(TAKE_THE_WHOLE_CONFIG) <= 6


def test_the_config_check_itself_finds_a_function_of_the_whole_config():
    """The scan above is not blind: it sees each way a parameter takes the Config."""
    for source in (
        "def f(config: Config): ...",
        "def f(x, config: Config | None = None): ...",
        "def f(*, settings: 'Config'): ...",
        "def f(config): ...",
    ):
        assert takes_the_whole_config(ast.parse(source).body[0]), source
    for source in ("def f(train: TrainConfig): ...", "def f(model_config): ..."):
        assert not takes_the_whole_config(ast.parse(source).body[0]), source


TESTS = pathlib.Path(__file__).resolve().parent


def test_the_tests_mirror_the_wings_and_take_their_tier_from_their_folder():
    """tests/<wing>/ per wing of the package, tests/end_to_end/, tests/slow/ and
    tests/gpu_aot/ (conftest.py marks their tests), and no more than a handful of files flat
    in tests/; no test is marked slow or gpu_aot by hand (a parameter's settings may be)."""
    flat = sorted(path.name for path in TESTS.glob("*.py"))
    assert len(flat) <= 5, flat
    wings = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    folders = {path.name for path in TESTS.iterdir() if path.is_dir()}
    assert wings - {"configs"} <= folders, sorted(wings - folders)
    assert {"end_to_end", "slow", "gpu_aot"} <= folders
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                marks = [ast.unparse(decorator) for decorator in node.decorator_list]
                hand_marked = {"pytest.mark.slow", "pytest.mark.gpu_aot"} & set(marks)
                assert not hand_marked, f"{path.relative_to(TESTS)}::{node.name} {hand_marked}"


def test_no_function_of_run_takes_more_than_five_parameters():
    """The run's pieces travel as typed objects (Setup, Loop, Saver, Instruments), not as
    long argument lists (issue 68: 10 functions of run/ took more than 5)."""
    long = []
    for path in (PACKAGE / "run").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                names = [argument.arg for argument in arguments if argument.arg != "self"]
                if len(names) > 5:
                    long.append(f"{path.name}::{node.name} ({len(names)})")
    assert not long, long
