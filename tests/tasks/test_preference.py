"""Preference optimisation (tasks/preference.py): DPO against TRL and an exact reference.

A tiny random Llama with a BPE tokenizer is built with transformers and imported; eight
preference records are converted with `--format preference`. Our DPO steps (plain SGD,
no clipping, the whole set one batch) are checked against TRL's DPOTrainer on the same
model and records, and against a float64 DPO written here on transformers' model.
"""

import copy
import json
import math

import numpy as np
import pytest
import torch  # the [test] extra's reference implementation (never imported by the library)
import transformers
from conftest import TINY, WORDS, random_chats, run_records, tiny_llama_import, train

import paisoar_jax
from paisoar_jax.config import DpoConfig, load_config
from paisoar_jax.data.preferences import PreferenceWindows
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.data.text_conversion import TextConversion, convert_text
from paisoar_jax.errors import UserError
from paisoar_jax.tasks.preference import METRIC_NAMES
from paisoar_jax.tools import hf

PAIRS, STEPS, LR, SEQ_LEN = 8, 3, 0.5, 24
SGD = [
    "optim.name=sgd",
    "optim.momentum=0",
    f"optim.lr={LR}",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.clip_norm=0",
    "optim.weight_decay=0",
]


def preference_records(count, seed=1):
    """Text records: a prompt of four words, two answers of one to four."""
    rng = np.random.default_rng(seed)

    def words(low, high):
        return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))

    return [
        {"prompt": words(4, 5) + ":", "chosen": " " + words(1, 5), "rejected": " " + words(1, 5)}
        for _ in range(count)
    ]


def convert_pairs(records, output, tokenizer):
    """`convert text --format preference` of `records`, written beside `output` first."""
    source = output.with_suffix(".jsonl")
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    convert_text(
        TextConversion(
            output=output,
            input=(str(source),),
            format="preference",
            tokenizer=str(tokenizer),
            progress=False,
        )
    )


