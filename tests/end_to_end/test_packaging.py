"""A plain (non-editable) install carries the shipped configs: names resolve from anywhere."""

import subprocess

from conftest import PYTHON, REPO, subprocess_env


def test_shipped_config_names_resolve_after_a_plain_install(tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    assert (target / "paisoar_jax" / "configs" / "gpt2_124m.yaml").is_file()
    # Every package of the checkout is in the wheel (parallel/ once was not: train failed).
    packages = {path.parent.relative_to(REPO) for path in REPO.glob("paisoar_jax/**/__init__.py")}
    assert packages and all((target / package / "__init__.py").is_file() for package in packages)
    env = subprocess_env()
    env["PYTHONPATH"] = str(target)  # the installed copy, not the checkout
    probe = (
        "import paisoar_jax.config as c; "
        "print(c.resolve_config_path('gpt2_124m')); print(c.load_config('resnet50').model.name); "
        "import paisoar_jax.run.loop"
    )
    result = subprocess.run(
        [PYTHON, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    path, model = result.stdout.split()
    assert path.startswith(str(target)) and model == "resnet"


def test_the_hf_extra_holds_what_its_commands_need_and_a_pinned_torch():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    names = {requirement.split(">")[0].split("=")[0]: requirement for requirement in extras["hf"]}
    assert {"transformers", "tokenizers", "peft", "torch"} <= set(names)
    # peft asks for torch: unpinned, pip would fetch a CUDA build of several GB.
    assert names["torch"] == "torch==2.13.0" and names["torch"] in extras["test"]


# Imports the package and every public name (each loads its module), then says what changed
# in the environment and in jax's platform setting: nothing may (issue 60).
IMPORT_PROBE = """
import json, os
before = dict(os.environ)
import paisoar_jax
for name in paisoar_jax.__all__:
    getattr(paisoar_jax, name)
import jax
after = dict(os.environ)
changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
print(json.dumps({"changed": changed, "jax_platforms": jax.config.jax_platforms}))
"""


def import_changes(python: str) -> dict:
    """What importing paisoar_jax with `python` changed, JAX_PLATFORMS unset beforehand."""
    import json

    env = {key: value for key, value in subprocess_env().items() if key != "JAX_PLATFORMS"}
    result = subprocess.run(
        [python, "-c", IMPORT_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_package_changes_no_environment_variable():
    """Not JAX_PLATFORMS, not jax's platform: they are chosen where a run starts."""
    assert import_changes(PYTHON) == {"changed": [], "jax_platforms": None}
