"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's reply split into its
reasoning, the text between `<think>` and `</think>`, and its content, the text after `</think>`.
Chat completions report the reasoning as vLLM does, in the message's (the stream's deltas')
`reasoning` field and its older name `reasoning_content`; tool calls are looked for in the
content only.

- "qwen3" (Qwen3, QwQ): a reply that opens with `<think>` reasons until `</think>`; one that does
  not (thinking switched off: `chat_template_kwargs={"enable_thinking": false}`) is content.
- "deepseek_r1" (DeepSeek-R1 and its distills, Qwen3 thinking-2507 models, whose chat templates
  open the `<think>` in the prompt): the reply reasons from its start until `</think>`, with or
  without an opening `<think>`; one cut off before `</think>` is reasoning only.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (text a stream
    must hold back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_reasoning(text: str, parser: str, finished: bool) -> tuple[str, int | None]:
    """(the reasoning that may be sent, the offset where the content starts in `text`, or None
    while the reply still reasons). Unfinished text keeps back a tail that may be the start of
    `</think>` (and a reply that may still become `<think>`)."""
    opened = text.startswith(START)
    if not finished and not opened and START.startswith(text):
        return "", None  # (it may still open with <think>)
    if parser == "qwen3" and not opened:
        return "", 0
    body = len(START) if opened else 0
    end = text.find(END, body)
    if end >= 0:
        return text[body:end], end + len(END)
    reasoning = text[body:]
    return reasoning[:len(reasoning) - (0 if finished else partial_tag_len(reasoning, END))], None
