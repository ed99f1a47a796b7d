"""Windows for supervised fine-tuning: the loss on responses only, whole documents per window.

Two settings choose how a converted dataset (`convert text`) becomes windows of T + 1 tokens
(T = model.seq_len: inputs tokens[:-1], targets tokens[1:]):

    data.packing=stream     windows cut from the stream, as pre-training reads it: a document
                            may begin in one window and end in the next, and attends to the
                            documents before it in its window.
    data.packing=documents  whole documents packed in order (a document that does not fit in
                            what is left of a window starts the next one), each masked from
                            the others: attention stays within a document and positions
                            restart at 0 in each. A document longer than a window is cut to
                            it (one line says how many were).
    data.packing=padding    one document per window, the rest padding, never learned (a
                            causal model's tokens never attend to the padding after them).

    data.loss_on=all        every target of a document is learned
    data.loss_on=response   only the targets `convert --format instruction|chat` marked as a
                            response's (the prompt is context)

The loss averages over the learned targets alone (tasks.py). An example is a dict:

    tokens     int32 (T + 1,)  the window
    loss_mask  bool (T,)       whether target t is learned
    segments   int32 (T,)      packing=documents: input t's document in the window (1, 2, ...;
                               0 is padding); attention needs equal segments
    positions  int32 (T,)      packing=documents: input t's position within its document
"""

from __future__ import annotations

import jax
import numpy as np

from paisoar_jax import output
from paisoar_jax.data.records import TokenRecords
from paisoar_jax.errors import UserError

PAD_ID = 0  # the padding's token id: never learned and never attended to, so any id does


def check_loss_mask(records: TokenRecords, loss_on: str) -> None:
    """Refuses data.loss_on=response on a dataset that marks no response tokens."""
    if loss_on == "response" and not records.has_loss_mask:
        raise UserError(
            f"data.loss_on=response needs a dataset converted with --format instruction or "
            f"chat, and {records.directory} marks no response tokens (data.loss_on=all "
            f"learns every token)"
        )


class MaskedStreamWindows:
    """Stream windows (data.packing=stream) with each target's loss mask."""

    def __init__(self, records: TokenRecords, seq_len: int, start: int, stop: int):
        self.records, self.seq_len, self.start, self.stop = records, seq_len, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} outside [0, {len(self)})")
        first = (self.start + index) * self.seq_len
        tokens, learned = self.records.read_with_mask(first, first + self.seq_len + 1)
        return {"tokens": tokens.astype(np.int32), "loss_mask": learned[1:]}


def plan_windows(lengths: np.ndarray, capacity: int, one_per_window: bool) -> np.ndarray:
    """The first document of each window (plus the end): documents packed in order.

    A window takes documents while their lengths fit in `capacity` tokens (a longer one
    takes a window of its own, cut); with `one_per_window`, each document its own window.
    """
    if one_per_window:
        return np.arange(len(lengths) + 1)
    firsts, used = [0], 0
    for index, length in enumerate(lengths.tolist()):
        if used and used + length > capacity:
            firsts.append(index)
            used = 0
        used += length
    return np.array([*firsts, len(lengths)])


class DocumentWindows:
    """Whole documents per window (data.packing=documents or padding); see the module doc."""

    def __init__(
        self,
        records: TokenRecords,
        seq_len: int,
        packing: str,
        loss_on: str,
        plan: np.ndarray,
        start: int,
        stop: int,
    ):
        self.records, self.seq_len, self.packing, self.loss_on = records, seq_len, packing, loss_on
        self.starts = np.append(records.document_starts(), records.token_count)
        self.plan, self.start, self.stop = plan, start, stop

    @classmethod
    def plan_for(cls, records: TokenRecords, seq_len: int, packing: str) -> np.ndarray:
        """The packing plan of a dataset (`plan_windows`), saying how many documents are cut."""
        starts = np.append(records.document_starts(), records.token_count)
        lengths = np.diff(starts)
        too_long = int((lengths > seq_len + 1).sum())
        if too_long and jax.process_index() == 0:  # one line for the job, not one per process
            output.warning(
                f"{too_long} of {len(lengths)} documents of {records.directory} are longer than "
                f"model.seq_len + 1 = {seq_len + 1} tokens: each is cut to its first "
                f"{seq_len + 1} (the longest has {lengths.max()})"
            )
        return plan_windows(lengths, seq_len + 1, one_per_window=packing == "padding")

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} outside [0, {len(self)})")
        first, stop = self.plan[self.start + index], self.plan[self.start + index + 1]
        width = self.seq_len + 1
        begin = int(self.starts[first])
        end = min(int(self.starts[stop]), begin + width)  # a single long document: cut
        tokens, learned = self.records.read_with_mask(begin, end)
        if learned is None or self.loss_on == "all":
            learned = np.ones(end - begin, bool)
        # Each slot's document (1, 2, ... in the window; 0: padding), and its position in it.
        bounds = np.minimum(self.starts[first : stop + 1] - begin, end - begin)
        segments = np.zeros(width, np.int32)
        positions = np.zeros(width, np.int32)
        for number, (low, high) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), 1):
            segments[low:high] = number
            positions[low:high] = np.arange(high - low)
        padded = np.full(width, PAD_ID, np.int32)
        padded[: end - begin] = tokens
        mask = np.zeros(width, bool)
        mask[: end - begin] = learned
        # Target t (slot t + 1) is learned when it is of input t's document, and marked so.
        loss_mask = (segments[1:] == segments[:-1]) & (segments[1:] > 0) & mask[1:]
        example = {"tokens": padded, "loss_mask": loss_mask}
        if self.packing == "documents":
            example |= {"segments": segments[:-1], "positions": positions[:-1]}
        return example
