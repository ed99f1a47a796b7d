"""LoRA fine-tuning of a Hugging Face model: train adapters only, then use them with PEFT.

    python examples/lora_fine_tune.py [HF_MODEL_DIR] [section.key=value ...]

Needs the hf extra and peft (pip install -e ".[hf]" tokenizers peft). The steps are the
command lines a user runs, printed as they go:

    convert hf-import      the Hugging Face model as our params and config
    convert text           instructions.jsonl ({"prompt", "response"} records) tokenized with
                           the model's tokenizer, each prompt marked as context
    train                  lora.rank=16: adapters on every attention and MLP projection,
                           the model itself frozen; the loss on the responses alone
    convert hf-export      --peft: the adapters alone, as PEFT saves them

then transformers loads the base model, `peft.PeftModel.from_pretrained` puts the adapter
over it, and it answers every prompt greedily. Without HF_MODEL_DIR, the small random Llama
and the sums of examples/sft_instructions.py are made first: the frozen random model knows
nothing, and the adapters alone teach it the sums (the accuracy is printed: 100% when
measured, 300 steps in about 20 s on 2 CPU cores).
"""

import pathlib
import sys

from sft_instructions import import_and_convert, make_model, run, share_answered

INIT_STD = 0.3  # the random model's weight spread (see main)


def answers_with_peft(base: pathlib.Path, adapter: pathlib.Path, records: list[dict]) -> float:
    """The share of prompts whose greedy answer, base model + PEFT adapter, is the response."""
    import peft
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return share_answered(model, tokenizer, records)


def main(arguments: list[str]) -> None:
    """Import, convert, LoRA fine-tune, export the adapter, ask PEFT (module docstring)."""
    given = arguments[:1] if arguments and "=" not in arguments[0] else []
    overrides = arguments[len(given) :]
    work = pathlib.Path("lora_example")
    work.mkdir(exist_ok=True)
    model_dir = pathlib.Path(given[0]) if given else work / "hf_model"
    if not given:
        # Wider random weights than a trained model's 0.02: with every weight frozen, the
        # head's rows must be long enough for the adapters to make one token a clear choice.
        make_model(model_dir, init_std=INIT_STD)
    records = import_and_convert(model_dir, work)
    settings = ["lora.rank=16", "lora.alpha=32", "data.packing=documents"]
    settings += ["data.loss_on=response", "model.seq_len=64"]
    if not given:  # a random model: only the adapters can learn, so a high learning rate
        settings += ["optim.lr=1e-2", "train.steps=300", "train.global_batch=32"]
    run(
        *("train", "--config", str(work / "imported" / "config.yaml")),
        f"data.source=arrayrecord:{work / 'data'}",
        f"run.dir={work / 'run'}",
        *settings,
        *overrides,
    )
    adapter = work / "adapter"
    run("convert", "hf-export", str(work / "run"), "--peft", "--output", str(adapter))
    unique = list({record["prompt"]: record for record in records}.values())
    accuracy = answers_with_peft(model_dir, adapter, unique)
    print(f"the base model with the PEFT adapter answers {accuracy:.0%} of the {len(unique)} right")


if __name__ == "__main__":
    main(sys.argv[1:])
