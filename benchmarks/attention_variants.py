"""A frozen experiment: the decode attention kernel as it was at 62bb6a2, with switches for the
variants docs/benchmarks.md reports (alignment hints on the K/V offsets, CUDA-core dots without the
16-row tensor-core padding), over warps and tile sizes, on the Qwen3-8B decode shape.

python benchmarks/attention_variants.py

Kept so the recorded sweep can be re-run; the engine's kernel is pagedserve/model/triton_attention.py
(it took the one winner, 2 warps for fp8 decode). Needs a GPU.
"""
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_triton_attention import make_batch  # noqa: E402
from pagedserve.model.triton_attention import TritonAttentionBackend  # noqa: E402


@triton.jit
def _variant(
    Q, KV, Out, PartAcc, PartML,
    block_tables, seq_lens, query_start, tile_seq, tile_qoff,
    scale,
    stride_qt, stride_qh, stride_kvkv, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FP16_DOTS: tl.constexpr, HINT: tl.constexpr, ELEMWISE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
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
    if FP16_DOTS:  # an fp8 cache: e4m3 -> fp16 is one instruction per two values (-> bf16 is several)
        q = q.to(tl.float16)
    qpos = ctx + tok

    kv_end = tl.minimum(seq_len, ctx + q_off + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE)
    per_seg = tl.cdiv(num_tiles, NUM_SEGMENTS)
    first = seg * per_seg
    last = tl.minimum(num_tiles, first + per_seg)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    K = KV
    V = KV + stride_kvkv
    for j in range(first, last):
        kpos = j * TILE + tl.arange(0, TILE)
        kmask = kpos < kv_end
        blk = tl.load(block_tables + seq * stride_bt + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        off = blk * stride_kvb + (kpos % PAGE) * stride_kvs + kvh * stride_kvh
        if HINT:
            off = tl.multiple_of(off, 16)
        k = tl.load(K + off[:, None] + d[None, :], mask=kmask[:, None], other=0.0).to(q.dtype)
        if ELEMWISE:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        allowed = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=kmask[:, None], other=0.0).to(q.dtype)
        if ELEMWISE:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new

    out_row = q_start + tok
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(s_sum == 0.0, 1.0, s_sum)[:, None]
        tl.store(Out + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_valid[:, None])
    else:
        # partials indexed [decode tile, q head, segment, ...]; num q heads = G * num kv heads
        hq = G * tl.num_programs(1)
        base = (tile * hq + head) * NUM_SEGMENTS + seg
        tl.store(PartAcc + base[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
        tl.store(PartML + base * 2, m, mask=row_valid)
        tl.store(PartML + base * 2 + 1, s_sum, mask=row_valid)



def run(name, heads, kvh, batch, ctx, kv_dtype, hint, elem, warps, tile, block_m=None):
    dev = torch.device("cuda"); bs, d = 16, 128
    rng = np.random.default_rng(0)
    nb = batch * (-(-(ctx + 1) // bs)) + 4
    cache = torch.randn((2, nb, bs, kvh, d), device=dev, dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn((batch, heads, d), device=dev, dtype=torch.bfloat16)
    be = TritonAttentionBackend(heads, kvh, d, 132)
    meta, _ = make_batch(rng, [1] * batch, [ctx] * batch, bs, nb)
    be.prepare(meta, bs)
    st = meta.backend_state; L = st.decode; segs = L.num_segments
    G = heads // kvh
    bm = block_m or L.block_m
    out = torch.empty_like(q)
    def f():
        _variant[(L.tile_seq.shape[0], kvh, segs)](q, cache, out, st.part_acc if segs > 1 else out, st.part_ml if segs > 1 else out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, L.tile_seq, L.tile_qoff, d ** -0.5,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            meta.block_tables.stride(0), out.stride(0), out.stride(1), G=G, BLOCK_Q=1, BLOCK_M=bm, HEAD_DIM=d,
            TILE=tile, PAGE=bs, NUM_SEGMENTS=segs, FP16_DOTS=cache.element_size() == 1, HINT=hint, ELEMWISE=elem,
            num_warps=warps, num_stages=3)
    f(); torch.cuda.synchronize()
    ref = be.attend(q, cache, meta, d ** -0.5) if segs == 1 else None
    err = float((out.float() - ref.float()).norm() / ref.float().norm()) if ref is not None else -1
    ms = triton.testing.do_bench(f, rep=100)
    nbytes = batch * (ctx + 1) * kvh * d * 2 * cache.element_size()
    print(f"{name} {str(kv_dtype)[6:]:14s} hint={hint} elem={elem} warps={warps} tile={tile} bm={bm}: {ms*1000:7.1f} us {nbytes/ms/1e6:6.0f} GB/s err {err:.1e}", flush=True)

if __name__ == "__main__":
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        for hint, elem, warps, tile, bm in [(0,0,4,64,None),(1,0,4,64,None),(1,0,4,128,None),(0,0,8,128,None),(1,0,8,128,None),(1,0,2,64,None),(1,1,4,32,4),(1,1,4,64,4),(1,1,8,64,4)]:
            try:
                run("8B 256x1536", 32, 8, 256, 1536, kv, hint, elem, warps, tile, bm)
            except Exception as e:
                print("fail", hint, elem, warps, tile, type(e).__name__, str(e)[:200], flush=True)
