"""The frontend halves of the engine: prompts in (tokenize, validate) and text out (detokenize, stop
strings). Shared by the offline ``LLM`` and the server, which runs them on its event loop."""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedserve.checks import token_ids
from pagedserve.config import EngineConfig
from pagedserve.engine.core import CoreOutput
from pagedserve.engine.request import Request
from pagedserve.engine.structured import GrammarCompiler
from pagedserve.errors import ConfigError, InvalidRequestError, RequestFailedError
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from pagedserve.sampling_params import SamplingParams

# text, token ids, or vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids}, with "cache_salt"
Prompt = str | list[int] | dict
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig):
    """The model folder's tokenizer (with its chat template), or None when there is none to load."""
    args = config.args
    if args.skip_tokenizer_init:
        return None
    path = Path(args.tokenizer) if args.tokenizer else config.source.path
    if args.tokenizer and not path.is_dir():
        raise ConfigError(f"--tokenizer: {args.tokenizer!r} is not a local folder.")
    if path is None or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("No tokenizer files for %s: running on token ids only (text prompts will be refused).",
                       config.source.name)
        return None
    from transformers import AutoTokenizer

    try:  # never run code from a model folder: a tokenizer that needs it fails here instead
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ConfigError(f"The tokenizer in {str(path)!r} could not be loaded ({e}). Pass a working "
                          f"--tokenizer folder, or --skip-tokenizer-init to run on token ids.") from e


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        eos = set(config.model.eos_token_ids) | set(config.generation.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.grammars = GrammarCompiler(tokenizer, config.model.vocab_size, self.eos_token_ids,
                                        config.args.reasoning_parser)
        # no token covers more characters than the vocabulary's longest entry: a text longer than this
        # many characters has more than max_model_len tokens, and is refused before it is tokenized
        longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_prompt_chars = longest * config.max_model_len
        self.chat_template: str | None = None  # the server's --chat-template, over the tokenizer's
        gen = config.generation
        if gen.source is not None and (gen.sampling or gen.max_tokens):
            logger.warning("Requests that leave them unset get the defaults of %s: %s (--generation-config vllm "
                           "ignores a model's file)", gen.source, gen.describe())

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise InvalidRequestError(
                "prompt", f"{what} need a tokenizer, and this model runs without one (skip_tokenizer_init, or a "
                          f"built-in model name with dummy weights): send the prompt as token ids.")
        return self.tokenizer

    def check_text(self, text: str, param: str, truncated: bool = False) -> None:
        """Refuse text that cannot be tokenized (a lone surrogate is not Unicode text) or, unless the request
        keeps only its last tokens, that is certainly longer than the context, before any tokenizer work."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(param, f"The {param} is not valid Unicode text: {e.reason} "
                                             f"({text[e.start:e.end]!r} at character {e.start}).") from None
        if len(text) > self.max_prompt_chars and not truncated:
            raise InvalidRequestError(param, f"{param.capitalize()}: {len(text):,} characters, so more tokens than "
                                             f"this model's maximum context of {self.config.max_model_len}.")

    def encode(self, text: str, add_special_tokens: bool = True, truncated: bool = False) -> list[int]:
        tok = self._need_tokenizer("Text prompts")
        self.check_text(text, "prompt", truncated)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, truncated: bool = False, **kwargs) -> list[int]:
        """Render and tokenize a conversation: with ``chat_template`` if given, else the server's
        (``--chat-template``), else the tokenizer's own; ``kwargs`` reach the template. ``truncated``: the
        request keeps only its last tokens (truncate_prompt_tokens), so no length is refused here."""
        tok = self._need_tokenizer("Chat messages")
        template = chat_template or self.chat_template
        if template is None and tok.chat_template is None:
            raise InvalidRequestError("messages", "This model's tokenizer has no chat template; use /v1/completions "
                                                  "or start the server with --chat-template.")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError("messages", f"Message {i} is not a dict with a \"role\": {m!r:.80}.")
            if isinstance(m.get("content"), str):  # None (or left out): an empty turn, as the template renders it
                self.check_text(m["content"], "messages", truncated)
        try:
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # a template that rejects the messages (e.g. roles out of order)
            raise InvalidRequestError("messages", f"The chat template could not render these messages: {e}") from e
        self.check_text(text, "messages", truncated)
        return tok.encode(text, add_special_tokens=False)

    def make_requests(self, request_id: str, prompt: Prompt, params: SamplingParams,
                      priority: int = 0) -> list[tuple[Request, str | None]]:
        """The ``params.n`` requests of one prompt (ids ``request_id`` when n is 1, else ``request_id-j``):
        tokenized and checked once; with prefix caching the children share the prompt's KV blocks."""
        if params.n == 1:
            return [self.make_request(request_id, prompt, params, priority=priority)]
        first, text = self.make_request(f"{request_id}-0", prompt, params.child(0), priority=priority)
        return [(first, text)] + [
            (Request(f"{request_id}-{j}", first.prompt_token_ids, params.child(j), self.eos_token_ids, first.max_tokens,
                     arrival_time=first.arrival_time, priority=priority, cache_salt=first.cache_salt,
                     grammar=self._grammar(params, first.prompt_token_ids), allowed_tokens=first.allowed_tokens,
                     bad_words=first.bad_words), text)
            for j in range(1, params.n)]

    def _grammar(self, params: SamplingParams, prompt_token_ids: list[int]):
        """Structured output's state, one for each sample (it follows that sample's tokens)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.grammar(params.structured_outputs, prompt_token_ids)

    def _token_limits(self, params: SamplingParams) -> dict:
        """What limits the tokens a request may sample, as ``Request`` takes it: its allowed tokens as bits, its bad
        words as token ids (the samples of one prompt share them)."""
        out: dict = {}
        if params.allowed_token_ids:
            ids = np.asarray(params.allowed_token_ids, dtype=np.int64)
            bits = np.zeros(-(-self.config.model.vocab_size // 32), dtype=np.uint32)
            np.bitwise_or.at(bits, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
            out["allowed_tokens"] = bits.view(np.int32)
        if params.bad_words:
            out["bad_words"] = self._bad_word_ids(params.bad_words)
        return out

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as it would start the text and as it would follow a space (the second only
        where it differs in its first token and not in length, as vLLM reads them); a word the tokenizer makes
        nothing of cannot be written, and is left out."""
        tok = self._need_tokenizer("bad_words")
        found: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
            found += [bare] if bare else []
            found += [spaced] if bare and len(spaced) == len(bare) and spaced[0] != bare[0] else []
        return tuple(dict.fromkeys(found))

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0) -> tuple[Request, str | None]:
        if priority and self.config.args.scheduling_policy != "priority":
            raise InvalidRequestError("priority", "A request priority needs an engine started with "
                                                  "--scheduling-policy priority; leave priority out (or 0).")
        salt = None
        if isinstance(prompt, dict):
            prompt, salt = _unpack(prompt)
        vocab = self.config.model.vocab_size
        keep = params.truncate_prompt_tokens
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt, truncated=keep is not None)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, token_ids(prompt)
            if ids is None or any(t >= vocab for t in ids):
                raise InvalidRequestError("prompt", f"Token ids must be integers in [0, {vocab}).")
        else:
            raise InvalidRequestError("prompt", f"A prompt is text, a list of token ids or a prompt dict, not "
                                                f"{type(prompt).__name__}.")
        if not ids:
            raise InvalidRequestError("prompt", "The prompt is empty.")
        most = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > most:
                raise InvalidRequestError(name, f"Asked for {asked} {name} a token; this server returns at most "
                                                f"{most} (start it with a larger --max-logprobs to allow more).")
        for name, named in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            if named and max(named) >= vocab:
                raise InvalidRequestError(name, f"{name} names token {max(named)}; token ids are in [0, {vocab}).")
        limit = self.config.max_model_len
        if keep is not None:
            keep = limit if keep == -1 else keep
            if keep > limit:
                raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens {keep} is more than this "
                                                                    f"model's maximum context of {limit} tokens.")
            ids = ids[-keep:]
        n = len(ids)
        if params.max_tokens is None:
            if n >= limit:
                raise InvalidRequestError(
                    "prompt", f"This model's maximum context length is {limit} tokens. However, your prompt "
                              f"has {n} tokens. Please reduce the length of the prompt.")
            max_tokens = min(limit - n, self.config.generation.max_tokens or limit)
        else:
            max_tokens = params.max_tokens
            if n + max_tokens > limit:
                raise InvalidRequestError(
                    "max_tokens", f"This model's maximum context length is {limit} tokens. However, you requested "
                                  f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
                                  f"Please reduce the length of the prompt or max_tokens.")
        kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
        return Request(request_id, ids, params, self.eos_token_ids, max_tokens, grammar=self._grammar(params, ids),
                       priority=priority, cache_salt=salt, **self._token_limits(params), **kwargs), text


