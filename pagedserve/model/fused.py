"""Fused Triton kernels for the small ops around the GEMMs, used on CUDA.

A decode step of an 8B model is ~36 x 60 tiny kernels when RMSNorm, rotary, the q/k norms, the K/V
writes and SiLU-mul run as separate torch ops; inside a CUDA graph each still costs microseconds, which
is as much as the weights take to read. These kernels do each group in one pass:

- ``rms_norm``: (x + residual) -> RMSNorm, also returning the new residual;
- ``qkv_rope_store``: split the fused qkv projection, q/k RMSNorm (Qwen3), rotary, store K and V into
  their cache slots, return the rotated queries;
- ``silu_mul``: silu(gate) * up;
- ``gumbel_argmax``: sample every row of the logits in one read of them (Gumbel-max with counter-based
  noise), instead of the half-dozen full-vocabulary passes of softmax, exponential draws and division.

The torch versions in ``layers.py`` / ``decoder.py`` / ``sampler.py`` are the reference; tests/test_fused.py checks these
against them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, N, eps,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype) * w
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    r_out = torch.empty_like(x2) if residual is not None else out
    r = residual.reshape(-1, n) if residual is not None else x2
    _rms_norm[(x2.shape[0],)](x2, r, weight, out, r_out, x2.stride(0), r.stride(0), out.stride(0), r_out.stride(0),
                              n, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    out = out.view(x.shape)
    return out if residual is None else (out, r_out.view(x.shape))


@triton.jit
def _silu_mul(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
    y = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


@triton.jit
def norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows of head halves [H, D/2]: optional RMSNorm over the head (rounded like the torch path), then
    neox rotary; returns the rotated halves in float32."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)
        f1 = ((f1 * inv[:, None]).to(dtype) * w1[None, :]).to(tl.float32)
        f2 = ((f2 * inv[:, None]).to(dtype) * w2[None, :]).to(tl.float32)
    return f1 * cos[None, :] - f2 * sin[None, :], f2 * cos[None, :] + f1 * sin[None, :]


@triton.jit
def _qkv_rope_store(QKV, Pos, Cos, Sin, QW, KW, Slots, KV, QOut,
                    stride_t, stride_cos, stride_kvkv, stride_slot, stride_kvh, stride_qt, stride_qh, eps,
                    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, Q_POW2: tl.constexpr, KV_POW2: tl.constexpr,
                    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """One program per token: all its query heads, key heads and value heads."""
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    pos = tl.load(Pos + t)
    cos = tl.load(Cos + pos * stride_cos + half)
    sin = tl.load(Sin + pos * stride_cos + half)
    row = QKV + t * stride_t
    dtype = QOut.dtype.element_ty

    hq = tl.arange(0, Q_POW2)
    mq = (hq < NUM_Q)[:, None]
    q1 = tl.load(row + hq[:, None] * HEAD_DIM + half[None, :], mask=mq, other=0.0)
    q2 = tl.load(row + hq[:, None] * HEAD_DIM + HALF + half[None, :], mask=mq, other=0.0)
    if QK_NORM:
        qw1 = tl.load(QW + half).to(dtype)
        qw2 = tl.load(QW + HALF + half).to(dtype)
        kw1 = tl.load(KW + half).to(dtype)
        kw2 = tl.load(KW + HALF + half).to(dtype)
    else:  # unused by norm_rope without the norm
        qw1 = cos
        qw2 = cos
        kw1 = cos
        kw2 = cos
    o1, o2 = norm_rope(q1, q2, qw1, qw2, cos, sin, eps, HEAD_DIM, QK_NORM)
    qbase = QOut + t * stride_qt + hq[:, None] * stride_qh
    tl.store(qbase + half[None, :], o1.to(dtype), mask=mq)
    tl.store(qbase + HALF + half[None, :], o2.to(dtype), mask=mq)

    hk = tl.arange(0, KV_POW2)
    mk = (hk < NUM_KV)[:, None]
    kcol = row + NUM_Q * HEAD_DIM + hk[:, None] * HEAD_DIM
    k1 = tl.load(kcol + half[None, :], mask=mk, other=0.0)
    k2 = tl.load(kcol + HALF + half[None, :], mask=mk, other=0.0)
    o1, o2 = norm_rope(k1, k2, kw1, kw2, cos, sin, eps, HEAD_DIM, QK_NORM)
    slot = tl.load(Slots + t).to(tl.int64)
    kbase = KV + slot * stride_slot + hk[:, None] * stride_kvh
    tl.store(kbase + half[None, :], o1.to(KV.dtype.element_ty), mask=mk)
    tl.store(kbase + HALF + half[None, :], o2.to(KV.dtype.element_ty), mask=mk)
    d = tl.arange(0, HEAD_DIM)
    v = tl.load(row + (NUM_Q + NUM_KV) * HEAD_DIM + hk[:, None] * HEAD_DIM + d[None, :], mask=mk, other=0.0)
    tl.store(kbase + stride_kvkv + d[None, :], v.to(KV.dtype.element_ty), mask=mk)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """Returns the queries [T, Hq, D]; K and V go straight into ``kv_cache`` ([2, blocks, page, Hkv, D])."""
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    dummy = cos
    _qkv_rope_store[(T,)](
        qkv, positions, cos, sin, q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        slot_mapping, flat, q, qkv.stride(0), cos.stride(0), flat.stride(0), flat.stride(1), flat.stride(2),
        q.stride(0), q.stride(1), eps, NUM_Q=num_heads, NUM_KV=num_kv_heads,
        Q_POW2=triton.next_power_of_2(num_heads), KV_POW2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, QK_NORM=q_norm is not None)
    return q


@triton.jit
def _gumbel_argmax(Logits, stride, InvT, Seeds, Noisy, PartVal, PartIdx, V, per_split,
                   BLOCK: tl.constexpr, ASM_LOG: tl.constexpr):
    """Program (row, split): the best of ``logits * inv_t + gumbel`` over one slice of the vocabulary,
    in base 2 (argmax(log2(e) * (x + g)) is the same token, and -log2(-log2 u) is log2(e) * g up to a
    constant). The noise is the row's hash of the column alone, so it does not depend on the split: one
    Philox call gives four uniforms, for columns a quarter tile apart. Philox and the two logs are the
    whole cost (the logits are read once), hence rand4x and lg2.approx (ASM_LOG: on the GPU; tl.log2 is
    libdevice's exact log2f, ~20 instructions and branches), not rand and the exact log."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    Q: tl.constexpr = BLOCK // 4
    scale = tl.load(InvT + row) * 1.4426950408889634
    seed = tl.load(Seeds + row)
    noisy = tl.load(Noisy + row) != 0
    x_row = Logits + row * stride
    best = tl.full([Q], float("-inf"), tl.float32)
    best_i = tl.zeros([Q], tl.int32)
    lo = split * per_split
    hi = tl.minimum(V, lo + per_split)
    lanes = tl.arange(0, Q)
    for start in range(lo, hi, BLOCK):  # start is a multiple of BLOCK: counters start/4 + lane are its own
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
        best, best_i = _noisy_best(x_row, start + lanes, hi, scale, noisy, u0, best, best_i, ASM_LOG)
        best, best_i = _noisy_best(x_row, start + Q + lanes, hi, scale, noisy, u1, best, best_i, ASM_LOG)
        best, best_i = _noisy_best(x_row, start + 2 * Q + lanes, hi, scale, noisy, u2, best, best_i, ASM_LOG)
        best, best_i = _noisy_best(x_row, start + 3 * Q + lanes, hi, scale, noisy, u3, best, best_i, ASM_LOG)
    m = tl.max(best, 0)
    tl.store(PartVal + row * tl.num_programs(1) + split, m)
    tl.store(PartIdx + row * tl.num_programs(1) + split, tl.min(tl.where(best == m, best_i, V), 0))


@triton.jit
def _noisy_best(x_row, cols, hi, scale, noisy, u, best, best_i, ASM_LOG: tl.constexpr):
    """Fold columns ``cols`` into each lane's running best. A lane sees its columns in increasing order
    and only a strictly larger value replaces its best: the first of equal values wins, as in torch.argmax.
    u = 0 gives -inf (never chosen); -log2(u) > 0 otherwise."""
    x = tl.load(x_row + cols, mask=cols < hi, other=float("-inf")).to(tl.float32) * scale
    x = tl.where(noisy, x - _log2(-_log2(u, ASM_LOG), ASM_LOG), x)
    better = x > best
    return tl.where(better, x, best), tl.where(better, cols, best_i)


@triton.jit
def _log2(x, ASM: tl.constexpr):
    """log2, as one MUFU instruction where ASM (relative error ~2^-22, far below what a sample can show;
    the interpreter has no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once (132, an H200's, elsewhere: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def gumbel_argmax(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                  noisy: torch.Tensor, num_sms: int | None = None) -> torch.Tensor:
    """Per row: argmax(logits * inv_temperature + Gumbel noise keyed by the row's seed), or the plain
    argmax where ``noisy`` is false. Splits the vocabulary so that even one row fills the GPU
    (``num_sms``: the device's, unless given)."""
    n, v = logits.shape
    num_sms = num_sms or sm_count(logits.device)
    block = 1024
    splits = max(1, min(triton.cdiv(v, 8 * block), triton.cdiv(2 * num_sms, n)))
    per_split = triton.cdiv(triton.cdiv(v, splits), block) * block
    splits = triton.cdiv(v, per_split)
    part_val = torch.empty((n, splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((n, splits), dtype=torch.int32, device=logits.device)
    _gumbel_argmax[(n, splits)](logits, logits.stride(0), inv_temperature, seeds, noisy, part_val, part_idx,
                                v, per_split, BLOCK=block, ASM_LOG=logits.is_cuda)
    # the first split holding the row's maximum: the smallest index among equal maxima, like torch.argmax
    return part_idx.gather(1, part_val.argmax(1, keepdim=True)).squeeze(1).long()
