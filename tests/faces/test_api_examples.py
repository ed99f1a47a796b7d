"""The API reference's promises: every public name is on the page, documented and with an
example that runs.

docs/reference/api.md renders each entry's docstring (its Args, Returns and Example). Here:
the page lists every name of `paisoar_jax.__all__`; each function documents every parameter
and what it returns; each entry's example is Python that parses, and those that train
nothing run (tests/slow/faces/test_api_examples_slow.py runs every one, in page order).
"""

import ast
import inspect

import pytest
from api_entries import api_entries, example_code

import paisoar_jax

# The entries whose examples run here: they train nothing (the slow tier runs the rest).
QUICK = ("load_config", "Config", "force_policy", "fp32_function", "remat_block")
QUICK += ("scan_layers", "input_slot", "token_windows", "source_examples")
QUICK += ("UserError",)
# The classes a user constructs (the others fit and prepare return): their Args too.
CONSTRUCTED = ("Eval", "Generator")


def test_the_page_lists_every_public_name():
    on_page = {path.rpartition(".")[2] for path, _ in api_entries()}
    public = set(paisoar_jax.__all__) - {"__version__"}
    assert not public - on_page, f"public names missing from the API page: {public - on_page}"
    assert len(on_page) == len(api_entries())  # each once


@pytest.mark.parametrize(("path", "target"), api_entries(), ids=[p for p, _ in api_entries()])
def test_each_entry_documents_its_parameters_and_has_an_example(path, target):
    """Before: the page's 19 entries had no parameter tables and no examples."""
    docstring = inspect.getdoc(inspect.unwrap(target)) or ""
    code = example_code(target)
    assert code, f"{path}: no Example section with a ```python block"
    ast.parse(code)  # Python, as written
    constructed = inspect.isclass(target) and path.endswith(CONSTRUCTED)
    if inspect.isfunction(inspect.unwrap(target)) or constructed:
        signature = inspect.signature(inspect.unwrap(target))
        arguments = docstring.partition("\nArgs:\n")[2].partition("\n\n")[0]
        for name, parameter in signature.parameters.items():
            stars = "**" if parameter.kind is parameter.VAR_KEYWORD else ""
            assert f"    {stars}{name}:" in arguments, f"{path}: Args leaves out {name}"
        if not inspect.isclass(target) and signature.return_annotation not in (None, "None"):
            assert "\nReturns:\n" in docstring, f"{path}: no Returns section"


def test_the_examples_that_train_nothing_run(tmp_path, monkeypatch, devices, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = {"paisoar_jax": paisoar_jax}
    ran = []
    for path, target in api_entries():
        if path.rpartition(".")[2] in QUICK:
            exec(compile(example_code(target), path, "exec"), namespace)
            ran.append(path)
    assert len(ran) == len(QUICK)
    printed = capsys.readouterr().out
    assert "optim.lr must be > 0" in printed  # UserError's example printed the one line
    assert "float32" in printed and "(2, 10)" in printed  # fp32_function's, force_policy's
