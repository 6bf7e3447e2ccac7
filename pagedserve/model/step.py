"""The contract between the engine and the model: one step as arrays. The engine decides what runs and
builds these (``engine.step_builder``); the model side consumes them and returns the sampled token ids,
and knows nothing of requests, schedules or block pools."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepInputs:
    """One step's tokens and where their K/V go: what rank 0 broadcasts to the other tensor-parallel ranks."""

    ids: np.ndarray          # [T] int64
    positions: np.ndarray    # [T] int64
    slots: np.ndarray        # [T] int64
    query_lens: np.ndarray   # [B] int64
    seq_lens: np.ndarray     # [B] int32
    tables: np.ndarray       # [B, W] int32
    sample_rows: np.ndarray  # [S] int64: rows of the batch whose logits are sampled
    fill_rows: np.ndarray    # [F] int64: entries of ``ids`` whose token the previous step is sampling ...
    fill_from: np.ndarray    # [F] int64: ... and the row of that step's sampled tokens that holds it
    # prompt_logprobs: rows whose logits score the next prompt token, that token, and the top-N to return
    score_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))     # [R] int64
    score_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [R] int64
    score_top: int = 0

    @property
    def decode_only(self) -> bool:
        return bool((self.query_lens == 1).all()) and len(self.sample_rows) == len(self.query_lens)


@dataclass
class PenaltyInputs:
    """The tokens the presence, frequency and repetition penalties look at, for the sampling rows that set
    one. A row holds its output tokens, after its prompt tokens when it has a repetition penalty; the newest
    token may still be in flight (the previous step samples it), and the model takes it on the device."""

    rows: np.ndarray         # [P] int64: the sampling rows with a penalty
    values: np.ndarray       # [3, P] float32: presence, frequency, repetition
    tokens: np.ndarray       # [P, L] int64: the tokens seen, padded with the vocabulary size
    num_prompt: np.ndarray   # [P] int64: how many leading entries of a row are prompt tokens
    in_flight: np.ndarray    # [P] int64: the previous step's sample row holding the newest token, -1 if none


@dataclass
class SamplingInputs:
    """The sampling rows' parameters, in row order (rank 0 only: the other ranks do not sample)."""

    # [5, S] float32: temperature (1 for greedy rows), greedy, top-k (the vocabulary size when off),
    # top-p, min-p; None when every row is greedy (nothing to upload)
    table: np.ndarray | None
    seeds: list[int]         # each row's noise key (non-negative int64)
    num_logprobs: int        # the most top-N logprobs a row asks for; -1: none
    penalties: PenaltyInputs | None = None
    # logit_bias entries of every row: [2, E] int64 (row, token) and [E] float32 bias; None if no row has one
    bias_index: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    # the rows held to some tokens (a grammar's, allowed_token_ids), and [A, ceil(vocab / 32)] int32 bits of those
    allowed_rows: np.ndarray | None = None
    allowed_bitmask: np.ndarray | None = None

    @classmethod
    def greedy_only(cls, num_logprobs: int = -1) -> SamplingInputs:
        return cls(None, [], num_logprobs)
