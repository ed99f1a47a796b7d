"""Text to token ids and back, as transformers' tokenizers give them: `Text`.

A tokenizer.json (an import's copy), or bytes for a byte-level model; chats through the
tokenizer's chat template (data/conversations.py renders it as transformers does). The
generator, the harness model and GRPO's prompts read text through it.
"""

from __future__ import annotations

import pathlib

from paisoar_jax.errors import UserError
from paisoar_jax.runtime.user_files import open_tokenizer


class Text:
    """Text to token ids and back: a tokenizer.json, or bytes for a byte-level model."""

    def __init__(self, found: pathlib.Path | None, vocab_size: int):
        self.model = None
        self.found = found
        self._template = None
        if found is not None:
            try:
                import tokenizers  # noqa: F401 (here only: is it installed?)
            except ImportError:
                message = f"{found} needs the tokenizers package: pip install tokenizers"
                raise UserError(message) from None
            self.model = open_tokenizer(found)
        elif vocab_size != 256:
            raise UserError(
                "no tokenizer is known for this model (no tokenizer.json beside its weights, and "
                f"its vocab of {vocab_size} is not bytes): give --tokens 1,2,3"
            )

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, with the tokenizer's own markers (Llama's BOS) once.

        A text that already begins with them (a chat template's rendering starts with
        {{ bos_token }}) is not given them twice: transformers' apply_chat_template encodes
        its rendered text with add_special_tokens=False.
        """
        if self.model is None:
            return list(text.encode("utf-8"))
        marked = self.model.encode(text, add_special_tokens=True).ids
        plain = self.model.encode(text, add_special_tokens=False).ids
        added = len(marked) - len(plain)  # the markers the post-processor put in front
        if added > 0 and marked[added:] == plain and plain[:added] == marked[:added]:
            return plain
        return marked

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids of a chat and the assistant's generation prompt.

        As transformers' apply_chat_template(messages, add_generation_prompt=True,
        tokenize=True) gives them: the template's text (with its own BOS, if it has one)
        tokenized without adding special tokens.
        """
        return self.model.encode(self.chat_text(messages), add_special_tokens=False).ids

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A chat as the tokenizer's chat template renders it."""
        if self.model is None:
            raise UserError("a chat needs a tokenizer with a chat template, not bytes")
        if self._template is None:
            from paisoar_jax.data.conversations import ChatTemplate

            try:
                self._template = ChatTemplate(self.found)
            except UserError:  # worded for convert's --format chat
                raise UserError(
                    f"{self.found.parent} has no chat template (no chat_template.jinja, none in "
                    f"tokenizer_config.json): give the prompt as text"
                ) from None
        return self._template.render(list(messages), add_generation_prompt=add_generation_prompt)

    def decode(self, tokens: list[int]) -> str:
        """The text of `tokens`."""
        if self.model is None:
            return bytes(token for token in tokens if token < 256).decode(errors="replace")
        return self.model.decode(tokens)
