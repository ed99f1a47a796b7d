import dataclasses

import jax
import pytest
import yaml
from conftest import task_for

from paisoar_jax.config import CONFIG_DIR, Config, dump_yaml, load_config, resolve_config_path
from paisoar_jax.errors import UserError

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def test_configs_are_shipped():
    names = {path.stem for path in SHIPPED}
    assert {"default", "gpt2_124m", "gpt_1b"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_parses(path):
    config = load_config(str(path))
    assert isinstance(config, Config)
    assert config.run.name == path.stem
    # Every key in the file made it into the config (nothing silently dropped).
    raw = yaml.safe_load(path.read_text())
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(config, section), key) == pytest.approx(value)
    # The checks that need the model's tables (an image variant's shape, fp8 blocks) pass.
    assert task_for(config) is not None


def test_shipped_shapes():
    gpt2 = load_config("gpt2_124m").model
    assert (gpt2.layers, gpt2.width, gpt2.heads, gpt2.vocab_size, gpt2.seq_len) == (
        12,
        768,
        12,
        50304,
        1024,
    )
    big = load_config("gpt_1b").model
    assert (big.layers, big.width, big.heads, big.seq_len) == (24, 2048, 16, 2048)


def test_default_file_equals_builtin_defaults():
    assert load_config("default") == load_config(None, ["run.name=default"])


def test_overrides_are_typed():
    config = load_config(
        None, ["optim.lr=1e-3", "train.steps=7", "model.tie_embeddings=false", "mesh.fsdp=2"]
    )
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.train.steps == 7
    assert config.model.tie_embeddings is False
    assert config.mesh.fsdp == 2


