"""Batched sampling: allowed tokens, logit bias (bad words as -inf), penalties, greedy, temperature, top-k,
top-p, min-p, per-request seeds, top-N logprobs.

Random rows use the Gumbel-max form: ``argmax(logits / T + g)`` with ``g = -log(-log u)``, ``u`` uniform,
samples exactly from ``softmax(logits / T)``, and needs no softmax, only one read of the logits (on
CUDA one fused kernel, ``fused.gumbel_argmax``). Top-k / top-p / min-p set the logits they drop to -inf
first. Each row's noise is keyed by a seed the model runner derives from the request's seed and the
index of the token being sampled, so a seeded request's samples do not depend on what else is in the
batch, nor on preemption. Logit biases and penalties change the logits that are sampled from; logprobs
are those of the model's own logits (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.model import fused


@dataclass
class Penalties:
    """OpenAI's presence and frequency penalties over a row's output tokens and the repetition penalty
    (CTRL's, as Hugging Face and vLLM apply it) over its prompt and output tokens, for some rows."""

    rows: torch.Tensor        # [P] int64: the rows they apply to
    values: torch.Tensor      # [3, P] float32: presence, frequency, repetition
    tokens: torch.Tensor      # [P, L] int64: the tokens each row has seen, padded with the vocabulary size
    num_prompt: torch.Tensor  # [P] int64: leading entries of a row that are prompt tokens

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits with the rows' penalties applied (the repetition penalty first, as vLLM does)."""
        vocab = logits.shape[1]
        presence, frequency, repetition = (v.unsqueeze(1) for v in self.values)
        is_output = torch.arange(self.tokens.shape[1], device=logits.device) >= self.num_prompt.unsqueeze(1)
        output = torch.where(is_output, self.tokens, vocab)
        counts = torch.zeros((len(self.rows), vocab + 1), device=logits.device)
        counts = counts.scatter_add_(1, output, torch.ones(output.shape, device=logits.device))[:, :vocab]
        seen = torch.zeros((len(self.rows), vocab + 1), dtype=torch.bool, device=logits.device)
        seen = seen.scatter_(1, self.tokens, True)[:, :vocab]
        x = logits.index_select(0, self.rows).float()
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        return logits.float().index_copy(0, self.rows, x)


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per step by the model runner."""

    temperature: torch.Tensor | None  # [N] float32 (1.0 for greedy rows); None when all rows are greedy
    greedy: torch.Tensor | None       # [N] bool; None when all rows are greedy
    top_k: torch.Tensor | None       # [N] int64, vocab size for rows without top-k; None if no row uses it
    top_p: torch.Tensor | None       # [N] float32; None if no row uses it
    min_p: torch.Tensor | None       # [N] float32; None if no row uses it
    seeds: torch.Tensor | None       # [N] int64: each row's noise key
    seed_list: list[int]             # the same keys on the host (the torch path draws from them)
    all_greedy: bool
    num_logprobs: int                # max top-N requested in the batch; -1: none
    penalties: Penalties | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # [2, E] (row, token) and [E] bias
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None     # [A] rows and [A, vocab/32] allowed-token bits

    @classmethod
    def greedy_only(cls, num_logprobs: int = -1) -> SamplingBatch:
        """Every row greedy and none penalized: no per-row tensors."""
        return cls(None, None, None, None, None, None, [], True, num_logprobs)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [N] int64
    logprobs: torch.Tensor | None = None     # [N, 1 + K] float32: sampled token first, then top-K
    logprob_ids: torch.Tensor | None = None  # [N, 1 + K] int64
    ranks: torch.Tensor | None = None        # [N] int64: rank of the sampled token (1 = most likely)

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.token_ids, self.logprobs, self.logprob_ids, self.ranks


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        x, inv_t = logits, 1.0 / batch.temperature
        if batch.allowed is not None:  # first: structured output (and allowed_token_ids) allow only these tokens
            x = masked_to_allowed(x, *batch.allowed)
        if batch.logit_bias is not None:  # before the penalties, as vLLM applies them
            index, bias = batch.logit_bias
            x = x.float().index_put((index[0], index[1]), bias, accumulate=True)
        if batch.penalties is not None:
            x = batch.penalties.apply(x)
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            x, inv_t = _filtered_logits(x.float() * inv_t.unsqueeze(1), batch), torch.ones_like(inv_t)
        if x.is_cuda:
            tokens = fused.gumbel_argmax(x, inv_t, batch.seeds, ~batch.greedy)
        else:
            tokens = gumbel_argmax_reference(x, inv_t, batch.seed_list, ~batch.greedy)
    if batch.num_logprobs < 0:
        return SamplerOutput(tokens)
    return token_logprobs(logits, tokens, batch.num_logprobs)


def masked_to_allowed(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 logits with every token a row may not sample at -inf (bit t of a row: token t)."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=bitmask.dtype)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    x = logits.float()
    return x.index_copy(0, rows, x.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    """Each row's log-probability of its token under the model's logits, that token's rank, and the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return SamplerOutput(tokens, torch.cat([chosen, top_vals], 1), torch.cat([tokens.unsqueeze(1), top_ids], 1), ranks)


def gumbel_argmax_reference(x: torch.Tensor, inv_t: torch.Tensor, seeds: list[int], noisy: torch.Tensor) -> torch.Tensor:
    """What ``fused.gumbel_argmax`` computes, with torch's generator as the uniform source."""
    x = x.float() * inv_t.unsqueeze(1)
    u = torch.stack([torch.rand(x.shape[1], generator=torch.Generator().manual_seed(s)) for s in seeds]).to(x.device)
    return torch.where(noisy.unsqueeze(1), x - torch.log(-torch.log(u)), x).argmax(dim=-1)


def _filtered_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled float32 logits with the tokens that top-k, top-p and min-p drop set to -inf."""
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
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
