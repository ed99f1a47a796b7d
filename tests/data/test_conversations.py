"""`convert text --format instruction|chat`: the loss mask, the document index, chat
templates rendered as transformers renders them, and one-line errors."""

import json

import numpy as np
import pytest
import transformers
from conftest import random_chats

from paisoar_jax.data.records import TokenRecords
from paisoar_jax.tools import convert


def run_convert(*args):
    return convert.main([*map(str, args), "--no-progress"])


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def documents_of(directory):
    """[(tokens, mask)] of each document of a converted dataset, through its index."""
    records = TokenRecords(directory)
    starts = np.append(records.document_starts(), records.token_count)
    return [
        records.read_with_mask(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]


def test_instructions_mask_the_prompt_and_learn_the_response_and_its_end(tmp_path):
    pairs = [("Q: 2+3?\nA: ", "5"), ("Say hi.\n", "hi there")]
    records = [{"prompt": prompt, "response": response, "id": 1} for prompt, response in pairs]
    source = write_jsonl(tmp_path / "pairs.jsonl", records)
    assert (
        run_convert(
            "text", "--input", source, "--output", tmp_path / "data", "--format", "instruction"
        )
        == 0
    )
    manifest = TokenRecords(tmp_path / "data").manifest
    assert manifest["loss_mask"] and manifest["learned_tokens"] == (1 + 1) + (8 + 1)  # with eos
    for (tokens, mask), (prompt, response) in zip(
        documents_of(tmp_path / "data"), pairs, strict=True
    ):
        text = (prompt + response).encode()
        assert bytes(tokens[:-1].astype(np.uint8)) == text and tokens[-1] == 0  # then eos
        expected = [False] * len(prompt.encode()) + [True] * (len(response.encode()) + 1)
        assert mask.tolist() == expected
    assert convert.main(["verify", str(tmp_path / "data")]) == 0


def test_plain_text_gets_a_document_index_and_no_mask(tmp_path):
    (tmp_path / "in").mkdir()
    for index, text in enumerate(["one doc\n", "another, longer document\n"]):
        (tmp_path / "in" / f"{index}.txt").write_text(text)
    assert run_convert("text", "--input", tmp_path / "in", "--output", tmp_path / "data") == 0
    records = TokenRecords(tmp_path / "data")
    assert not records.has_loss_mask and records.document_starts().tolist() == [0, 9]
    assert [tokens.size for tokens, mask in documents_of(tmp_path / "data")] == [9, 26]


def test_chats_give_transformers_tokens_and_assistant_masks(chat_tokenizer, tmp_path):
    """Each chat's tokens equal apply_chat_template's, and the learned tokens its
    assistant mask; the end-of-document token that follows is context."""
    chats = random_chats(20)
    source = write_jsonl(tmp_path / "chats.jsonl", chats)
    arguments = ["--tokenizer", chat_tokenizer, "--format", "chat"]
    assert run_convert("text", "--input", source, "--output", tmp_path / "data", *arguments) == 0
    reference = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    for chat, (tokens, mask) in zip(chats, documents_of(tmp_path / "data"), strict=True):
        expected = reference.apply_chat_template(
            chat["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert tokens[:-1].tolist() == expected["input_ids"]
        assert mask[:-1].astype(int).tolist() == expected["assistant_masks"]
        assert tokens[-1] == reference.eos_token_id and not mask[-1]


@pytest.mark.parametrize(
    "format_arguments, record, message",
    [
        (["--format", "instruction"], {"prompt": "a"}, "no field 'response' (set --response-"),
        (["--format", "instruction"], {"prompt": "a", "response": 3}, "'response' is int"),
        (["--format", "chat"], {"text": "a"}, "needs a tokenizer with a chat template, not byte"),
    ],
)
def test_bad_records_are_one_line(tmp_path, capsys, format_arguments, record, message):
    source = write_jsonl(tmp_path / "in.jsonl", [record])
    assert (
        run_convert("text", "--input", source, "--output", tmp_path / "o", *format_arguments) == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_chat_errors_name_the_record(chat_tokenizer, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    cases = [
        (plain, [{"messages": [{"role": "user", "content": "hi"}]}], "has none"),
        (chat_tokenizer, [{"messages": [{"role": "user", "content": "hi"}]}], "no assistant"),
        (chat_tokenizer, [{"messages": "hi"}], "in.jsonl:1: no list of {role, content}"),
    ]
    for tokenizer, records, message in cases:
        source = write_jsonl(tmp_path / "in.jsonl", records)
        arguments = ["--tokenizer", tokenizer, "--format", "chat", "--overwrite"]
        assert run_convert("text", "--input", source, "--output", tmp_path / "o", *arguments) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    (tmp_path / "notes.txt").write_text("text")
    arguments = ["--format", "instruction"]
    assert (
        run_convert(
            "text", "--input", tmp_path / "notes.txt", "--output", tmp_path / "o", *arguments
        )
        == 2
    )
    assert "reads .jsonl or .parquet records" in capsys.readouterr().err


# A Qwen3-like template: an assistant turn before the last user turn loses its reasoning.
REASONING_TEMPLATE = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set text = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
    "{% set text = text.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ text }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_splits_at_each_answer(tmp_path):
    """Each assistant turn a document of its own: transformers' tokens of the chat up to it,
    that turn learned (before: refused)."""
    from conftest import trained_bpe

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
        eos_token="<|endoftext|>",
    )
    fast.chat_template = REASONING_TEMPLATE
    fast.save_pretrained(tmp_path / "tokenizer")
    chat = [
        {"role": "user", "content": "what is two plus three"},
        {"role": "assistant", "content": "<think>two and three</think> five"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "<think>the cat</think> hello"},
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat}])
    arguments = ["--tokenizer", tmp_path / "tokenizer", "--format", "chat"]
    assert run_convert("text", "--input", source, "--output", tmp_path / "data", *arguments) == 0
    documents = documents_of(tmp_path / "data")
    assert len(documents) == 2
    for turn, (tokens, mask) in zip((1, 3), documents, strict=True):
        whole = fast.apply_chat_template(chat[: turn + 1], return_dict=True)["input_ids"]
        prompt = fast.apply_chat_template(
            chat[:turn], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert tokens[:-1].tolist() == whole
        assert np.flatnonzero(mask[:-1]).tolist() == list(range(len(prompt), len(whole)))
    # the second answer's context holds the first without its reasoning
    assert "two and three" not in fast.decode(documents[1][0])
