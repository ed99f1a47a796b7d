"""Preference pairs: records into token pairs (`convert text --format preference`), then rows.

A record holds a prompt and two responses to it, the preferred and the other, as text or
as chat messages (TRL's preference formats):

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    {"chosen": [messages], "rejected": [messages]}   # the prompt: all but the last message

Each record becomes two documents of the converted dataset, prompt + chosen then prompt +
rejected, tokenized as TRL's DPOTrainer tokenizes them: text whole (the tokenizer's special
tokens added, the end-of-sequence token appended), chats through the chat template; the
response starts where the tokens of the prompt alone and of the prompt with each response
part, so a template that renders the prompt differently alone still splits where TRL does.
The response's tokens are marked learned, the prompt's are context.

Training reads a pair per row (`PreferenceWindows`): tokens (2, T + 1), chosen then
rejected, each with its loss mask, and `pair`: which pair of the row each target belongs to
(-1: none). data.packing=documents packs several pairs in a row, each document attending
only to itself (segments, positions as data/documents.py's).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from paisoar_jax import output
from paisoar_jax.data.documents import PAD_ID, plan_windows
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.data.tokenizing import Tokenizer
from paisoar_jax.errors import UserError

RESPONSES = ("chosen", "rejected")
TokenDocument = tuple[np.ndarray, np.ndarray]  # (token ids, learned) of one document


def preference_documents(
    record: Any, tokenizer: Tokenizer, template: Any, where: str
) -> tuple[TokenDocument, TokenDocument]:
    """The (tokens, learned) of prompt + chosen and of prompt + rejected of one record."""
    if not isinstance(record, dict) or not all(name in record for name in RESPONSES):
        raise UserError(f"{where}: a preference record needs 'chosen' and 'rejected' fields")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise UserError(f"{where}: 'prompt' must be text when the responses are text")
        prompt_ids = _text_ids(tokenizer, prompt, where, end=False)
        full = [_text_ids(tokenizer, prompt + response, where) for response in (chosen, rejected)]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        if template is None:
            raise UserError(
                f"{where}: chat messages need a tokenizer with a chat template, not byte"
            )
        prompt = record.get("prompt")
        if prompt is None:  # implicit: the messages the two conversations share
            shared = 0
            while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not isinstance(prompt, list) or not chosen or not rejected:
            raise UserError(f"{where}: the chat's prompt and both responses need messages")
        prompt_ids = _chat_ids(tokenizer, template, prompt, True, where)
        full = [
            _chat_ids(tokenizer, template, prompt + turns, False, where)
            for turns in (chosen, rejected)
        ]
    else:
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be text or both messages")
    start = min(_common_prefix(prompt_ids, ids) for ids in full)
    documents = []
    for ids in full:
        if len(ids) <= start:
            raise UserError(f"{where}: a response has no tokens after its prompt")
        documents.append((ids, np.arange(len(ids)) >= start))
    return documents[0], documents[1]


def _text_ids(tokenizer: Tokenizer, text: str, where: str, end: bool = True) -> np.ndarray:
    """Token ids of text as transformers' tokenizer(text) gives them; `end`: EOS appended."""
    if tokenizer.model is None:  # byte: raw UTF-8, 0 ends it
        data = text.encode("utf-8")
        if b"\0" in data:
            raise UserError(f"{where} contains NUL bytes (the byte tokenizer's end-of-document)")
        ids = np.frombuffer(data, np.uint8).astype(np.int64)
        return np.append(ids, tokenizer.eos_id) if end else ids
    eos_text = tokenizer.model.id_to_token(tokenizer.eos_id)
    if end and not text.endswith(eos_text):  # as TRL: the end token's text appended
        text += eos_text
    return np.asarray(tokenizer.model.encode(text).ids, np.int64)


def _chat_ids(tokenizer: Tokenizer, template: Any, messages: list, prompt: bool, where: str):
    """Token ids of a chat rendered by the template (special tokens are the template's)."""
    text = template.render(messages, add_generation_prompt=prompt, where=where)
    return np.asarray(tokenizer.model.encode(text, add_special_tokens=False).ids, np.int64)


def _common_prefix(first: np.ndarray, second: np.ndarray) -> int:
    """The number of leading ids two sequences share."""
    length = min(len(first), len(second))
    differs = np.nonzero(first[:length] != second[:length])[0]
    return int(differs[0]) if len(differs) else length


class PreferenceWindows:
    """Rows of preference pairs of a converted dataset (see the module docstring)."""

    def __init__(
        self,
        records: TokenRecords,
        seq_len: int,
        packing: str,
        plan: np.ndarray,
        start: int,
        stop: int,
    ):
        # `plan`: plan_for's, made once for the dataset's train and eval rows
        self.records, self.seq_len, self.packing = records, seq_len, packing
        self.plan, self.start, self.stop = plan, start, stop
        self.starts = np.append(records.document_starts(), records.token_count)

    @staticmethod
    def plan_for(records: TokenRecords, seq_len: int, packing: str) -> np.ndarray:
        """The first pair of each row, plus the end: one pair a row, or pairs packed."""
        starts = np.append(records.document_starts(), records.token_count)
        lengths = np.diff(starts)
        if len(lengths) % 2:
            raise UserError(f"{records.directory} is not a preference dataset (odd documents)")
        longest = np.maximum(lengths[0::2], lengths[1::2])
        cut = int((longest > seq_len + 1).sum())
        if cut and jax.process_index() == 0:  # a response cut away entirely trains nothing
            output.warning(
                f"{cut} of {len(longest)} preference pairs of {records.directory} are longer "
                f"than model.seq_len + 1 = {seq_len + 1} tokens: each side is cut to its first "
                f"{seq_len + 1} (the longest has {longest.max()})"
            )
        pair_lengths = np.minimum(longest, seq_len + 1)
        return plan_windows(pair_lengths, seq_len + 1, one_per_window=packing != "documents")

    @property
    def pairs_per_row(self) -> int:
        """The most pairs a row of this dataset holds."""
        return int(np.diff(self.plan).max())

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} outside [0, {len(self)})")
        first, stop = self.plan[self.start + index], self.plan[self.start + index + 1]
        sides = [self._side(first, stop, side) for side in (0, 1)]
        return {name: np.stack([side[name] for side in sides]) for name in sides[0]}

    def _side(self, first: int, stop: int, side: int) -> dict[str, np.ndarray]:
        """One side (0: chosen, 1: rejected) of the row of pairs first..stop - 1."""
        width = self.seq_len + 1
        tokens = np.full(width, PAD_ID, np.int32)
        learned = np.zeros(width, bool)
        segments = np.zeros(width, np.int32)
        positions = np.zeros(width, np.int32)
        used = 0
        for number, pair in enumerate(range(first, stop), start=1):
            document = 2 * pair + side
            begin = int(self.starts[document])
            end = min(int(self.starts[document + 1]), begin + width - used)
            ids, mask = self.records.read_with_mask(begin, end)
            tokens[used : used + end - begin] = ids
            learned[used : used + end - begin] = mask
            segments[used : used + end - begin] = number
            positions[used : used + end - begin] = np.arange(end - begin)
            used += end - begin
        # Target t (slot t + 1) is learned when it is of input t's document, and marked so.
        same = (segments[1:] == segments[:-1]) & (segments[1:] > 0)
        loss_mask = same & learned[1:]
        example = {
            "tokens": tokens,
            "loss_mask": loss_mask,
            "pair": np.where(same, segments[1:] - 1, -1),
        }
        if self.packing == "documents":
            example |= {"segments": segments[:-1], "positions": positions[:-1]}
        return example
