"""Chat records with the loss on the assistant's replies only (HF TRL's assistant-only loss).

A conversation is rendered with the tokenizer's chat template once; each assistant turn's text is the
difference between the rendering up to and including that turn and the rendering of the turns before
it with the generation prompt (the template's own header of an assistant turn). Tokens whose characters
lie in such a span carry the loss; every other token (system, user, the template's headers) is masked.
"""

from __future__ import annotations

from typing import Any

from dsforge.runtime.errors import DataError


def check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """The record's messages: a list of {role, content} objects."""
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        raise DataError(f"{where}: format chat needs a non-empty list of {{role, content}} messages")
    return value


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]],
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies."""
    full = tokenizer.render(messages, generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.render(messages[:k], generation_prompt=True) if k else ""
        upto = tokenizer.render(messages[:k + 1], generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template does not render this conversation turn by turn (a "
                            f"prefix of the messages renders differently inside the whole), so the "
                            f"assistant's tokens cannot be told apart; use "
                            f"a template that renders each turn on its own")
        spans.append((len(before), len(upto)))
    if not spans:
        raise DataError(f"{where}: the conversation has no assistant "
                        f"message, so no token would carry the loss")
    return full, spans


def chat_tokens(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation: mask 1 on the tokens of assistant replies."""
    text, spans = assistant_spans(tokenizer, messages, where)
    ids, offsets = tokenizer.encode_rendered(text)
    mask = [int(any(a <= start and end <= b and end > start for a, b in spans)) for start, end in offsets]
    return ids, mask
