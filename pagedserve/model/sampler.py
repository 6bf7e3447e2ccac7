"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, top-N logprobs.

Random rows use the Gumbel-max form ``argmax(p / q)`` with ``q ~ Exp(1)``: a seeded request draws its
``q`` from its own generator, so its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per step by the model runner."""

    temperature: torch.Tensor | None  # [N] float32 (1.0 for greedy rows); None when all rows are greedy
    greedy: torch.Tensor | None       # [N] bool; None when all rows are greedy
    top_k: torch.Tensor | None       # [N] int64, vocab size for rows without top-k; None if no row uses it
    top_p: torch.Tensor | None       # [N] float32; None if no row uses it
    min_p: torch.Tensor | None       # [N] float32; None if no row uses it
    generators: list[torch.Generator | None]
    all_greedy: bool
    num_logprobs: int                # max top-N requested in the batch; -1: none


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [N] int64
    logprobs: torch.Tensor | None = None     # [N, 1 + K] float32: sampled token first, then top-K
    logprob_ids: torch.Tensor | None = None  # [N, 1 + K] int64
    ranks: torch.Tensor | None = None        # [N] int64: rank of the sampled token (1 = most likely)

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.token_ids, self.logprobs, self.logprob_ids, self.ranks


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        probs = _filtered_probs(logits / batch.temperature.unsqueeze(1), batch)
        q = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(batch.generators):  # seeded rows redraw from their own generator
            if gen is not None:
                q[i].exponential_(generator=gen)
        sampled = (probs / q).argmax(dim=-1)
        tokens = torch.where(batch.greedy, greedy_tokens, sampled)
    if batch.num_logprobs < 0:
        return SamplerOutput(tokens)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(batch.num_logprobs, dim=-1)
    return SamplerOutput(tokens, torch.cat([chosen, top_vals], 1), torch.cat([tokens.unsqueeze(1), top_ids], 1), ranks)


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.top_k is not None or batch.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(logits.shape[1], device=logits.device)
            drop |= ranks.unsqueeze(0) >= batch.top_k.unsqueeze(1)
        if batch.top_p is not None:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above this token
            drop |= before > batch.top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
