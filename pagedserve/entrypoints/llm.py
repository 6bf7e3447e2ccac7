"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput, RequestOutputKind
from pagedserve.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


class LLM:
    """``LLM(model="tiny", max_num_seqs=..., max_num_batched_tokens=..., ...)`` takes the engine
    arguments under the CLI's names (``pagedserve serve --help`` lists them)."""

    def __init__(self, model: str = "tiny", **kwargs):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}. "
                            f"Known: {', '.join(sorted(EngineArgs.field_names()))}.")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).create_config())
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (they also stop when this process exits)."""
        self.engine.core.shutdown()

    @property
    def memory_budget(self):
        return self.engine.core.worker.budget

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A prompt is a string, a list of
        token ids, or vLLM's dict ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``, which may carry a
        ``"cache_salt"`` (prefix-cache blocks are shared only within one salt). ``priority``: one per
        prompt, lower first (with ``scheduling_policy="priority"``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: give a string, token ids, a prompt dict or a list of them, not "
                            f"{type(prompts).__name__}.")
        params = self._per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts.")
        return self._run(prompts, params, use_tqdm, priority)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, else the tokenizer's) to one conversation or a list of
        them, with ``tools`` (OpenAI's function definitions) if given, then generate. The text is returned
        as written: calls and reasoning are parsed out by the server only."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._per_prompt(sampling_params, len(conversations))
        kwargs = {"add_generation_prompt": add_generation_prompt, "chat_template": chat_template,
                  **({"tools": tools} if tools else {}), **(chat_template_kwargs or {})}
        encoded = [self.engine.inputs.apply_chat_template(c, **kwargs) for c in conversations]
        return self._run(encoded, params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given none: the model's generation_config.json defaults
        (see ``generation_config``), else vLLM's."""
        gen = self.engine.config.generation
        return SamplingParams(**gen.sampling, **({"max_tokens": None} if gen.max_tokens else {}))

    def _per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not (isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str)
                and all(isinstance(p, SamplingParams) for p in sampling_params)):
            raise TypeError(f"sampling_params: give a SamplingParams or a list of them, one a prompt, not "
                            f"{sampling_params!r:.80}.")
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts.")
        return list(sampling_params)

    def _run(self, prompts, params: list[SamplingParams], use_tqdm: bool,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        groups: list[list[str]] = []  # each prompt's request ids: n of them with parallel sampling
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                # only finished outputs are used: no per-step copies of each request's tokens
                groups.append(self.engine.add_request(str(next(self._ids)), prompt, dataclasses.replace(sp),
                                                      RequestOutputKind.FINAL_ONLY,
                                                      0 if priority is None else priority[i]))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += len(out.outputs[0].token_ids)
                        bar.update(1 / len(next(g for g in groups if out.request_id in g)))
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            self.engine.abort_request([rid for g in groups for rid in g if rid not in done])
            raise
        finally:
            bar.close()
        return [_joined([done[rid] for rid in ids]) for ids in groups]


def _joined(children: list[RequestOutput]) -> RequestOutput:
    """One prompt's output: its n parallel samples as outputs 0..n-1 (vLLM's shape)."""
    if len(children) == 1:
        return children[0]
    first = children[0]
    outputs = [dataclasses.replace(c.outputs[0], index=j) for j, c in enumerate(children)]
    return dataclasses.replace(first, request_id=first.request_id.rsplit("-", 1)[0], outputs=outputs)
