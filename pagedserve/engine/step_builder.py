"""From the scheduler's decision to the arrays the model consumes (``model.step``): token ids, positions,
cache slots, block tables, and each sampling row's parameters and noise key.

One step is in flight while the next is built: a request whose input token the previous step is still
sampling gets a placeholder and an entry in ``fill_rows``/``fill_from``, and the model takes the value
from that step's samples on the device.
"""

from __future__ import annotations

import numpy as np

from pagedserve.engine import structured
from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.model.step import PenaltyInputs, SamplingInputs, StepInputs
from pagedserve.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1  # noise keys are non-negative int64
# a temperature this high already samples uniformly at float32 precision; larger ones would overflow it
_MAX_TEMPERATURE = 1e6


class StepBuilder:
    def __init__(self, block_size: int, vocab_size: int, seed: int):
        self.block_size, self.vocab_size = block_size, vocab_size
        self._seed_base = seed          # noise keys of unseeded rows: (engine seed, step, row)
        self._num_sampling_steps = 0
        self._last_rows: dict[str, int] = {}  # each request's row in the previous step's samples

    def build(self, out: SchedulerOutput, pool: BlockPool) -> tuple[StepInputs, SamplingInputs | None]:
        inputs = self._inputs(out, pool)
        sampled = [it.request for it in out.scheduled if it.samples]
        sampling = self._sampling(sampled) if sampled else None
        self._last_rows = {r.request_id: row for row, r in enumerate(sampled)}
        return inputs, sampling

    def forget(self) -> None:
        """The step in flight failed: no later step takes tokens from it."""
        self._last_rows = {}

    def _inputs(self, out: SchedulerOutput, pool: BlockPool) -> StepInputs:
        """One Python pass over the requests; tables come pre-laid-out from the pool."""
        bs, items, last_rows = self.block_size, out.scheduled, self._last_rows
        n = len(items)
        rids, starts_l, lens_l, samples_l, ids = [], [], [], [], []
        fill_rows, fill_from = [], []
        score_rows, score_targets, score_top = [], [], 0
        for it in items:
            req, start, num = it.request, it.start, it.num_tokens
            rids.append(req.request_id)
            starts_l.append(start)
            lens_l.append(num)
            samples_l.append(it.samples)
            known = req.all_token_ids
            end = start + num
            if it.num_scored:  # the rows of positions scores_from.. score the prompt tokens after them
                first = len(ids) + it.scores_from - start
                score_rows.extend(range(first, first + it.num_scored))
                score_targets.extend(known[it.scores_from + 1:it.scores_from + 1 + it.num_scored])
                score_top = max(score_top, req.sampling_params.prompt_logprobs)
            ids.extend(known[start:end])
            if end > len(known):  # only the last input can be in flight (one step runs at a time)
                fill_rows.append(len(ids))
                fill_from.append(last_rows[req.request_id])
                ids.append(0)
        starts, query_lens = np.array(starts_l, dtype=np.int64), np.array(lens_l, dtype=np.int64)
        tables = pool.stacked_tables(rids)
        if (query_lens == 1).all():  # decode steps: one token each, at position start
            pos, rows = starts, np.arange(n)
        else:
            rows = np.repeat(np.arange(n), query_lens)
            pos = np.arange(len(rows)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens) + starts[rows]
        slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        ends = np.cumsum(query_lens) - 1
        samples = np.array(samples_l, dtype=bool)
        return StepInputs(np.asarray(ids, dtype=np.int64), pos, slots, query_lens,
                          (starts + query_lens).astype(np.int32), tables, ends[samples],
                          np.asarray(fill_rows, dtype=np.int64), np.asarray(fill_from, dtype=np.int64),
                          np.asarray(score_rows, dtype=np.int64), np.asarray(score_targets, dtype=np.int64), score_top)

    def _sampling(self, requests: list[Request]) -> SamplingInputs:
        """Per-row sampling parameters of the requests that sample this step, in row order."""
        sp = [r.sampling_params for r in requests]
        num_logprobs = max((p.logprobs for p in sp if p.logprobs is not None), default=-1)
        if all(p.plain_greedy for p in sp):  # the common benchmark case: nothing per row
            return SamplingInputs.greedy_only(num_logprobs)
        vocab = self.vocab_size
        table = np.array([(1.0 if p.greedy else min(p.temperature, _MAX_TEMPERATURE), p.greedy,
                           p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p) for p in sp],
                         dtype=np.float32).T
        # a seeded request's noise is keyed by (its seed, the index of the token being sampled): the same
        # token gets the same noise whatever the batch, and again when it is recomputed after preemption
        self._num_sampling_steps += 1
        step = (self._seed_base, self._num_sampling_steps)
        seeds = [hash((p.seed, r.num_tokens_with_pending) if p.seed is not None else (*step, i)) & _SEED_MASK
                 for i, (r, p) in enumerate(zip(requests, sp))]
        rows, mask = self._allowed(requests)
        # logit_bias entries, and -inf for each token that would complete a bad word
        biased = [(row, t, b) for row, p in enumerate(sp) if p.logit_bias for t, b in p.logit_bias.items()]
        biased += [(row, t, -np.inf) for row, r in enumerate(requests) if r.bad_words for t in r.barred_tokens()]
        index = values = None
        if biased:
            index = np.array([(row, t) for row, t, _ in biased], dtype=np.int64).T
            values = np.array([b for _, _, b in biased], dtype=np.float32)
        return SamplingInputs(table, seeds, num_logprobs, self._penalties(requests, sp), index, values, rows, mask)

    def _allowed(self, requests: list[Request]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The rows held to some tokens (a grammar's next, allowed_token_ids, or both) and their bits."""
        held = [(row, r) for row, r in enumerate(requests)
                if (r.grammar is not None and r.grammar.active) or r.allowed_tokens is not None]
        if not held:
            return None, None
        grammars = [i for i, (_, r) in enumerate(held) if r.grammar is not None and r.grammar.active]
        mask = np.full((len(held), -(-self.vocab_size // 32)), -1, dtype=np.int32)
        if grammars:
            mask[grammars] = structured.bitmask([held[i][1].grammar for i in grammars], self.vocab_size)
        for i, (_, r) in enumerate(held):
            if r.allowed_tokens is not None:
                mask[i] &= r.allowed_tokens
        return np.asarray([row for row, _ in held], dtype=np.int64), mask

    def _penalties(self, requests: list[Request], sp: list[SamplingParams]) -> PenaltyInputs | None:
        """The tokens each penalized row has seen: its output, and its prompt too for a repetition penalty."""
        rows = [i for i, p in enumerate(sp) if p.penalized]
        if not rows:
            return None
        seen, num_prompt, in_flight = [], [], []
        for i in rows:
            r = requests[i]
            start = 0 if sp[i].repetition_penalty != 1.0 else r.num_prompt_tokens
            seen.append(r.all_token_ids[start:])
            num_prompt.append(r.num_prompt_tokens - start)
            # pending: this step's sample, and the previous step's if it is still in flight (its row there:
            # build() renews the rows only after this)
            in_flight.append(self._last_rows[r.request_id] if r.num_pending_tokens > 1 else -1)
        tokens = np.full((len(rows), max(1, *map(len, seen))), self.vocab_size, dtype=np.int64)
        for row, ids in zip(tokens, seen):
            row[:len(ids)] = ids
        values = np.array([(sp[i].presence_penalty, sp[i].frequency_penalty, sp[i].repetition_penalty) for i in rows],
                          dtype=np.float32).T
        return PenaltyInputs(np.asarray(rows, dtype=np.int64), values, tokens,
                             np.asarray(num_prompt, dtype=np.int64), np.asarray(in_flight, dtype=np.int64))
