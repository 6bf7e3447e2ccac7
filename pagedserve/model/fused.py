"""Fused Triton kernels for the small ops around the GEMMs, used on CUDA.

A decode step of an 8B model is ~36 x 60 tiny kernels when RMSNorm, rotary, the q/k norms, the K/V
writes and SiLU-mul run as separate torch ops; inside a CUDA graph each still costs microseconds, which
is as much as the weights take to read. These kernels do each group in one pass:

- ``rms_norm``: (x + residual) -> RMSNorm, also returning the new residual;
- ``qkv_rope_store``: split the fused qkv projection, q/k RMSNorm (Qwen3), rotary, store K and V into
  their cache slots, return the rotated queries;
- ``silu_mul``: silu(gate) * up.

The torch versions in ``layers.py`` / ``decoder.py`` are the reference; tests/test_fused.py checks these
against them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

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
def _qkv_rope_store(QKV, Pos, Cos, Sin, QW, KW, Slots, KV, QOut,
                    stride_t, stride_cos, stride_kvkv, stride_slot, stride_kvh, stride_qt, stride_qh, eps,
                    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..NUM_Q-1: a query head; NUM_Q..: a key head and its value head
    half = tl.arange(0, HEAD_DIM // 2)
    pos = tl.load(Pos + t)
    cos = tl.load(Cos + pos * stride_cos + half)
    sin = tl.load(Sin + pos * stride_cos + half)
    is_q = h < NUM_Q
    col = tl.where(is_q, h * HEAD_DIM, NUM_Q * HEAD_DIM + (h - NUM_Q) * HEAD_DIM)
    x1 = tl.load(QKV + t * stride_t + col + half)
    x2 = tl.load(QKV + t * stride_t + col + HEAD_DIM // 2 + half)
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / HEAD_DIM + eps)
        wq = tl.where(is_q, 1.0, 0.0)
        w1 = (tl.load(QW + half) * wq + tl.load(KW + half) * (1.0 - wq)).to(dtype)
        w2 = (tl.load(QW + HEAD_DIM // 2 + half) * wq + tl.load(KW + HEAD_DIM // 2 + half) * (1.0 - wq)).to(dtype)
        f1 = ((f1 * inv).to(dtype) * w1).to(tl.float32)
        f2 = ((f2 * inv).to(dtype) * w2).to(tl.float32)
    o1 = f1 * cos - f2 * sin
    o2 = f2 * cos + f1 * sin
    if is_q:
        base = QOut + t * stride_qt + h * stride_qh
        tl.store(base + half, o1.to(dtype))
        tl.store(base + HEAD_DIM // 2 + half, o2.to(dtype))
    else:
        kvh = h - NUM_Q
        slot = tl.load(Slots + t)
        kbase = KV + slot * stride_slot + kvh * stride_kvh
        tl.store(kbase + half, o1.to(KV.dtype.element_ty))
        tl.store(kbase + HEAD_DIM // 2 + half, o2.to(KV.dtype.element_ty))
        vcol = (NUM_Q + NUM_KV) * HEAD_DIM + kvh * HEAD_DIM
        d = tl.arange(0, HEAD_DIM)
        v = tl.load(QKV + t * stride_t + vcol + d)
        tl.store(KV + stride_kvkv + slot * stride_slot + kvh * stride_kvh + d, v.to(KV.dtype.element_ty))


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """Returns the queries [T, Hq, D]; K and V go straight into ``kv_cache`` ([2, blocks, page, Hkv, D])."""
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    dummy = cos
    _qkv_rope_store[(T, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        slot_mapping, flat, q, qkv.stride(0), cos.stride(0), flat.stride(0), flat.stride(1), flat.stride(2),
        q.stride(0), q.stride(1), eps, NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim,
        QK_NORM=q_norm is not None)
    return q
