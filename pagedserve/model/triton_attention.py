"""Paged attention in Triton: one kernel for prefill chunks and decode, reading K/V through block tables.

A program handles one *query tile* (up to BLOCK_Q consecutive new tokens of one request) for one KV
head, with all G query heads of that KV head stacked into the rows of one matrix (BLOCK_M = BLOCK_Q x G,
padded), so a decode step still feeds the tensor cores. It walks the request's keys in TILE-sized steps,
finding each key's physical block through the block table, with an online softmax in float32.

Decode tiles may be split over NUM_SEGMENTS programs along the keys (flash-decoding); each writes a
partial (acc, max, sum) and a second kernel merges them. Decode and prefill tiles each get a tile shape
that suits them; a mixed step whose decodes are not split runs both kinds in one launch.

Tested against the torch reference backend: on CPU under TRITON_INTERPRET=1 (tests/test_triton_attention.py)
and on the GPU on real shapes (benchmarks/gpu_check.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagedserve.model.attention import AttentionMetadata, to_device
from pagedserve.model.cuda_decode import CudaFp8Decode
from pagedserve.model.fused import norm_rope, qkv_rope_store


@triton.jit
def _e4m3_to_f16(x):
    """fp8 e4m3 -> fp16, four values an instruction pair, opaque to Triton's layout passes.

    With a plain ``.to()`` Triton moves the V tile's layout change for the P.V dot in front of the cast,
    so it stages e4m3 bytes in shared memory and gathers the dot operand byte by byte (128 LDS.U8 a
    64-key tile: there is no 8-bit transposing ldmatrix). Not pure, so it stays where it is: V is
    converted in registers and staged as fp16, which ``ldmatrix.trans`` reads. GPU only (the
    interpreter has no PTX); CPU runs take ``.to()``.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.int8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _prefetch_first_tile(K, table, kv_end, seg, stride_kvkv, stride_kvb, stride_kvs, HEAD_DIM: tl.constexpr,
                         TILE: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, LINES: tl.constexpr):
    """Pulls the K and V lines of segment ``seg``'s first key tile into L2 (GPU only: PTX prefetch), so the
    attention's first reads after a dependent launch's wait find them there."""
    per_seg = tl.cdiv(tl.cdiv(kv_end, TILE), NUM_SEGMENTS)
    kpos = seg * per_seg * TILE + tl.arange(0, TILE)
    kmask = kpos < kv_end
    blk = tl.load(table + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    rows = K + blk * stride_kvb + (kpos % PAGE) * stride_kvs
    lines = rows[:, None] + (tl.arange(0, LINES) * (HEAD_DIM // LINES))[None, :]
    lines = tl.where(kmask[:, None], lines, K)  # keys past the end: the first line, harmlessly
    for kv in tl.static_range(2):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines + kv * stride_kvkv],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _attend_segment(q, K, table, kv_end, qpos, qk_scale, seg, stride_kvkv, stride_kvb, stride_kvs,
                    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
                    PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FP16_DOTS: tl.constexpr,
                    V_CVT_ASM: tl.constexpr, STAGES: tl.constexpr):
    """The online softmax (m, s_sum, acc) of q's rows over segment ``seg`` of NUM_SEGMENTS of one request's
    key tiles before ``kv_end``: ``K`` is the cache at this KV head, ``table`` the request's block table;
    rows are causal up to ``qpos`` unless BLOCK_Q is 1 (a decode sees every key)."""
    num_tiles = tl.cdiv(kv_end, TILE)
    per_seg = tl.cdiv(num_tiles, NUM_SEGMENTS)
    first = seg * per_seg
    last = tl.minimum(num_tiles, first + per_seg)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if BLOCK_Q == 1:  # a decode: every key before the end is causal
        for j in tl.range(first, last, num_stages=STAGES):
            m, s_sum, acc = _attend_keys(q, K, table, j, kv_end, qpos, qk_scale, m, s_sum, acc, stride_kvkv,
                                         stride_kvb, stride_kvs, HEAD_DIM, TILE, PAGE, FP16_DOTS, V_CVT_ASM, True, False)
    else:
        # prompt rows: the tiles before the first row's position are seen whole by every row, so only the
        # tiles on the diagonal pay for the causal mask (the softmax's share of a tile, not its loads)
        whole = tl.minimum(last, tl.minimum(kv_end, tl.min(qpos, 0) + 1) // TILE)
        for j in tl.range(first, whole, num_stages=STAGES):
            m, s_sum, acc = _attend_keys(q, K, table, j, kv_end, qpos, qk_scale, m, s_sum, acc, stride_kvkv,
                                         stride_kvb, stride_kvs, HEAD_DIM, TILE, PAGE, FP16_DOTS, V_CVT_ASM, False,
                                         False)
        for j in tl.range(tl.maximum(first, whole), last, num_stages=STAGES):
            m, s_sum, acc = _attend_keys(q, K, table, j, kv_end, qpos, qk_scale, m, s_sum, acc, stride_kvkv,
                                         stride_kvb, stride_kvs, HEAD_DIM, TILE, PAGE, FP16_DOTS, V_CVT_ASM, True, True)
    return m, s_sum, acc


@triton.jit
def _attend_keys(q, K, table, j, kv_end, qpos, qk_scale, m, s_sum, acc, stride_kvkv, stride_kvb, stride_kvs,
                 HEAD_DIM: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr, FP16_DOTS: tl.constexpr,
                 V_CVT_ASM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One step of the online softmax over key tile ``j``. MASKED: keys past ``kv_end`` (and with CAUSAL, past
    each row's ``qpos``) are left out; unmasked, every key of the tile is before every row."""
    d = tl.arange(0, HEAD_DIM)
    kpos = j * TILE + tl.arange(0, TILE)
    kmask = kpos < kv_end
    if MASKED:
        blk = tl.load(table + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    else:
        blk = tl.load(table + kpos // PAGE).to(tl.int64)
    off = blk * stride_kvb + (kpos % PAGE) * stride_kvs
    # V is read here, not after the softmax that needs only K, so that both tiles are in flight at once
    if MASKED:
        k = tl.load(K + off[:, None] + d[None, :], mask=kmask[:, None], other=0.0).to(q.dtype)
        v = tl.load(K + stride_kvkv + off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(K + off[:, None] + d[None, :]).to(q.dtype)
        v = tl.load(K + stride_kvkv + off[:, None] + d[None, :])
    if V_CVT_ASM:
        v = _e4m3_to_f16(v)
    else:
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k))
    if not FP16_DOTS:
        s = s * qk_scale
    if MASKED:
        if CAUSAL:
            s = tl.where((kpos[None, :] <= qpos[:, None]) & kmask[None, :], s, float("-inf"))
        else:
            s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    s_sum = s_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, s_sum, acc


@triton.jit
def _attend_tile(
    Q, KV, Out, PartAcc, PartML, block_tables, seq_lens, query_start, tile_seq, tile_qoff, tile, kvh, seg, scale,
    stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FP16_DOTS: tl.constexpr,
    V_CVT_ASM: tl.constexpr, STAGES: tl.constexpr,
):
    """Query tile ``tile`` of (tile_seq, tile_qoff) at KV head ``kvh``: its output, or segment ``seg``'s partial."""
    seq = tl.load(tile_seq + tile)
    q_off = tl.load(tile_qoff + tile)
    q_start = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    t = rows // G
    g = rows % G
    tok = q_off + t
    row_valid = (t < BLOCK_Q) & (tok < q_len)
    head = kvh * G + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634  # the softmax runs in base 2: exp2 needs no multiply of its own
    if FP16_DOTS:  # an fp8 cache: e4m3 -> fp16 is one instruction per two values (-> bf16 is several)
        # the scale folded into q, one multiply per query instead of one per score: fp16 keeps the
        # product to 11 bits (bf16's 8 bits doubled the error, and bf16 decode is HBM-bound anyway)
        q = (q * qk_scale).to(tl.float16)
    qpos = ctx + tok

    kv_end = tl.minimum(seq_len, ctx + q_off + BLOCK_Q)
    m, s_sum, acc = _attend_segment(q, KV + kvh * stride_kvh, block_tables + seq * stride_bt, kv_end, qpos, qk_scale,
                                    seg, stride_kvkv, stride_kvb, stride_kvs, BLOCK_Q, BLOCK_M, HEAD_DIM, TILE, PAGE,
                                    NUM_SEGMENTS, FP16_DOTS, V_CVT_ASM, STAGES)

    _finish(Out, PartAcc, PartML, m, s_sum, acc, q_start + tok, tile, head, seg, G * tl.num_programs(1), row_valid,
            stride_ot, stride_oh, HEAD_DIM, NUM_SEGMENTS)


# the block-table stride is the widest table of the step: not specialized on (divisibility by 16, == 1),
# or every new width class would compile the kernel again in the middle of serving
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention(
    Q, KV, Out, PartAcc, PartML,
    block_tables, seq_lens, query_start, tile_seq, tile_qoff,
    scale,
    stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FP16_DOTS: tl.constexpr,
    V_CVT_ASM: tl.constexpr, STAGES: tl.constexpr,
):
    _attend_tile(Q, KV, Out, PartAcc, PartML, block_tables, seq_lens, query_start, tile_seq, tile_qoff,
                 tl.program_id(0), tl.program_id(1), tl.program_id(2), scale, stride_qt, stride_qh, stride_kvkv,
                 stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh, G, BLOCK_Q, BLOCK_M, HEAD_DIM,
                 TILE, PAGE, NUM_SEGMENTS, FP16_DOTS, V_CVT_ASM, STAGES)


# the decode tile count changes with every eager step's batch: not specialized on, as stride_bt
@triton.jit(do_not_specialize=["stride_bt", "num_decode"])
def _mixed_attention(
    Q, KV, Out, block_tables, seq_lens, query_start, dec_seq, dec_qoff, pre_seq, pre_qoff, num_decode, scale,
    stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP16_DOTS: tl.constexpr,
    DEC_BLOCK_M: tl.constexpr, DEC_TILE: tl.constexpr, DEC_STAGES: tl.constexpr, DEC_V_ASM: tl.constexpr,
    PRE_BLOCK_Q: tl.constexpr, PRE_BLOCK_M: tl.constexpr, PRE_TILE: tl.constexpr, PRE_STAGES: tl.constexpr,
):
    """A mixed step's decode tiles (the first ``num_decode`` programs along axis 0) and prefill tiles in one
    launch, each with its own tile shape: the memory-bound decodes and the compute-bound prompt tiles share
    the SMs instead of each launch leaving part of them idle."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    if tile < num_decode:
        _attend_tile(Q, KV, Out, Out, Out, block_tables, seq_lens, query_start, dec_seq, dec_qoff, tile, kvh, 0,
                     scale, stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt,
                     stride_ot, stride_oh, G, 1, DEC_BLOCK_M, HEAD_DIM, DEC_TILE, PAGE, 1, FP16_DOTS, DEC_V_ASM,
                     DEC_STAGES)
    else:
        _attend_tile(Q, KV, Out, Out, Out, block_tables, seq_lens, query_start, pre_seq, pre_qoff, tile - num_decode,
                     kvh, 0, scale, stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt,
                     stride_ot, stride_oh, G, PRE_BLOCK_Q, PRE_BLOCK_M, HEAD_DIM, PRE_TILE, PAGE, 1, FP16_DOTS, False,
                     PRE_STAGES)


@triton.jit
def _finish(Out, PartAcc, PartML, m, s_sum, acc, out_row, tile, head, seg, num_q, row_valid, stride_ot, stride_oh,
            HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """The rows' output, or this segment's partial (acc, max, sum), indexed [decode tile, q head, segment]."""
    d = tl.arange(0, HEAD_DIM)
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(s_sum == 0.0, 1.0, s_sum)[:, None]
        tl.store(Out + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_valid[:, None])
    else:
        base = (tile * num_q + head) * NUM_SEGMENTS + seg
        tl.store(PartAcc + base[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
        tl.store(PartML + base * 2, m, mask=row_valid)
        tl.store(PartML + base * 2 + 1, s_sum, mask=row_valid)


@triton.jit
def _merge_heads(PartAcc, PartML, Out, tile, out_row, kvh, num_q, stride_ot, stride_oh, G: tl.constexpr,
                 G_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s for the G query heads of one KV head of one
    decode tile. Partials are read past L1 (.cg): the fused decode merges what other programs just wrote."""
    h = tl.arange(0, G_POW2)
    real = h < G
    head = kvh * G + h
    segs = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_DIM)
    base = (tile * num_q + head)[:, None] * NUM_SEGMENTS + segs[None, :]  # [heads, segments]
    m = tl.load(PartML + base * 2, mask=real[:, None], other=float("-inf"), cache_modifier=".cg")
    ssum = tl.load(PartML + base * 2 + 1, mask=real[:, None], other=0.0, cache_modifier=".cg")
    acc = tl.load(PartAcc + base[:, :, None] * HEAD_DIM + d[None, None, :], mask=real[:, None, None], other=0.0,
                  cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(ssum > 0.0, tl.exp2(m - m_max[:, None]), 0.0)  # m in base 2, as the attention kernels keep it
    total = tl.sum(w * ssum, 1)
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(Out + out_row * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=real[:, None])


@triton.jit
def _merge_segments(PartAcc, PartML, Out, tile_seq, query_start, stride_ot, stride_oh, G: tl.constexpr,
                    G_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """The split decodes of a mixed step, merged: one program per (decode tile, KV head)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    _merge_heads(PartAcc, PartML, Out, tile, tl.load(query_start + tl.load(tile_seq + tile)), kvh,
                 G * tl.num_programs(1), stride_ot, stride_oh, G, G_POW2, HEAD_DIM, NUM_SEGMENTS)


@triton.jit(do_not_specialize=["stride_bt"])
def _fused_decode(
    QKV, Pos, Cos, Sin, QW, KW, Slots, KV, Out, PartAcc, PartML, Counter,
    block_tables, seq_lens, scale, eps,
    stride_t, stride_cos, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    FP16_DOTS: tl.constexpr, V_CVT_ASM: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, STAGES: tl.constexpr,
):
    """A decode-only step's attention as one kernel a layer instead of three (qkv_rope_store, the
    attention, the merge): at small batches the launches, not the bytes, were the cost.

    Program (request, KV head, segment) forms its G queries from the q/k/v projection (q/k norm as
    ``qkv_rope_store`` rounds it, rotary) and attends over its segment of the cached keys; the last
    segment adds the request's new key itself and writes the new K and V into the cache (no program reads
    them back). Split over segments, the program that finishes a (request, KV head) last, by an atomic
    count, merges the partials and resets the count for the next layer.

    PDL (launched as a programmatic dependent, sm_90+): the programs start while the q/k/v projection
    streams its last weights, load what the host wrote (positions, lengths) and the rotary and norm
    constants, and wait for the projection only before reading its output; they then let the next
    projection launch, so its weight stream starts during this kernel rather than after it."""
    row = tl.program_id(0)  # a decode-only step: tile i is request i is token i
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(Pos + row)
    seq_len = tl.load(seq_lens + row)  # 0 for a CUDA graph's padding rows
    cos = tl.load(Cos + pos * stride_cos + half)
    sin = tl.load(Sin + pos * stride_cos + half)
    dtype = QKV.dtype.element_ty
    if QK_NORM:
        qw1 = tl.load(QW + half).to(dtype)
        qw2 = tl.load(QW + HALF + half).to(dtype)
    else:  # unused by norm_rope without the norm
        qw1 = cos
        qw2 = cos
    if PDL:
        if PREFETCH_LINES:  # the first key tile pulled into L2 while the projection finishes
            _prefetch_first_tile(KV + kvh * stride_kvh, block_tables + row * stride_bt, tl.maximum(seq_len - 1, 0),
                                 seg, stride_kvkv, stride_kvb, stride_kvs, HEAD_DIM, TILE, PAGE, NUM_SEGMENTS,
                                 PREFETCH_LINES)
        tl.extra.cuda.gdc_wait()  # the q/k/v projection's output is complete and visible
        tl.extra.cuda.gdc_launch_dependents()  # it reads this kernel's output only after its own wait
    g = tl.arange(0, BLOCK_M)
    real = g < G
    head = kvh * G + g
    qcol = QKV + row * stride_t + head[:, None] * HEAD_DIM
    q1 = tl.load(qcol + half[None, :], mask=real[:, None], other=0.0)
    q2 = tl.load(qcol + HALF + half[None, :], mask=real[:, None], other=0.0)
    o1, o2 = norm_rope(q1, q2, qw1, qw2, cos, sin, eps, HEAD_DIM, QK_NORM)
    q = _halves_joined(o1.to(dtype), o2.to(dtype), BLOCK_M, HEAD_DIM)
    qk_scale = scale * 1.4426950408889634
    if FP16_DOTS:  # as in _paged_attention
        q = (q * qk_scale).to(tl.float16)

    cached = tl.maximum(seq_len - 1, 0)  # keys already in the cache; the new one is added below
    m, s_sum, acc = _attend_segment(q, KV + kvh * stride_kvh, block_tables + row * stride_bt, cached, cached, qk_scale,
                                    seg, stride_kvkv, stride_kvb, stride_kvs, 1, BLOCK_M, HEAD_DIM, TILE, PAGE,
                                    NUM_SEGMENTS, FP16_DOTS, V_CVT_ASM, STAGES)

    if seg == NUM_SEGMENTS - 1:
        if QK_NORM:
            kw1 = tl.load(KW + half).to(dtype)
            kw2 = tl.load(KW + HALF + half).to(dtype)
        else:
            kw1 = cos
            kw2 = cos
        every = tl.zeros([BLOCK_M, 1], tl.int32)  # each row reads the one key head: the scores are row-wise
        kcol = QKV + row * stride_t + (NUM_Q + kvh) * HEAD_DIM + every
        k1, k2 = norm_rope(tl.load(kcol + half[None, :]), tl.load(kcol + HALF + half[None, :]),
                            kw1, kw2, cos, sin, eps, HEAD_DIM, QK_NORM)
        k = _halves_joined(k1, k2, BLOCK_M, HEAD_DIM).to(KV.dtype.element_ty)
        v = tl.load(kcol + NUM_KV * HEAD_DIM + d[None, :]).to(KV.dtype.element_ty)
        dst = KV + tl.load(Slots + row).to(tl.int64) * stride_kvs + kvh * stride_kvh + every + d[None, :]
        first_row = (g == 0)[:, None]
        tl.store(dst, k, mask=first_row)
        tl.store(dst + stride_kvkv, v, mask=first_row)
        s = tl.sum(q.to(tl.float32) * k.to(q.dtype).to(tl.float32), 1)
        if not FP16_DOTS:
            s = s * qk_scale
        s = tl.where(seq_len > 0, s, float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe)
        alpha = tl.exp2(m - m_safe)
        s_sum = s_sum * alpha + p
        acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v.to(q.dtype).to(tl.float32)
        m = m_new

    _finish(Out, PartAcc, PartML, m, s_sum, acc, row + tl.zeros([BLOCK_M], tl.int32), row, head, seg, NUM_Q, real,
            stride_ot, stride_oh, HEAD_DIM, NUM_SEGMENTS)
    if NUM_SEGMENTS > 1:
        tl.debug_barrier()  # every thread's partials are written before the count says so
        count = Counter + row * NUM_KV + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_SEGMENTS - 1:
            _merge_heads(PartAcc, PartML, Out, row, row, kvh, NUM_Q, stride_ot, stride_oh, G, G_POW2, HEAD_DIM,
                         NUM_SEGMENTS)
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")


@triton.jit
def _halves_joined(a, b, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, D/2] x 2 -> [ROWS, D]: a in the first half of each row, b in the second."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (ROWS, HEAD_DIM))


@dataclass
class _Launch:
    tile_seq: torch.Tensor
    tile_qoff: torch.Tensor
    block_q: int
    block_m: int
    num_segments: int


@dataclass
class TritonState:
    decode: _Launch | None
    prefill: _Launch | None
    part_acc: torch.Tensor | None
    part_ml: torch.Tensor | None
    counts: torch.Tensor | None  # [decode tiles x KV heads] segments finished (the fused decode's merge)
    padded: bool = False         # tiles of fixed number (a captured graph); unused ones point at an empty row


class TritonAttentionBackend:
    name = "triton"
    # launch shapes picked by benchmarks/kernels/decode.py's sweeps (the figures: docs/lab-notes.md)
    TILE = 64  # a decode's keys an inner step
    SPLIT_TILE = 128  # ... for decodes split over segments
    FULL = 2  # programs an SM at which a batch's decodes fill the GPU alone (fewer: split, or share a launch)
    PREFILL_ROWS = 64  # query rows (tokens x the KV head's query heads) of a prompt tile ...
    WIDE_PREFILL_ROWS = 128  # ... and of one in an eager step whose prompt tiles fill the GPU even at that size
    PREFILL_TILE = 64  # ... and its keys an inner step
    NUM_WARPS = 4
    NUM_STAGES = 3  # software-pipelining depth of the key loop (Triton's default) for decodes
    PREFILL_STAGES = 2  # fewer than decodes: a prefill tile's rows already keep the loads busy
    # an fp8 decode (not split): keys a step, warps, stages, and V converted by _e4m3_to_f16 on the GPU
    FP8_DECODE = (32, 1, 3)
    FP8_V_ASM = True
    FP8_SPLIT_WARPS = 2  # fp8 decodes split over segments (V cast, not converted by asm)
    CUDA_FP8_DECODE = True  # e4m3 decodes not split: the CUDA kernel of cuda_decode.py where it applies
    FUSED_DECODE = True  # decode-only steps in one kernel (_fused_decode); off only to measure what it saves
    # a mixed step's decodes and prefill tiles in one launch where _one_launch allows; off only to measure
    ONE_LAUNCH = True
    DECODE_PDL = True  # one sequence's fused decode as a programmatic dependent (sm_90+); off only to measure

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int = 132, has_pdl: bool = False):
        self.G = num_heads // num_kv_heads
        self.has_pdl = has_pdl  # programmatic dependent launch (griddepcontrol): CUDA devices of sm_90+
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_sms = num_sms
        # a decode tile is one token: its G heads padded to the smallest dot the tensor cores take
        self.decode_block_m = max(16, triton.next_power_of_2(self.G))
        self.g_pow2 = triton.next_power_of_2(self.G)  # the merge's head block
        self.prefill_block_q = max(1, self.PREFILL_ROWS // self.G)
        self.wide_block_q = max(1, self.WIDE_PREFILL_ROWS // self.G)
        self._cuda_decode: dict[int, CudaFp8Decode | None] = {}  # by block size, built at the first launch
        self._counts: dict[torch.device, torch.Tensor] = {}  # zeros between kernels: each merge resets its own

    @staticmethod
    def pdl_supported(device: torch.device) -> bool:
        """Programmatic dependent launch: griddepcontrol needs sm_90+, and Triton's gdc builtins."""
        return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
                and hasattr(tl.extra.cuda, "gdc_wait"))

    def decode_segments(self, batch: int, max_seq_len: int) -> int:
        """Split long keys over programs when the batch alone cannot fill the GPU."""
        programs = batch * self.num_kv_heads
        want = -(-self.FULL * self.num_sms // programs)
        # a segment may hold a single tile: at a few sequences, more programs beat longer loops
        useful = -(-max_seq_len // self.SPLIT_TILE)
        return max(1, min(16, triton.next_power_of_2(min(want, useful))))

    def make_state(self, dev, decode_seqs: np.ndarray, prefill_tiles: np.ndarray, num_segments: int,
                   block_q: int | None = None) -> TritonState:
        """Launches for the decoding requests and the prefill tiles ([2, n]: request, first query token) of
        ``block_q`` tokens (the narrow tiles' by default)."""
        to = lambda a: to_device(np.asarray(a, dtype=np.int32), dev)  # noqa: E731
        decode = prefill = None
        if len(decode_seqs):
            decode = _Launch(to(decode_seqs), to(np.zeros(len(decode_seqs))), 1, self.decode_block_m, num_segments)
        if prefill_tiles.shape[1]:
            prefill = self._prefill_launch(to(prefill_tiles[0]), to(prefill_tiles[1]), block_q or self.prefill_block_q)
        part_acc = part_ml = counts = None
        if decode is not None and num_segments > 1:
            n = len(decode_seqs)
            part_acc = torch.empty((n, self.num_heads, num_segments, self.head_dim), dtype=torch.float32, device=dev)
            part_ml = torch.empty((n, self.num_heads, num_segments, 2), dtype=torch.float32, device=dev)
            counts = self._zero_counts(dev, n * self.num_kv_heads)
        return TritonState(decode, prefill, part_acc, part_ml, counts)

    def _zero_counts(self, dev, n: int) -> torch.Tensor:
        """One persistent buffer a device, shared by every state and layer (kernels run one after another).
        Allocated here, outside any graph capture; splits happen only below FULL programs an SM, so the
        first size nearly always lasts."""
        counts = self._counts.get(dev)
        if counts is None or counts.numel() < n:
            counts = self._counts[dev] = torch.zeros(max(n, self.FULL * self.num_sms), dtype=torch.int32, device=dev)
        return counts

    def padded_fields(self, rows: int, tokens: int) -> list[tuple[str, int]]:
        """The int32 tile arrays of a padded state, by name and length, for steps of up to ``tokens`` tokens
        over up to ``rows`` sequences: the runner lays them out beside the step's other inputs, so that one
        copy uploads them all."""
        tiles = -(-tokens // self.prefill_block_q) + rows  # each prefilling row may end a tile early
        return [("decode_tiles", rows), ("prefill_tiles", tiles), ("prefill_offsets", tiles)]

    def padded_state(self, arrays: Mapping[str, torch.Tensor]) -> TritonState:
        """Launches of fixed size over the device arrays of ``padded_fields``, with the row after the last
        sequence left empty (no tokens, no keys): ``fill_padded`` gives each step's values, and tiles the step
        does not use point at the empty row, so the kernels skip them. Decodes are not split, so a step with
        prompt tokens runs its attention in one launch and no merge."""
        decode_tiles = arrays["decode_tiles"]
        decode = _Launch(decode_tiles, torch.zeros_like(decode_tiles), 1, self.decode_block_m, 1)
        prefill = self._prefill_launch(arrays["prefill_tiles"], arrays["prefill_offsets"], self.prefill_block_q)
        return TritonState(decode, prefill, None, None, None, padded=True)

    def _prefill_launch(self, tiles: torch.Tensor, offsets: torch.Tensor, block_q: int) -> _Launch:
        """Prompt tiles of ``block_q`` tokens, each the rows of its tokens' query heads for one KV head."""
        return _Launch(tiles, offsets, block_q, max(16, triton.next_power_of_2(block_q * self.G)), 1)

    def fill_padded(self, st: TritonState, query_lens: np.ndarray) -> dict[str, np.ndarray]:
        """The values of ``padded_fields`` for a padded state and a step's query lengths."""
        empty = len(st.decode.tile_seq)
        decode_seqs, prefill_tiles = self._tiles(query_lens, self.prefill_block_q)
        dec = np.full(empty, empty, dtype=np.int32)
        dec[:len(decode_seqs)] = decode_seqs
        pre = np.zeros((2, len(st.prefill.tile_seq)), dtype=np.int32)
        pre[0] = empty
        pre[:, :prefill_tiles.shape[1]] = prefill_tiles
        return {"decode_tiles": dec, "prefill_tiles": pre[0], "prefill_offsets": pre[1]}

    def _tiles(self, qlens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
        """The decoding requests, and the request and first query token of every prefill tile of ``block_q``
        tokens ([2, n] int32), each request's last tiles first: a tile's keys grow with its offset, and the
        GPU starts programs in order, so the longest start first and the launch does not end on a wave of them."""
        prefilling = np.nonzero(qlens > 1)[0]
        counts = -(-qlens[prefilling] // block_q)
        first = np.repeat(np.cumsum(counts) - counts, counts)  # each request's first tile, per tile
        tiles = np.stack([np.repeat(prefilling, counts), (np.arange(len(first)) - first) * block_q])
        return np.nonzero(qlens == 1)[0], np.ascontiguousarray(tiles[:, ::-1], dtype=np.int32)

    def _block_q(self, qlens: np.ndarray) -> int:
        """Wide prompt tiles where even they fill the GPU (``FULL`` programs an SM: long chunks), which then run
        faster; narrow ones otherwise, so that a short chunk still spreads over the SMs."""
        wide = int((-(-qlens[qlens > 1] // self.wide_block_q)).sum())
        return self.wide_block_q if wide * self.num_kv_heads >= self.FULL * self.num_sms else self.prefill_block_q

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        block_q = self._block_q(meta.query_lens_cpu)
        decode_seqs, prefill_tiles = self._tiles(meta.query_lens_cpu, block_q)
        segs = self.decode_segments(len(decode_seqs), meta.max_seq_len) if len(decode_seqs) else 1
        meta.backend_state = self.make_state(meta.seq_lens.device, decode_seqs, prefill_tiles, segs, block_q)

    def variants(self, meta: AttentionMetadata, max_seq_len: int) -> Iterator[None]:
        """Decode tiles at every split factor ``decode_segments`` can return (powers of two up to that of
        one long decode), next to the step's prefill tiles at either width; once for a step without decodes."""
        qlens = meta.query_lens_cpu
        for block_q in (self.prefill_block_q, self.wide_block_q) if (qlens > 1).any() else (self.prefill_block_q,):
            decode_seqs, prefill_tiles = self._tiles(qlens, block_q)
            segs, top = 1, self.decode_segments(1, max_seq_len) if len(decode_seqs) else 1
            while segs <= top:
                meta.backend_state = self.make_state(meta.seq_lens.device, decode_seqs, prefill_tiles, segs, block_q)
                yield
                segs *= 2

    def forward(self, qkv, positions, layer, kv_cache, meta):
        """A decode-only step: one fused kernel (unless the CUDA fp8 decode takes it). Otherwise one fused
        kernel for norms + rotary + K/V store, then the attention kernel(s)."""
        st: TritonState = meta.backend_state
        qw, kw, eps = (layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps) if layer.qk_norm else (None, None, 0.0)
        if self.FUSED_DECODE and st.prefill is None and self._cuda_kernel(qkv.dtype, kv_cache, st.decode, st) is None:
            pdl = self.releases_early(layer, qkv)
            return self._fused_decode(qkv, positions, layer, qw, kw, eps, kv_cache, meta, st, pdl), pdl
        q = qkv_rope_store(qkv, positions, layer.rotary.cos, layer.rotary.sin, qw, kw, eps, meta.slot_mapping,
                           kv_cache, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attend(q, kv_cache, meta, layer.scale), False

    def releases_early(self, layer, qkv: torch.Tensor) -> bool:
        """Whether the fused decode launches as a programmatic dependent: where its q/k/v projection ran on the
        one-row CUDA GEMV, which releases it early; after a cuBLAS projection (larger batches, a bias, other
        dtypes) an early launch only holds SM resources while that projection runs."""
        proj = layer.qkv_proj
        return (self.DECODE_PDL and self.has_pdl and qkv.shape[0] == 1 and proj.gemv is not None
                and proj.bias is None and proj.gemv.takes_weight(proj.weight, qkv.dtype))

    def _fused_decode(self, qkv, positions, layer, qw, kw, eps, kv_cache, meta, st: TritonState,
                      pdl: bool) -> torch.Tensor:
        launch = st.decode
        segs = launch.num_segments
        out = torch.empty((qkv.shape[0], self.num_heads, self.head_dim), dtype=qkv.dtype, device=qkv.device)
        slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)  # the kernel addresses slots flat
        split = segs > 1
        fp8 = kv_cache.element_size() == 1
        tile, warps, stages, v_asm = self._shape(launch, st, fp8, kv_cache.is_cuda)
        cos, sin = layer.rotary.cos, layer.rotary.sin
        # o_proj's weights copied beside this kernel (CudaGemv.STAGE) load HBM while it runs: its first key
        # tile goes to L2 before the wait (without the copy, that prefetch only lengthens the kernel)
        o_proj = layer.o_proj
        prefetch = pdl and o_proj.gemv is not None and o_proj.gemv.stages(o_proj.weight)
        _fused_decode[(launch.tile_seq.shape[0], self.num_kv_heads, segs)](
            qkv, positions, cos, sin, cos if qw is None else qw, cos if kw is None else kw, meta.slot_mapping,
            kv_cache, out, st.part_acc if split else out, st.part_ml if split else out, st.counts if split else out,
            meta.block_tables, meta.seq_lens, layer.scale, eps,
            qkv.stride(0), cos.stride(0), kv_cache.stride(0), kv_cache.stride(1), slots.stride(1), kv_cache.stride(3),
            meta.block_tables.stride(0), out.stride(0), out.stride(1),
            G=self.G, G_POW2=self.g_pow2, BLOCK_M=launch.block_m, HEAD_DIM=self.head_dim,
            NUM_Q=self.num_heads, NUM_KV=self.num_kv_heads, TILE=tile, PAGE=kv_cache.shape[2], NUM_SEGMENTS=segs,
            FP16_DOTS=fp8, V_CVT_ASM=v_asm, QK_NORM=qw is not None, PDL=pdl,
            PREFETCH_LINES=max(1, self.head_dim * kv_cache.element_size() // 128) if prefetch else 0, STAGES=stages,
            num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
        )
        return out

    def attend(self, q, kv_cache, meta, scale):
        st: TritonState = meta.backend_state
        out = torch.empty_like(q)
        if self._one_launch(q, kv_cache, st):
            self._launch_mixed(q, kv_cache, out, meta, st, scale)
            return out
        for launch in (st.decode, st.prefill):
            if launch is not None:
                self._launch(q, kv_cache, out, meta, st, launch, scale)
        return out

    def _one_launch(self, q, kv_cache, st: TritonState) -> bool:
        """Whether a mixed step's decode and prefill tiles go in one launch: unsplit Triton decodes over a
        16-bit cache always; over an fp8 cache (one warp a program in a launch of their own, four here) while
        they are too few to fill the GPU alone (``FULL``), so the chunk's tiles fill the SMs they leave idle."""
        if not (self.ONE_LAUNCH and st.decode is not None and st.prefill is not None and st.decode.num_segments == 1):
            return False
        if self._cuda_for(q, kv_cache, st.decode, st) is not None:
            return False
        return kv_cache.element_size() > 1 or st.decode.tile_seq.shape[0] * self.num_kv_heads < self.FULL * self.num_sms

    def _shape(self, launch: _Launch, st: TritonState, fp8: bool, on_gpu: bool) -> tuple[int, int, int, bool]:
        """(keys a step, warps, pipeline stages, V by asm) of one launch: each kind gets what measured best."""
        if launch is st.prefill:
            return self.PREFILL_TILE, self.NUM_WARPS, self.PREFILL_STAGES, False
        if launch.num_segments > 1:
            return self.SPLIT_TILE, self.FP8_SPLIT_WARPS if fp8 else self.NUM_WARPS, self.NUM_STAGES, False
        if fp8:
            return *self.FP8_DECODE, self.FP8_V_ASM and on_gpu
        return self.TILE, self.NUM_WARPS, self.NUM_STAGES, False

    def _cuda_kernel(self, q_dtype, kv_cache, launch: _Launch, st: TritonState) -> CudaFp8Decode | None:
        """The CUDA fp8 decode for this launch, if it is one the kernel covers (given aligned queries: a decode-only
        step asks before its queries exist)."""
        if not (self.CUDA_FP8_DECODE and launch is st.decode and launch.num_segments == 1 and not st.padded
                and kv_cache.is_cuda and kv_cache.dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16):
            return None
        page = kv_cache.shape[2]
        if page not in self._cuda_decode:
            self._cuda_decode[page] = CudaFp8Decode.build(self.G, self.num_kv_heads, self.head_dim, page, kv_cache.device)
        return self._cuda_decode[page]

    def _cuda_for(self, q, kv_cache, launch: _Launch, st: TritonState) -> CudaFp8Decode | None:
        """The CUDA fp8 decode for this launch over these queries (its loads need them aligned)."""
        return self._cuda_kernel(q.dtype, kv_cache, launch, st) if CudaFp8Decode.takes(q) else None

    @staticmethod
    def _strides(q, kv_cache, meta, out) -> tuple[int, ...]:
        """The strides the attention kernels take, in their order (stride_qt … stride_oh)."""
        return (q.stride(0), q.stride(1), *kv_cache.stride()[:4], meta.block_tables.stride(0),
                out.stride(0), out.stride(1))

    def _launch_mixed(self, q, kv_cache, out, meta, st: TritonState, scale) -> None:
        dec, pre = st.decode, st.prefill
        fp8 = kv_cache.element_size() == 1
        pre_tile, warps, pre_stages, _ = self._shape(pre, st, fp8, kv_cache.is_cuda)
        # on the prefill tiles' warps, decode tiles of either cache take the 16-bit decode's shape (an fp8 V by asm)
        dec_tile, _, dec_stages, _ = self._shape(dec, st, False, kv_cache.is_cuda)
        v_asm = fp8 and self.FP8_V_ASM and kv_cache.is_cuda
        num_decode = dec.tile_seq.shape[0]
        _mixed_attention[(num_decode + pre.tile_seq.shape[0], self.num_kv_heads)](
            q, kv_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, dec.tile_seq, dec.tile_qoff,
            pre.tile_seq, pre.tile_qoff, num_decode, scale, *self._strides(q, kv_cache, meta, out),
            G=self.G, HEAD_DIM=self.head_dim, PAGE=kv_cache.shape[2], FP16_DOTS=fp8,
            DEC_BLOCK_M=dec.block_m, DEC_TILE=dec_tile, DEC_STAGES=dec_stages, DEC_V_ASM=v_asm,
            PRE_BLOCK_Q=pre.block_q, PRE_BLOCK_M=pre.block_m, PRE_TILE=pre_tile, PRE_STAGES=pre_stages,
            num_warps=warps, num_stages=max(dec_stages, pre_stages),
        )

    def _launch(self, q, kv_cache, out, meta, st, launch: _Launch, scale):
        cuda = self._cuda_for(q, kv_cache, launch, st)
        if cuda is not None:
            cuda(q, kv_cache, out, meta, launch.tile_seq, scale)
            return
        segs = launch.num_segments
        grid = (launch.tile_seq.shape[0], self.num_kv_heads, segs)
        split = segs > 1  # without segments the kernel writes `out` and never touches the partials
        fp8 = kv_cache.element_size() == 1
        tile, warps, stages, v_asm = self._shape(launch, st, fp8, kv_cache.is_cuda)
        _paged_attention[grid](
            q, kv_cache, out, st.part_acc if split else out, st.part_ml if split else out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, launch.tile_seq, launch.tile_qoff,
            scale, *self._strides(q, kv_cache, meta, out),
            G=self.G, BLOCK_Q=launch.block_q, BLOCK_M=launch.block_m, HEAD_DIM=self.head_dim,
            TILE=tile, PAGE=kv_cache.shape[2], NUM_SEGMENTS=segs, FP16_DOTS=fp8,
            V_CVT_ASM=v_asm, STAGES=stages,
            num_warps=warps, num_stages=stages,
        )
        if split:
            _merge_segments[(launch.tile_seq.shape[0], self.num_kv_heads)](
                st.part_acc, st.part_ml, out, launch.tile_seq, meta.query_start_loc, out.stride(0), out.stride(1),
                G=self.G, G_POW2=self.g_pow2, HEAD_DIM=self.head_dim, NUM_SEGMENTS=segs)
