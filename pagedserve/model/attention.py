"""Paged attention: the per-step metadata, the backend interface, and the plain-torch reference backend.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. A request
owns a list of block ids (its block table); token ``p`` of the request lives in block
``table[p // block_size]`` at offset ``p % block_size``, i.e. at flat slot ``block * block_size + offset``.

A step's batch is "varlen": the scheduled tokens of all requests are concatenated. A request contributes
``query_len`` new tokens (a prefill chunk, or 1 for decode) and attends to ``seq_len`` tokens in all:
those already in the cache plus the new ones, which are written to the cache first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F



@dataclass
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor   # [B + 1] int32: offsets of each request's tokens in the batch
    seq_lens: torch.Tensor          # [B] int32: tokens each request attends to after this step
    block_tables: torch.Tensor      # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: np.ndarray      # [B] the same query lengths on the host (no device sync to read them)
    backend_state: object = None    # whatever the backend precomputes once per step


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Precompute per-step state (index tensors, masks) into ``meta.backend_state``."""

    def variants(self, meta: AttentionMetadata, max_seq_len: int) -> Iterator[None]:
        """Set ``meta.backend_state`` (prepared for a batch with prefills and decodes) to each kernel
        variant that ``prepare`` may choose for steps up to ``max_seq_len``, yielding after each: the
        model runner runs them all at start-up so that none is compiled while serving."""

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, layer, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, bool]:
        """From the layer's fused q/k/v projection [T, (Hq + 2 Hkv) D] to the attention output [T, Hq, D]:
        q/k norms and rotary as ``layer.split_qkv`` does them, K/V written into ``kv_cache`` first. Also
        whether the kernel lets the launch after it start before it ends (a programmatic dependent launch),
        so that o_proj can copy its weights in while the attention runs."""


def staged(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor ready to copy to ``device``: in pinned memory for a GPU, so that a
    non-blocking copy queues behind the work already launched instead of waiting for it (a copy from
    pageable memory may block until the stream drains, which would undo the overlap of host and device)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if device.type == "cuda" else t


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return staged(a, device).to(device, non_blocking=True)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as bytes: torch's CPU index kernels do not take fp8, and a copy of bytes is exact."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def flat_slots(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, H, D] -> [2, num_blocks * block_size, H, D] (a view)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    return kv_cache.view(2, num_blocks * block_size, h, d)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into their slots (casting to the cache dtype, e.g. fp8)."""
    flat = _raw(flat_slots(kv_cache))
    flat[0].index_copy_(0, slot_mapping, _raw(k.to(kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, _raw(v.to(kv_cache.dtype)))


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (any shape), converted to ``dtype``: each [*slots.shape, H, D]."""
    flat = _raw(flat_slots(kv_cache))
    k, v = flat[0][slots], flat[1][slots]
    if kv_cache.dtype in _FP8:
        k, v = k.view(kv_cache.dtype), v.view(kv_cache.dtype)
    return k.to(dtype), v.to(dtype)


@dataclass
class _TorchState:
    key_slots: torch.Tensor    # [B, S] flat cache slot of every key position (S = max_seq_len)
    query_index: torch.Tensor  # [B, Q] batch row of every padded query position (Q = max_query_len)
    query_valid: torch.Tensor  # [B, Q] bool
    mask: torch.Tensor         # [B, 1, Q, S] bool: causal within the request, inside its seq_len


class TorchAttentionBackend:
    """Reference backend: gather each request's keys through its block table, pad, run SDPA.

    Correct for any mix of prefill chunks and decodes; GPU kernels are checked against it.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        dev = meta.seq_lens.device
        seq_lens = meta.seq_lens.long()
        starts = meta.query_start_loc.long()
        query_lens = starts[1:] - starts[:-1]
        S, Q = meta.max_seq_len, meta.max_query_len
        pos = torch.arange(S, device=dev)
        blocks = meta.block_tables.long().gather(1, (pos // block_size).clamp(max=meta.block_tables.shape[1] - 1)
                                                 .expand(len(seq_lens), S))
        key_slots = blocks * block_size + pos % block_size
        qpos_local = torch.arange(Q, device=dev)
        query_valid = qpos_local[None, :] < query_lens[:, None]
        query_index = (starts[:-1, None] + qpos_local[None, :]).clamp(max=max(int(starts[-1]) - 1, 0))
        # absolute position of each query token: the last query_len positions of the sequence
        qpos = seq_lens[:, None] - query_lens[:, None] + qpos_local[None, :]
        mask = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < seq_lens[:, None, None])
        mask = mask | ~query_valid[:, :, None]  # padded rows attend to something: no NaN rows
        meta.backend_state = _TorchState(key_slots, query_index, query_valid, mask.unsqueeze(1))

    def variants(self, meta: AttentionMetadata, max_seq_len: int) -> Iterator[None]:
        yield  # torch ops: nothing to compile

    def forward(self, qkv, positions, layer, kv_cache, meta):
        q, k, v = layer.split_qkv(qkv, positions)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, layer.scale), False

    def attend(self, q, kv_cache, meta, scale):
        st: _TorchState = meta.backend_state
        keys, values = gather_kv(kv_cache, st.key_slots, q.dtype)     # [B, S, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        queries = q[st.query_index].transpose(1, 2)                    # [B, Hq, Q, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=st.mask, scale=scale,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        return out.transpose(1, 2)[st.query_valid]                     # [T, Hq, D]
