"""One chat choice's text, as the chat API returns it: reasoning, content and tool calls.

The same parser serves streamed and whole answers: a stream feeds it each delta, a whole answer its full
text at once; the last piece (``last=True``) flushes what was held back, so the whole answer is the join
of what the deltas would have been.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.reasoning import ReasoningSplitter
from pagedserve.server.tools import ToolCallParser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # entries of a streamed delta.tool_calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def stream_json(self) -> dict:
        out = {}
        if self.reasoning:  # vLLM's current name and the one most clients still read
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.content or not out and not self.tool_calls:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def message_json(self) -> dict:
        """The whole answer's message: streamed call entries joined by index; no content is None (not "")
        beside reasoning or calls, as in vLLM's answers."""
        calls: dict[int, dict] = {}
        for entry in self.tool_calls:
            call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                     "function": {"name": entry["function"].get("name"),
                                                                  "arguments": ""}})
            call["function"]["arguments"] += entry["function"].get("arguments", "")
        message = {"role": "assistant",
                   "content": self.content if self.content or not (self.reasoning or calls) else None}
        if self.reasoning:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message


class ChatOutputParser:
    """Reasoning first (if the server splits it out), then tool calls in the rest (if the request may make
    them); without either, the text is content as it comes. ``one_call`` (parallel_tool_calls false): the
    first call only; any the model writes after it are dropped, as vLLM and OpenAI do."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None,
                 include_reasoning: bool = True, one_call: bool = False):
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning
        self.one_call = one_call
        self.called = False

    def _after_reasoning(self, reasoning: str, content: str, last: bool) -> ChatDelta:
        delta = ChatDelta(reasoning if self.include_reasoning else "")
        if self.tools is None:
            delta.content = content
            return delta
        c, calls = self.tools.feed(content)
        delta.content, delta.tool_calls = c, calls
        if last:
            c, calls = self.tools.finish()
            delta.content += c
            delta.tool_calls += calls
        if self.one_call:
            delta.tool_calls = [entry for entry in delta.tool_calls if entry["index"] == 0]
        self.called |= bool(delta.tool_calls)
        return delta

    def feed(self, text: str, last: bool = False) -> ChatDelta:
        """The delta of ``text``; ``last``: the output ends with it, so nothing is held back."""
        if self.reasoning is None:
            return self._after_reasoning("", text, last)
        reasoning, content = self.reasoning.feed(text)
        if last:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        return self._after_reasoning(reasoning, content, last)

    def finish_reason(self, reason: str | None) -> str | None:
        """An answer that calls tools and stopped on its own ends with "tool_calls", as OpenAI's do."""
        return "tool_calls" if reason == "stop" and self.called else reason