def _unpack(prompt: dict) -> tuple[str | list[int], str | None]:
    """A prompt dict's text or token ids, and its cache salt."""
    keys = set(prompt) - {"cache_salt"}
    salt = prompt.get("cache_salt")
    if keys not in ({"prompt"}, {"prompt_token_ids"}) or not (salt is None or isinstance(salt, str) and salt):
        raise InvalidRequestError("prompt", "A prompt dict holds \"prompt\" (text) or \"prompt_token_ids\", and "
                                            "optionally a non-empty \"cache_salt\" string; got keys "
                                            f"{sorted(prompt)}.")
    return prompt[keys.pop()], salt


@dataclass
class _State:
    request: Request
    prompt: str | None
    stream: object | None
    metrics: RequestMetrics
    text: str = ""
    token_ids: array = field(default_factory=lambda: array("q"))  # elements unseen by the garbage collector
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    hold: int = 0          # DELTA: trailing chars held back while a stop string may still be forming
    sent_text: int = 0     # DELTA: chars and tokens already handed out
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False  # DELTA: they go out once, with the first token
    silent_last: bool = False  # the last token stopped the request: in token_ids, not in the text


class OutputProcessor:
    """Turns core outputs into ``RequestOutput``s: incremental detokenization (tokenizers'
    ``DecodeStream``), logprobs, and stop strings (which finish the request and ask for an abort)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}
        self._pieces: dict[int, str] = {}  # token id -> decoded text, for logprobs (bounded by the vocabulary)

    def add(self, request: Request, prompt: str | None,
            kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """``kind``: FINAL_ONLY for offline generate, DELTA for the server's streams (each output
        carries only what is new, so a long stream costs no per-step copy of everything before)."""
        stream = None
        if self.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            # a few prompt tokens as context, so the first output token decodes with its leading space
            stream = DecodeStream(ids=request.prompt_token_ids[-4:],
                                  skip_special_tokens=request.sampling_params.skip_special_tokens)
        stops = request.sampling_params.stop_strings
        state = _State(request, prompt, stream, RequestMetrics(arrival_time=request.arrival_time), kind=kind,
                       hold=max((len(s) for s in stops), default=1) - 1)
        if request.sampling_params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if request.sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request.request_id] = state

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str], dict[str, Exception]]:
        """Return the new RequestOutputs, the ids whose stop string was hit (to abort in the core), and the
        requests whose output could not be processed, with why: those fail alone, the others go on."""
        results, to_abort, failed = [], [], {}
        now = time.monotonic()
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None:  # finished here already (a stop string), the core's late news is moot
                continue
            try:
                self._process_one(st, out, now, results, to_abort)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error on this request's tokens
                self.states.pop(out.request_id, None)
                failed[out.request_id] = e
        return results, to_abort, failed

    def _process_one(self, st: _State, out: CoreOutput, now: float, results: list, to_abort: list) -> None:
        if out.error is not None:
            raise RequestFailedError(out.error)
        m = st.metrics
        m.first_scheduled_time = out.first_scheduled_time or m.first_scheduled_time
        m.num_preemptions = out.num_preemptions
        if out.prompt_scores is not None:
            st.prompt_logprobs.extend(self._entry(*score) for score in out.prompt_scores)
        if out.token_id is None and out.finish_reason is None:  # prompt scores alone: nothing to hand out yet
            return
        # a stop token (EOS, a stop_token_ids entry) that ends the request stays in token_ids and logprobs
        # but not in the text, unless include_stop_str_in_output (vLLM's rule)
        st.silent_last = (out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                          and not st.request.sampling_params.include_stop_str_in_output)
        if out.token_id is not None and self._append_token(st, out, now) and out.finish_reason is None:
            to_abort.append(out.request_id)
        if st.finish_reason is None:
            st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
        finished = st.finish_reason is not None
        if finished:
            self._flush(st)
            m.finished_time = now
            del self.states[out.request_id]
        if st.kind is RequestOutputKind.DELTA:
            delta = self._delta(st, finished)
            if delta is not None:
                results.append(delta)
        elif finished or st.kind is RequestOutputKind.CUMULATIVE:
            results.append(self._output(st, finished))

    def _append_token(self, st: _State, out: CoreOutput, now: float) -> bool:
        """Add the token; True if it completed a stop string (the request is then finished here)."""
        m = st.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        st.token_ids.append(out.token_id)
        if st.logprobs is not None:
            st.cumulative_logprob += out.logprobs[0]
            st.logprobs.append(self._entry(out.logprobs, out.logprob_ids, out.rank))
        if st.stream is None or st.silent_last:
            return False
        piece = st.stream.step(self.tokenizer.backend_tokenizer, out.token_id)
        if not piece:
            return False
        stops = st.request.sampling_params.stop_strings
        before = len(st.text)
        st.text += piece
        if stops and st.finish_reason is None:
            window = max(0, before - max(len(s) for s in stops) + 1)
            hits = [(st.text.find(s, window), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                keep = st.request.sampling_params.include_stop_str_in_output
                st.text = st.text[:i + len(s)] if keep else st.text[:i]
                st.finish_reason, st.stop_reason = "stop", s
                return True
        return False

    def _entry(self, logprobs: list[float], ids: list[int], rank: int) -> dict[int, Logprob]:
        """A token's logprob (ids[0], the token itself, first) and the top-N, keyed by token id."""
        entry = {ids[0]: Logprob(logprobs[0], rank, self._piece(ids[0]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], logprobs[1:]), start=1):
            entry.setdefault(tid, Logprob(lp, r, self._piece(tid)))
        return entry

    def _flush(self, st: _State) -> None:
        """At the end, emit what the stream held back (bytes of an unfinished UTF-8 character)."""
        if st.stream is None or isinstance(st.stop_reason, str):
            return
        ids = st.token_ids[:-1] if st.silent_last else st.token_ids
        full = self.tokenizer.decode(ids.tolist(), skip_special_tokens=st.request.sampling_params.skip_special_tokens)
        if len(full) > len(st.text) and full.startswith(st.text):
            st.text = full

    def _piece(self, token_id: int) -> str | None:
        """A token's text as a client reads it (" and", not the BPE symbol "Ġand"), decoded once per id."""
        if self.tokenizer is None:
            return None
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return piece

    def _output(self, st: _State, finished: bool, text_from: int = 0, text_to: int | None = None,
                tokens_from: int = 0) -> RequestOutput:
        """The output from the given offsets on: everything (CUMULATIVE, FINAL_ONLY) or what is new (DELTA)."""
        completion = CompletionOutput(0, st.text[text_from:text_to], st.token_ids[tokens_from:].tolist(),
                                      st.cumulative_logprob,
                                      None if st.logprobs is None else st.logprobs[tokens_from:],
                                      st.finish_reason, st.stop_reason)
        prompt_logprobs = st.prompt_logprobs
        if st.kind is RequestOutputKind.DELTA:
            prompt_logprobs, st.sent_prompt_logprobs = (None if st.sent_prompt_logprobs else prompt_logprobs), True
        return RequestOutput(st.request.request_id, st.prompt, st.request.prompt_token_ids,
                             [completion], finished, st.metrics, prompt_logprobs, st.request.num_cached_tokens)

    def _delta(self, st: _State, finished: bool) -> RequestOutput | None:
        """What is new since the last output; text that might still become part of a stop string waits
        (a stop string cuts the text at its start, which is never before what was already sent)."""
        end = len(st.text) if finished else max(st.sent_text, len(st.text) - st.hold)
        n = len(st.token_ids)
        if not finished and n == st.sent_tokens and end == st.sent_text:
            return None
        out = self._output(st, finished, st.sent_text, end, st.sent_tokens)
        st.sent_text, st.sent_tokens = end, n
        return out

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
