"""Structured output: a grammar (a JSON schema, any JSON, a regex, a choice of strings, or EBNF) compiled by
xgrammar, and each request's matcher, which says which tokens may come next and follows those sampled.

A request's next mask depends on its last token, so such a request is scheduled only once that token is
known on the host (every other step while a step is in flight); the others keep the pipeline. With a
reasoning parser, the grammar holds from the end of the reasoning (a prompt that turned thinking off:
from the first token)."""

from __future__ import annotations

import json
import logging

import numpy as np

from pagedserve.errors import InvalidRequestError
from pagedserve.reasoning import PROMPT_TAIL_TOKENS, ThinkingEnd, prompt_state

logger = logging.getLogger(__name__)


class Grammar:
    """One request's matcher: the tokens allowed next, and the sampled ones followed; while ``thinking``
    watches a reasoning still under way, every token is allowed and none reaches the matcher."""

    def __init__(self, matcher, thinking: ThinkingEnd | None = None):
        self._matcher, self._thinking = matcher, thinking
        self._broken = False  # a token the grammar refused: the request ends there, the others go on

    @property
    def active(self) -> bool:
        """Whether the grammar holds now (else the next token is free)."""
        return self._thinking is None

    def fill(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if self._thinking is not None:
            if self._thinking.seen(token):
                self._thinking = None
            return
        if not self._matcher.accept_token(token):
            logger.error("token %d is outside the grammar that masked it; the request ends here", token)
            self._broken = True

    @property
    def terminated(self) -> bool:
        return self._thinking is None and (self._broken or self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles a request's ``structured_outputs`` (``SamplingParams.STRUCTURED_KINDS``) for one tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 reasoning_parser: str | None = None):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self.reasoning_parser = reasoning_parser
        self._compiler = None

    def grammar(self, spec: dict, prompt_token_ids: list[int]) -> Grammar:
        """The matcher of ``spec`` for a request with this prompt (whose end says whether it reasons first)."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs", "Structured output needs a tokenizer, and this model "
                                                            "runs without one.")
        try:
            import xgrammar as xgr
        except ImportError:  # a dependency: only a broken install lacks it
            raise InvalidRequestError("structured_outputs", "Structured output needs xgrammar: pip install "
                                                            "xgrammar.") from None
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos or None)
            self._compiler = xgr.GrammarCompiler(info)
        (kind, value), = spec.items()
        try:
            if kind == "json":
                compiled = self._compiler.compile_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                              any_whitespace=False)
            elif kind == "json_object":
                compiled = self._compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = self._compiler.compile_regex(value)
            elif kind == "choice":
                compiled = self._compiler.compile_regex("|".join(_regex_literal(c) for c in value))
            else:
                compiled = self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError("structured_outputs", f"The {kind} for structured output could not be "
                                                            f"compiled: {e}") from None
        thinking = None
        if self.reasoning_parser is not None:
            tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
            thinking = None if prompt_state(tail) == "closed" else ThinkingEnd(self.tokenizer)
        return Grammar(xgr.GrammarMatcher(compiled), thinking)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else c for c in text)


def bitmask(grammars: list[Grammar], vocab_size: int) -> np.ndarray:
    """[len(grammars), ceil(vocab / 32)] int32: bit t of row i set when grammar i allows token t next."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for row, g in enumerate(grammars):
        g.fill(mask, row)
    return mask.numpy()
