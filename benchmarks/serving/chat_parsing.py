"""The host time a streamed chat token costs in the chat API's output parsers: none, the reasoning split
(--reasoning-parser qwen3), the tool-call parser (--tool-call-parser hermes), and both, fed a thinking
answer that calls a tool, one token-sized piece at a time (what the server does for each delta).

python -m benchmarks.serving.chat_parsing [--tokens 20000] [--repeats 5]   (CPU)
"""

from __future__ import annotations

import argparse
import time

from benchmarks.args import run_main
from pagedserve.reasoning import ReasoningSplitter
from pagedserve.server.chat_output import ChatOutputParser
from pagedserve.server.tools import HermesParser

ANSWER = ("<think>\nThe user asks for the weather in Paris, so the weather tool is the one to call, with the "
          "city as its argument.\n</think>\n\nLet me look that up.\n<tool_call>\n{\"name\": \"get_weather\", "
          "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")


def pieces(tokens: int) -> list[str]:
    """About ``tokens`` pieces of four characters (a BPE token's usual length), whole answers end to end."""
    text = ANSWER * (tokens * 4 // len(ANSWER) + 1)
    return [text[i:i + 4] for i in range(0, tokens * 4, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    stream = pieces(ns.tokens)
    answer = len(ANSWER) // 4  # pieces a parser sees before it is made afresh, as each request gets its own
    cases = {"none": lambda: ChatOutputParser(None, None),
             "reasoning": lambda: ChatOutputParser(ReasoningSplitter("qwen3", "none"), None),
             "tools": lambda: ChatOutputParser(None, HermesParser()),
             "reasoning + tools": lambda: ChatOutputParser(ReasoningSplitter("qwen3", "none"), HermesParser())}
    print(f"{'parsers':>18}  {'µs a token (best of ' + str(ns.repeats) + ')':>24}")
    for name, make in cases.items():
        best = float("inf")
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            for start in range(0, len(stream), answer):
                parser = make()
                chunk = stream[start:start + answer]
                for piece in chunk[:-1]:
                    parser.feed(piece).stream_json()
                parser.feed(chunk[-1], last=True).stream_json()
            best = min(best, (time.perf_counter() - t0) / len(stream))
        print(f"{name:>18}  {best * 1e6:>24.2f}")


if __name__ == "__main__":
    run_main(main)
