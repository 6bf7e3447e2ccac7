"""Skinny GEMMs for decode at small batch: ``y = x @ W.T`` with a handful of rows in ``x``.

At batch 1 a decode step of an 8B model is the weights read once; cuBLAS picks a general GEMM for
M = 1 that reaches ~92 % of the copy bandwidth and leaves a ramp and a tail per call (144 calls a step).
This kernel streams W in [BLOCK_N, BLOCK_K] tiles, multiplies them by the few rows of x on the CUDA
cores, and reduces in float32 once at the end. With ``silu_mul`` the input is the merged gate/up
projection and ``silu(gate) * up`` is formed as it is read (rounded as ``fused.silu_mul`` rounds it),
which saves the MLP's separate activation kernel.

Tested against ``torch.nn.functional.linear`` under TRITON_INTERPRET=1 (tests/test_fused.py) and
measured against cuBLAS on the GPU (benchmarks/gemv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _row_products(w, x_ptr, mmask, K, SILU_MUL: tl.constexpr):
    """[BLOCK_M, BLOCK_N, BLOCK_K] products of one W tile with the matching columns of every x row."""
    x = tl.load(x_ptr, mask=mmask[:, None], other=0.0)
    if SILU_MUL:  # x is the gate; the up half sits K columns to its right
        up = tl.load(x_ptr + K, mask=mmask[:, None], other=0.0)
        gate = x.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
        x = (silu * up.to(tl.float32)).to(up.dtype)  # each product rounded as torch rounds it
    return w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]


@triton.jit
def _gemv(X, W, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
          SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    """Program n: rows [n * BLOCK_N, (n + 1) * BLOCK_N) of W against all M (<= BLOCK_M) rows of x.
    K is a multiple of BLOCK_K (the caller checks), so the W loads carry no mask along K.

    With PDL (programmatic dependent launch) the programs are placed on the SMs while the kernel before
    is still finishing, so the launch and ramp of each of a step's ~145 projections overlap the tail of
    the one before."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    ms = tl.arange(0, BLOCK_M)
    mmask = ms < M
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    w_ptr = W + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    x_ptr = X + ms[:, None] * stride_xm + ks[None, :]
    if PDL:  # let the next kernel's programs start, then wait for the previous kernel's x
        gdc_launch_dependents()
        gdc_wait()
    for _ in range(0, K, BLOCK_K):  # a plain loop: Triton pipelines its loads (an unrolled prefetch was slower)
        w = tl.load(w_ptr, mask=rmask[:, None], other=0.0)
        acc += _row_products(w, x_ptr, mmask, K, SILU_MUL)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + ms[:, None] * stride_om + rows[None, :], y.to(Out.dtype.element_ty),
             mask=mmask[:, None] & rmask[None, :])


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


MAX_M = 1  # from 2 rows on, cuBLAS's tensor-core GEMMs win (benchmarks/gemv.py)
USE_PDL = True  # launch with programmatic dependent launch on the GPU (Hopper and later)
DEFAULT = GemvConfig()


def supports(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig = DEFAULT) -> bool:
    """A CUDA batch of at most MAX_M rows whose reduction length the tile divides."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_M and x.stride(-1) == 1
            and weight.shape[1] % config.block_k == 0)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: GemvConfig = DEFAULT) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` of at most ``MAX_M`` rows (see ``supports``); with
    ``silu_mul``, ``F.linear(silu(gate) * up, weight)`` where ``x`` is ``[gate | up]``."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if silu_mul else k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(1, triton.next_power_of_2(m))
    pdl = USE_PDL and x.is_cuda
    _gemv[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if pdl else {}))
    return out