def test_yaml_scientific_notation_and_ints_become_floats(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  weight_decay: 0\n")
    config = load_config(str(path))
    assert config.optim.lr == 3e-4 and config.optim.weight_decay == 0.0
    assert config.run.name == "run"


def test_dump_yaml_round_trips(tmp_path):
    config = load_config("gpt_1b", ["optim.lr=1e-5"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(config))
    assert load_config(str(path)) == config


def test_sections_are_frozen():
    config = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.steps = 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=3"], "unknown config key train.stepz"),
        (["nosection.key=1"], "unknown config section 'nosection'"),
        (["train.steps=three"], "train.steps: expected int, got 'three'"),
        (["optim.lr=fast"], "optim.lr: expected float"),
        (["model.tie_embeddings=maybe"], "model.tie_embeddings: expected bool"),
        (["optim.name=adagrad"], "optim.name: 'adagrad' is not one of adamw, sgd, lamb, lars"),
        (["trainsteps=3"], "is not of the form section.key"),
        (["train.steps"], "is not of the form section.key=value"),
        (["model.width=100", "model.heads=3"], "model.width=100 is not divisible by model.heads=3"),
        (["train.global_batch=10", "train.grad_accum=4"], "not divisible by train.grad_accum=4"),
        (["mesh.zero=4"], "mesh.zero must be 0, 1, 2 or 3"),
        (["mesh.data=0"], "mesh.data must be a positive size or -1"),
        (["mesh.tensor=-2"], "mesh.tensor must be a positive size or -1"),
        (["mesh.dcn_data=-1"], "mesh.dcn_data must be a positive size, got -1: the dcn axes"),
        (["mesh.dcn_context=0"], "mesh.dcn_context must be a positive size"),
        (["train.steps=0"], "train.steps must be >= 1"),
        (["optim.lr_scaling=linear"], "needs optim.base_batch >= 1"),
        (["data.eval_fraction=0"], "data.eval_fraction=0 leaves the default eval set no data"),
        (
            ["data.eval_fraction=0", "data.eval_sets=[[synthetic,0]]"],
            "train.eval_every=0 too and give each of data.eval_sets its own every",
        ),
        (["train.eval_every=-1"], "train.eval_every must be >= 0"),
        (["train.eval_batches=-1"], "train.eval_batches must be >= 0"),
        (["remat.blocks=[blocks]"], "remat.policy=none checkpoints nothing: set remat.policy="),
        (["optim.warmup_steps=-5"], "optim.warmup_steps must be >= 0"),
        (["data.workers=-1"], "data.workers must be >= 0"),
        (["optim.clip_norm=-1"], "optim.clip_norm must be a finite number >= 0"),
        (["optim.lr=inf"], "optim.lr must be a finite number"),
        (["optim.lr=nan"], "optim.lr must be > 0"),
        (["checkpoint.keep=0"], "checkpoint.keep must be >= 1"),
        (["checkpoint.every=-1"], "checkpoint.every must be >= 0"),
        (["checkpoint.resume=latest"], "checkpoint.resume must be auto, never or a step"),
        (["model.variant=resnet50"], "model.variant: it belongs to model.name=resnet|vgg|vit"),
        (["model.name=vit", "model.seq_len=8"], "model.seq_len: it belongs to model.name=gpt"),
        (["model.name=alexnet"], "model.name='alexnet' is not one of gpt, llama, resnet, vgg, vit"),
        (["model.name=resnet", "model.num_classes=1"], "model.num_classes must be >= 2"),
        (["data.mixup_alpha=0.2"], "data.mixup_alpha is for image models"),
        (["train.steps=10", "train.profile_steps=[5,20]"], "ends after the last step"),
        (["train.profile_steps=[0,3]"], "train.profile_steps must be [start, end]"),
        (["train.profile_steps=x"], "expected a list of integers like [10, 20]"),
        (["train.memory_limit_gb=-1"], "train.memory_limit_gb must be a finite number >= 0"),
        (["model.experts_per_token=1"], "model.experts_per_token is for a mixture of experts"),
        (["model.experts=1"], "model.experts must be >= 2"),
        (["model.loss_chunks=-2"], "model.loss_chunks must be >= -1"),
        (["model.experts=4", "model.experts_per_token=5"], "is more than the model.experts=4"),
        (["model.experts=4", "model.moe_every=2"], "set model.scan_layers=false"),
        (["model.experts=4", "model.moe_every=9"], "no layer would have experts"),
        (["model.experts=4", "model.router_aux_loss=-1"], "model.router_aux_loss must be a"),
        (["model.experts=4", "model.router_bias_rate=-1"], "model.router_bias_rate must be a"),
        (["model.experts=4", "mesh.stage=2", "model.router_bias_rate=0.01"], "does not pipeline"),
        (["model.experts=4", "model.router=top1"], "'top1' is not one of softmax, sigmoid"),
        (["mesh.expert=2"], "splits the experts of the zoo's decoders (model.experts), and"),
        (["model.name=custom", "mesh.expert=2"], "a model of your own cannot use it yet"),
        (["model.experts=4", "mesh.expert=3"], "does not split over the 3 expert shards"),
        (["model.experts=4", "mesh.expert=0"], "mesh.expert must be a positive size"),
        (["model.experts=4", "mesh.expert=2", "mesh.grad_comm=bf16"], "with mesh.expert > 1"),
        (["data.eval_sets=[[synthetic,-1]]"], "synthetic: every is the steps between its evals"),
        (["data.eval_sets=[[synthetic,2,s,[x]]]"], "s's hf_split is a split's name, got ['x']"),
        (["data.eval_sets=[[synthetic,2,s,v,w]]"], "[source, every, name, hf_split], got"),
        (["data.eval_sets=[[synthetic,2],[synthetic,5]]"], "two sources are named synthetic"),
        (["data.eval_sets=[[images:x,2]]"], "'images:x' is not a token source"),
        (["data.eval_sets=[[synthetic,2,a/b]]"], "the name 'a/b' of synthetic is not made of"),
        (['data.eval_sets=[["hf:",2]]'], "data.source=hf: names no path"),
        (["data.eval_sets=[[synthetic,0]]", "train.eval_every=0"], "give it its own every"),
        (["model.name=resnet", "data.eval_sets=[[synthetic,2]]"], "data.eval_sets holds token"),
    ],
)
def test_bad_overrides_raise_one_clear_line(overrides, message):
    with pytest.raises(UserError) as error:
        load_config(None, overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_yaml_types(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: [1, 2]\n")
    with pytest.raises(UserError, match="train.steps: expected int"):
        load_config(str(path))
    path.write_text("train: 3\n")
    with pytest.raises(UserError, match="train: expected a mapping"):
        load_config(str(path))
    path.write_text("bogus:\n  a: 1\n")
    with pytest.raises(UserError, match="unknown config section 'bogus'"):
        load_config(str(path))


def test_errors_in_a_yaml_file_name_its_line(tmp_path):
    """Before: the YAML parser's line was dropped, and a bad value named no line."""
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: gpt\ntrain:\n  steps: 10\n  stepz: 5\n")
    with pytest.raises(UserError, match=r"unknown config key train.stepz .*\(.*bad.yaml:5\)$"):
        load_config(str(path))
    path.write_text("model:\n  width: 100\n  heads: 3\n")
    with pytest.raises(UserError, match=r"not divisible by model.heads=3 \(.*bad.yaml:2\)$"):
        load_config(str(path))
    with pytest.raises(UserError, match=r"^model.width: expected int, got 'x'$"):
        load_config(str(path), ["model.width=x"])  # the override's fault, not the file's
    path.write_text("train:\n  steps: 10\n    seed: 3\n")
    with pytest.raises(UserError, match=r"bad.yaml:3: not valid YAML \(mapping values"):
        load_config(str(path))


def test_a_double_quoted_regex_in_rules_says_how_to_quote_it():
    """A regex in double quotes is no YAML (\\. is not an escape there); in single quotes it is."""
    with pytest.raises(UserError, match=r"double quotes YAML reads \\ as an escape: single-quote"):
        load_config(None, ['sharding.rules=[["out\\.kernel", [null, tensor]]]'])
    loaded = load_config(None, ["sharding.rules=[['out\\.kernel', [null, tensor]]]"])
    assert loaded.sharding.rules[0][0] == "out\\.kernel"


def test_missing_config_file():
    with pytest.raises(UserError, match="config file not found: nowhere.yaml"):
        resolve_config_path("nowhere.yaml")
    assert resolve_config_path("gpt2_124m") == CONFIG_DIR / "gpt2_124m.yaml"


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    """Before: `train --help` listed no config key (the schedule was found in a config.yaml)."""
    import dataclasses

    from paisoar_jax import train
    from paisoar_jax.config import keys

    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    for section, classes in keys.SECTIONS.items():
        for owner in classes:
            for field in dataclasses.fields(owner):
                assert f"  {section}.{field.name}=" in text, field.name
    line = next(line for line in text.splitlines() if line.startswith("  train.eval_batches=0 "))
    assert "0: every eval reads the whole eval set" in line
    assert "  optim.schedule=cosine" in text and "  mesh.zero=0 " in text
    assert max(len(line) for line in text.splitlines()) <= 88  # a terminal's width


def test_every_key_has_a_meaning_and_a_choice_lists_its_values(capsys):
    """Before: 33 keys (model.layers, optim.schedule, train.steps, ...) had no meaning, on the
    site as in --help, and precision.policy listed none of its values."""
    from paisoar_jax import train
    from paisoar_jax.config.keys import key_table

    rows = key_table()
    assert len(rows) >= 150
    blank = [row.key for row in rows if len(row.meaning) < 12]
    assert not blank, f"keys without a meaning (write a comment beside them): {blank}"
    by_key = {}
    for row in rows:  # a key both model families have: the language models' first
        by_key.setdefault(row.key, row)
    assert by_key["precision.policy"].allowed == "fp32 | bf16 | fp16 | fp8"
    assert by_key["optim.schedule"].allowed == "cosine | linear | constant"
    assert by_key["checkpoint.async_save"].allowed == "true | false"
    assert by_key["model.heads"].family == "gpt, llama"
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    assert "[fp32 | bf16 | fp16 | fp8]" in text  # the values, in --help as on the site
    assert "  model.num_classes=1000                (resnet, vgg, vit) classes of" in text


def test_the_mesh_section_sizes_each_axis_of_the_table_and_nothing_else():
    """config/mesh.py's AXES is the one list of mesh axes: MeshConfig has a size for each
    (and a dcn_ size for each that spans hosts), and the mesh is built with those axes."""
    from paisoar_jax.config import MeshConfig
    from paisoar_jax.config.mesh import AXES, AXIS_NAMES, DCN_NAMES
    from paisoar_jax.parallel import sharding

    settings = {"zero", "grad_comm", "grad_comm_block", "grad_comm_error_feedback"}
    settings |= {"grad_comm_scope", "bucket_mb"}
    fields = {field.name for field in dataclasses.fields(MeshConfig)}
    assert fields - settings == set(AXIS_NAMES) | set(DCN_NAMES)
    # The mesh jax builds has the table's axes, in the table's order (written out here).
    built = sharding.build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    expected = ("data", "stage", "fsdp", "expert", "context", "tensor")
    assert AXIS_NAMES == expected and tuple(built.axis_names) == expected
    assert sharding.BATCH_AXES == ("data", "fsdp", "expert")
    assert [axis.name for axis in AXES if axis.fills] == ["data", "fsdp", "tensor"]
    mesh = MeshConfig(data=2, fsdp=2, dcn_data=3, context=2)
    assert mesh.shape() == {
        "data": 6,
        "stage": 1,
        "fsdp": 2,
        "expert": 1,
        "context": 2,
        "tensor": 1,
    }
    assert mesh.hosts() == 3 and MeshConfig().shape() is None
    assert mesh.describe() == "data=2,fsdp=2,context=2,tensor=1,dcn_data=3"
