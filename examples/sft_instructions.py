"""Supervised fine-tuning of a Hugging Face model on instructions: the prompt masked from the loss.

    python examples/sft_instructions.py [HF_MODEL_DIR] [section.key=value ...]

Needs the hf extra (pip install -e ".[hf]" tokenizers). The steps are the command lines a
user runs, printed as they go:

    convert hf-import      the Hugging Face model as our params and config
    convert text           instructions.jsonl ({"prompt", "response"} records) tokenized with
                           the model's tokenizer, each prompt marked as context
    train                  data.loss_on=response (the loss learns the responses alone),
                           data.packing=documents (whole records packed into windows, each
                           attending only to itself)
    convert hf-export      the fine-tuned model as a Hugging Face directory

and the export is loaded with transformers, which answers every prompt greedily. Without
HF_MODEL_DIR, a small random Llama with a word-level tokenizer is made first, and the
instructions are sums of two digits: it starts knowing nothing, and after fine-tuning its
answers in transformers are right (the accuracy is printed).
"""

import json
import pathlib
import random
import subprocess
import sys

DIGITS = [str(number) for number in range(19)]


def sums() -> list[dict]:
    """Every sum of two digits, ten times over in a fixed shuffled order."""
    records = [
        {"prompt": f"Q: {a} + {b} =", "response": f" {a + b}"} for a in range(10) for b in range(10)
    ]
    records *= 10
    random.Random(0).shuffle(records)
    return records


def make_model(directory: pathlib.Path, init_std: float = 0.02) -> None:
    """A random 2-layer Llama and a word-level tokenizer for the sums, as Hugging Face saves.

    `init_std`: the weights' initial spread (transformers' initializer_range).
    """
    import tokenizers
    import torch
    import transformers

    words = ["<eos>", "Q:", "+", "=", *DIGITS]
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({word: i for i, word in enumerate(words)}, "<eos>")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(words),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        initializer_range=init_std,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def run(*arguments: str) -> None:
    """Runs `python -m paisoar_jax.<arguments>` as a user would, printing the command."""
    print("$ python -m paisoar_jax." + " ".join(arguments), flush=True)
    subprocess.run(
        [sys.executable, "-m", f"paisoar_jax.{arguments[0]}", *arguments[1:]], check=True
    )


def answers_in_transformers(directory: pathlib.Path, records: list[dict]) -> float:
    """The share of prompts whose greedy answer in transformers is the response."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return share_answered(model, tokenizer, records)


def share_answered(model, tokenizer, records: list[dict]) -> float:
    """The share of prompts whose greedy answer by `model` (transformers') is the response."""
    right = 0
    for record in records:
        prompt = tokenizer(record["prompt"], return_tensors="pt", add_special_tokens=False)
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
        answer = tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :])
        right += answer.replace("<eos>", "").strip() == record["response"].strip()
    return right / len(records)


def import_and_convert(model_dir: pathlib.Path, work: pathlib.Path) -> list[dict]:
    """Imports the model to work/imported and its instructions to work/data; the records."""
    records = sums()
    lines = (json.dumps(record) + "\n" for record in records)
    (work / "instructions.jsonl").write_text("".join(lines))
    run("convert", "hf-import", "--input", str(model_dir), "--output", str(work / "imported"))
    run(
        *("convert", "text", "--input", str(work / "instructions.jsonl"), "--overwrite"),
        *("--tokenizer", str(work / "imported"), "--format", "instruction"),
        *("--output", str(work / "data"), "--no-progress"),
    )
    return records


def main(arguments: list[str]) -> None:
    """Import, convert, fine-tune, export and ask transformers (see the module docstring)."""
    given = arguments[:1] if arguments and "=" not in arguments[0] else []
    overrides = arguments[len(given) :]
    work = pathlib.Path("sft_example")
    work.mkdir(exist_ok=True)
    model_dir = pathlib.Path(given[0]) if given else work / "hf_model"
    if not given:
        make_model(model_dir)
    records = import_and_convert(model_dir, work)
    settings = ["data.packing=documents", "data.loss_on=response", "model.seq_len=64"]
    if not given:  # a random model: a pre-training learning rate, and long enough to learn
        settings += ["optim.lr=3e-3", "train.steps=300", "train.global_batch=32"]
    run(
        *("train", "--config", str(work / "imported" / "config.yaml")),
        f"data.source=arrayrecord:{work / 'data'}",
        f"run.dir={work / 'run'}",
        *settings,
        *overrides,
    )
    run("convert", "hf-export", str(work / "run"), "--output", str(work / "tuned_hf"))
    unique = list({record["prompt"]: record for record in records}.values())
    accuracy = answers_in_transformers(work / "tuned_hf", unique)
    print(f"transformers answers {accuracy:.0%} of the {len(unique)} prompts right")


if __name__ == "__main__":
    main(sys.argv[1:])
