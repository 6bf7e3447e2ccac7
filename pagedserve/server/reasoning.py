"""Splitting a reasoning model's output into its reasoning and its answer (``--reasoning-parser``).

Models of the Qwen3 and DeepSeek-R1 families think between ``<think>`` and ``</think>`` before they
answer. The chat API returns the thinking as ``reasoning_content`` and the answer as ``content``. The
split works on streamed text: a piece that may be the start of a tag is held back until the next piece
says whether it is one, so a tag cut between two deltas is still found and never reaches the client.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
# qwen3: the output reasons only if it opens with <think> (or the prompt left one open), since
# enable_thinking=False renders a closed, empty block into the prompt; deepseek_r1: the output
# reasons until </think> whether or not it opens with <think> (its template opens one for it).
# A grammar (structured output, a forced tool choice) holds from the first token, so an output under one
# is its answer unless it opens with <think> itself.
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (text to hold until the next piece)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block (templates that open it for the model)."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


class ReasoningSplitter:
    """One choice's output, fed as it streams: ``feed`` and ``finish`` return (reasoning, content) text."""

    def __init__(self, parser: str, prompt_opened: bool, constrained: bool = False):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.buf = ""
        # "lead": an opening <think> may still come (then "reasoning", else ``otherwise``);
        # "gap": newlines between </think> and the answer, dropped; "content": the answer, passed through
        self.state = "lead"
        reasons = parser == "deepseek_r1" or prompt_opened
        self.otherwise = "reasoning" if reasons and not constrained else "content"

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
