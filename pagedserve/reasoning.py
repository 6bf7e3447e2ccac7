"""Reasoning models' ``<think>`` blocks (``--reasoning-parser``): where the reasoning ends, for the engine,
and the output split into reasoning and answer, for the chat API.

Models of the Qwen3 and DeepSeek-R1 families think between ``<think>`` and ``</think>`` before they
answer. The chat API returns the thinking as ``reasoning_content`` and the answer as ``content``; a
grammar (structured output) holds only from the end of the reasoning, as in vLLM. The split works on
streamed text: a piece that may be the start of a tag is held back until the next piece says whether it
is one, so a tag cut between two deltas is still found and never reaches the client.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
# qwen3: the output reasons only if it opens with <think> (or the prompt left one open); deepseek_r1: the
# output reasons until </think> whether or not it opens with <think> (its template opens one for it)
REASONING_PARSERS = ("qwen3", "deepseek_r1")
PROMPT_TAIL_TOKENS = 16  # how much of a prompt's end is read for a block the template opened or closed


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (text to hold until the next piece)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_state(prompt_tail: str) -> str:
    """How the rendered prompt leaves reasoning: "open" (it ends inside a block the template opened for the
    model), "closed" (it ends after a closed one: thinking turned off, as Qwen3's enable_thinking=False
    renders it) or "none"."""
    start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
    return "open" if start > end else "closed" if end >= 0 else "none"


class ThinkingEnd:
    """Watches a request's tokens for the end of its reasoning (its grammar holds from the next token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.recent = tokenizer, []

    def seen(self, token: int) -> bool:
        """Whether ``token`` completes ``</think>`` (kept: the last few tokens, which the tag spans at most)."""
        self.recent = self.recent[1 - len(END):] + [token]
        return END in self.tokenizer.decode(self.recent)


class ReasoningSplitter:
    """One choice's output, fed as it streams: ``feed`` and ``finish`` return (reasoning, content) text."""

    def __init__(self, parser: str, prompt: str):
        """``prompt``: ``prompt_state`` of the request's prompt."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.buf = ""
        # "lead": an opening <think> may still come (then "reasoning", else ``otherwise``);
        # "gap": newlines between </think> and the answer, dropped; "content": the answer, passed through
        self.state = "lead"
        reasons = prompt == "open" or (parser == "deepseek_r1" and prompt == "none")
        self.otherwise = "reasoning" if reasons else "content"

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "lead":
                head = self.buf.lstrip()
                if len(head) < len(START) and START.startswith(head):
                    break  # too little to tell yet
                if head.startswith(START):
                    self.buf, self.state = head[len(START):], "reasoning"
                else:
                    self.state = self.otherwise
            elif self.state == "reasoning":
                end = self.buf.find(END)
                if end >= 0:
                    reasoning += self.buf[:end]
                    self.buf, self.state = self.buf[end + len(END):], "gap"
                    continue
                keep = partial_tail(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "gap":
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.state = "content"
            else:
                content, self.buf = content + self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: a tag that never completed is text of the part it is in."""
        rest, self.buf = self.buf, ""
        part = self.otherwise if self.state == "lead" else self.state
        return (rest, "") if part == "reasoning" else ("", rest if part == "content" else "")
