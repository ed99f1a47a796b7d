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