def pair_rows(directory, seq_len):
    """Every row of a converted preference dataset, one pair a row."""
    records = TokenRecords(directory)
    plan = PreferenceWindows.plan_for(records, seq_len, "padding")
    return PreferenceWindows(records, seq_len, "padding", plan, 0, len(plan) - 1)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(root: its hf/, imported/ and converted pairs/; the records; the tokenizer)."""
    root = tmp_path_factory.mktemp("dpo")
    tokenizer = tiny_llama_import(root)
    records = preference_records(PAIRS)
    convert_pairs(records, root / "pairs", root / "hf")
    return root, records, tokenizer


def dpo_run(root, name, *overrides):
    """Our DPO run of the import on the converted pairs: its metrics.jsonl records."""
    paisoar_jax.fit(
        str(root / "imported" / "config.yaml"),
        [
            "train.objective=dpo",
            f"data.source=arrayrecord:{root / 'pairs'}",
            "data.eval_fraction=0",
            "train.eval_every=0",
            f"train.global_batch={PAIRS}",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "train.sample_bytes=0",
            f"model.seq_len={SEQ_LEN}",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.dir={root / name}",
            *SGD,
            *overrides,
        ],
    )
    return [record for record in run_records(root / name) if "loss" in record]


def float64_dpo(root, beta=0.1):
    """An independent DPO in float64 on transformers' model: (loss, margin mean) per step."""
    windows = pair_rows(root / "pairs", SEQ_LEN)
    rows = [windows[index] for index in range(PAIRS)]
    tokens = torch.tensor(np.stack([row["tokens"] for row in rows]).reshape(2 * PAIRS, -1))
    mask = torch.tensor(np.stack([row["loss_mask"] for row in rows]).reshape(2 * PAIRS, -1))
    model = transformers.LlamaForCausalLM.from_pretrained(root / "hf").double()
    reference = copy.deepcopy(model).eval()

    def log_probs(network):
        logits = network(tokens[:, :-1].long()).logits
        taken = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None].long())[..., 0]
        return (taken * mask).sum(1).reshape(PAIRS, 2)

    with torch.no_grad():
        reference_logps = log_probs(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    results = []
    for _ in range(STEPS):
        ratios = log_probs(model) - reference_logps
        margins = beta * (ratios[:, 0] - ratios[:, 1])
        loss = -torch.nn.functional.logsigmoid(margins).mean()
        results.append((loss.item(), margins.mean().item()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return results


def trl_dpo(root, records, tokenizer):
    """TRL's DPOTrainer on the same model and records: its logged records per step."""
    import datasets
    import trl

    arguments = trl.DPOConfig(
        output_dir=str(root / "trl"),
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="sgd",
        max_grad_norm=0.0,
        weight_decay=0.0,
        per_device_train_batch_size=PAIRS,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        beta=0.1,
        max_length=None,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = trl.DPOTrainer(
        model=transformers.LlamaForCausalLM.from_pretrained(root / "hf"),
        args=arguments,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(records),
    )
    trainer.train()
    return [record for record in trainer.state.log_history if "loss" in record]


def test_dpo_steps_equal_an_exact_reference_and_trls(imported):
    """Three SGD steps: float64's losses to 1e-6; TRL's first batch to 1e-4, then to 2e-3.

    TRL's fused head sums log-probs 3e-5 off transformers' own (ours are 1e-7 off), and an
    lr of 0.5 grows that by the third step; the float64 DPO is the exact check.
    """
    root, records, tokenizer = imported
    ours = dpo_run(root, "run")
    exact = float64_dpo(root)
    assert [record["step"] for record in ours] == [1, 2, 3]
    assert ours[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is the reference
    for record, (loss, margin) in zip(ours, exact, strict=True):
        assert record["loss"] == pytest.approx(loss, rel=1e-5)
        assert record["rewards/margins"] == pytest.approx(margin, rel=1e-4, abs=1e-6)
    assert ours[-1]["rewards/accuracies"] == 1.0 and ours[-1]["loss"] < 0.5
    theirs = trl_dpo(root, records, tokenizer)
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        tolerance = 1e-4 if step == 0 else 2e-3
        for name in ("loss", *METRIC_NAMES):
            assert mine[name] == pytest.approx(float(reference[name]), rel=tolerance, abs=1e-3), (
                step,
                name,
            )


LOSSES = {  # each loss type, written from its paper with TRL's conventions
    "sigmoid": lambda m, ratio, mean, settings: -math.log(1 / (1 + math.exp(-m))),
    "hinge": lambda m, ratio, mean, settings: max(0.0, 1 - m),
    "ipo": lambda m, ratio, mean, settings: (ratio - 1 / (2 * settings.beta)) ** 2,
    "simpo": lambda m, ratio, mean, settings: math.log1p(
        math.exp(-settings.beta * (mean[0] - mean[1] - settings.simpo_gamma / settings.beta))
    ),
    "orpo": lambda m, ratio, mean, settings: (
        -mean[0]
        + settings.beta
        * math.log1p(
            math.exp(
                -(
                    mean[0]
                    - mean[1]
                    - math.log(1 - math.exp(mean[0]))
                    + math.log(1 - math.exp(mean[1]))
                )
            )
        )
    ),
}


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_each_loss_type_follows_its_formula(loss_type):
    """Pair losses of fixed log-probs equal the formula, pair by pair, with a packed slot."""
    from paisoar_jax.tasks.preference import PreferenceOptimisation

    settings = DpoConfig(beta=0.2, loss_type=loss_type)
    task = PreferenceOptimisation.__new__(PreferenceOptimisation)
    task.settings = settings
    rng = np.random.default_rng(0)
    log_probs = -rng.uniform(2, 9, (3, 2, 2)).astype(np.float32)
    reference = -rng.uniform(2, 9, (3, 2, 2)).astype(np.float32)
    counts = rng.integers(1, 6, (3, 2, 2)).astype(np.float32)
    counts[2, :, 1] = 0  # row 2 holds one pair
    terms = task.pair_losses({"reference": reference}, log_probs, counts)
    for row in range(3):
        for slot in range(2):
            valid = counts[row, :, slot].all()
            assert terms["valid"][row, slot] == valid
            if not valid:
                continue
            logps, reference_logps = log_probs[row, :, slot], reference[row, :, slot]
            lengths = counts[row, :, slot]
            ratios = logps - reference_logps
            margin = settings.beta * (ratios[0] - ratios[1])
            per_token = ratios[0] / lengths[0] - ratios[1] / lengths[1]
            expected = LOSSES[loss_type](margin, per_token, logps / lengths, settings)
            assert float(terms["loss"][row, slot]) == pytest.approx(expected, rel=1e-5)


def test_conversion_tokenizes_as_trl_does(imported, chat_tokenizer, tmp_path):
    """Text pairs as tokenizer(prompt + response + EOS); chats through the template."""
    root, records, tokenizer = imported
    windows = pair_rows(root / "pairs", 64)
    for index, record in enumerate(records):
        prompt = tokenizer(record["prompt"])["input_ids"]
        row = windows[index]
        for side, name in enumerate(("chosen", "rejected")):
            full = tokenizer(record["prompt"] + record[name] + tokenizer.eos_token)["input_ids"]
            learned = row["loss_mask"][side]
            assert row["tokens"][side][: len(full)].tolist() == full
            start = 0  # where the prompt's tokens and the whole's part
            while start < len(prompt) and prompt[start] == full[start]:
                start += 1
            assert np.flatnonzero(learned).tolist() == list(range(start - 1, len(full) - 1))
    # Chats: explicit prompts, and implicit ones (the messages both conversations share).
    chats = random_chats(4, seed=3)
    pairs = []
    for index, chat in enumerate(chats):
        prompt = chat["messages"][:-1]
        chosen = [chat["messages"][-1]]
        rejected = [{"role": "assistant", "content": " ".join(WORDS[:3])}]
        pairs.append(
            {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            if index % 2
            else {"chosen": prompt + chosen, "rejected": prompt + rejected}
        )
    convert_pairs(pairs, tmp_path / "chat_pairs", chat_tokenizer)
    chat = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    windows = pair_rows(tmp_path / "chat_pairs", 128)
    for index, chat_record in enumerate(chats):
        messages = chat_record["messages"]
        prompt = chat.apply_chat_template(
            messages[:-1], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        full = chat.apply_chat_template(messages, return_dict=True)["input_ids"]
        row = windows[index]
        assert row["tokens"][0][: len(full)].tolist() == full
        assert np.flatnonzero(row["loss_mask"][0])[0] == len(prompt) - 1


def test_resume_continues_exactly_and_lora_starts_from_its_base(imported, tmp_path):
    """A run cut at step 2 and resumed equals the uncut run; LoRA's step 1 is log 2."""
    root, _, _ = imported
    settings = [
        *TINY,
        "train.objective=dpo",
        f"data.source=arrayrecord:{root / 'pairs'}",
        "data.eval_fraction=0.25",
        "train.eval_every=2",
        "train.global_batch=2",
        "mesh.data=2",
        "mesh.tensor=4",
        "train.log_every=1",
        "checkpoint.every=2",
        "model.vocab_size=512",
        *SGD,
    ]
    whole = train(load_config(None, [*settings, "train.steps=4", f"run.dir={tmp_path / 'a'}"]))
    train(load_config(None, [*settings, "train.steps=2", f"run.dir={tmp_path / 'b'}"]))
    train(load_config(None, [*settings, "train.steps=4", f"run.dir={tmp_path / 'b'}"]))
    cut = [r["loss"] for r in run_records(tmp_path / "b") if "loss" in r]
    assert cut == [r["loss"] for r in run_records(tmp_path / "a") if "loss" in r]
    assert whole["eval_rewards/accuracies"] >= 0 and "eval_perplexity" not in whole
    (tmp_path / "b" / "reference_logps.npz").unlink()
    with pytest.raises(UserError, match="reference log-probs of its starting weights are lost"):
        train(load_config(None, [*settings, "train.steps=6", f"run.dir={tmp_path / 'b'}"]))
    lora = dpo_run(root, "lora", "lora.rank=4", "optim.lr=0.05")
    assert lora[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert lora[-1]["loss"] < lora[0]["loss"] and lora[-1]["rewards/margins"] > 0
    # It leaves as any run: a PEFT adapter with the tokenizer beside it (as TRL saves), a
    # merged model transformers loads, and text generated from the run.
    hf.hf_export(root / "lora", tmp_path / "adapter", form="peft")
    hf.hf_export(root / "lora", tmp_path / "merged", form="merged")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "adapter").eos_token
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    [answer] = paisoar_jax.Generator(root / "lora").complete(["the cat"], max_new=3)
    assert isinstance(answer, str)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.beta=0"], "dpo.beta must be a positive number"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing is for"),
        (["dpo.beta=0.2", "train.objective=next_token"], "dpo.beta is set, but train.objective"),
        (["data.source=embedded"], "train.objective=dpo reads a preference dataset"),
        (["model.name=resnet"], "train.objective=dpo trains the zoo's decoders"),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["train.objective=dpo", "data.source=arrayrecord:x", *overrides])


def test_the_wrong_data_for_the_objective_is_one_line(imported, token_dataset, tmp_path):
    root, _, _ = imported
    base = [*TINY, "model.vocab_size=512", "train.steps=1", f"run.dir={tmp_path / 'r'}"]
    base += ["data.eval_fraction=0", "train.eval_every=0"]
    with pytest.raises(UserError, match="holds preference pairs: train on them with"):
        train(load_config(None, [*base, f"data.source=arrayrecord:{root / 'pairs'}"]))
    with pytest.raises(UserError, match="train.objective=dpo reads preference pairs"):
        train(
            load_config(
                None, [*base, "train.objective=dpo", f"data.source=arrayrecord:{token_dataset}"]
            )
        )
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(UserError, match="bad.jsonl:1: a preference record needs 'chosen' and"):
        convert_text(
            TextConversion(
                output=tmp_path / "bad",
                input=(str(tmp_path / "bad.jsonl"),),
                format="preference",
                progress=False,
            )
        )
