"""bf16 projections of 3-16 rows (decode steps of a few sequences, short prompt steps) on the tensor cores.

Such a projection reads each weight once whatever its rows, so its cost is the rate its weights stream at.
cuBLAS's kernels for these shapes read an 8B model's weights at ~2.2-3.0 TB/s on an H100; this Triton kernel
pads x to 16 rows and walks each tile of weight rows along the reduction with one tensor-core dot a step, its
loads pipelined through shared memory by Triton, and reads them ~5 % faster over a decode step's projections
(``python -m benchmarks.kernels.gemv --dot``). With ``gated``, the weight is gate_up_proj's [gate; up] and a
program's tile holds matching rows of both halves, so it writes silu(gate) * up from its accumulators and down_proj
needs no silu-mul kernel before it (formed instead as down_proj reads x, inside this loop, it made the kernel several
times slower). The torch reference is ``F.linear`` (then ``silu(gate) * up``, each rounded as the unfused kernels
round); tests/test_cuda_gemv.py checks the kernel against it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x one dot takes


@dataclass(frozen=True)
class Tile:
    """A program's weight rows and reduction step; ``w_first``: W is the dot's left operand ([rows, k] x [k, 16]),
    which Hopper's warpgroup MMA takes from 64 rows up, rather than x."""
    rows: int
    k: int
    w_first: bool = False
    stages: int = 4
    warps: int = 4


# The tiles measured fastest on an H100 (Qwen3-8B's shapes, 4-16 rows): 64 rows on the warpgroup MMA where such
# tiles are ~100 or more, else 32 rows with a longer step (o_proj, down_proj: 128 programs).
WIDE, NARROW = Tile(64, 128, w_first=True), Tile(32, 256)
MIN_ROWS = 128 * NARROW.rows  # fewer weight rows leave multiprocessors idle: those shapes stay on cuBLAS


def tile_for(n: int, k: int) -> Tile | None:
    """The tile for an n x k weight, or None where this kernel does not take it."""
    if n < MIN_ROWS or k % NARROW.k:
        return None
    return WIDE if n >= 96 * WIDE.rows else NARROW


@triton.jit(do_not_specialize=["M"])
def _mma_gemv(X, W, Out, M, N, K, stride_xm, stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              W_FIRST: tl.constexpr, GATED: tl.constexpr):
    """Program n: Out[:M, columns of tile n] = x @ W[rows].T, x padded to 16 rows with zeros. K is a multiple of
    BLOCK_K (``tile_for``). GATED: W is [gate; up] (N rows, N / 2 each), the tile's rows are BLOCK_N / 2 of gate
    and the matching ones of up, and Out's columns are silu(gate) * up."""
    pid = tl.program_id(0)
    if GATED:
        half: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        cols = pid * half + tl.arange(0, half)
        rows = pid * half + r % half + (r // half) * (N // 2)
        valid = pid * half + r % half < N // 2
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = cols
        valid = rows < N
    ms = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    x_ptr = X + ms[:, None] * stride_xm + ks[None, :]
    w_ptr = W + rows[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros([BLOCK_N, 16] if W_FIRST else [16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0, mask=(ms < M)[:, None], other=0.0)
        w = tl.load(w_ptr + k0, mask=valid[:, None], other=0.0)
        if W_FIRST:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    y = (tl.trans(acc) if W_FIRST else acc).to(Out.dtype.element_ty)  # [16, BLOCK_N], rounded as F.linear's
    if GATED:  # as fused.silu_mul over that output: silu(gate) rounded, times up
        gate, up = tl.split(tl.permute(tl.reshape(y, [16, 2, half]), (0, 2, 1)))
        g = gate.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty) * up
    tl.store(Out + ms[:, None] * stride_om + cols[None, :], y,
             mask=(ms < M)[:, None] & (cols < (N // 2 if GATED else N))[None, :])


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Up to 16 contiguous rows of x against a contiguous weight of a shape ``tile_for`` takes."""
    n, k = weight.shape
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] == k
            and x.is_contiguous() and weight.is_contiguous() and x.dtype == weight.dtype
            and tile_for(n, k) is not None)


def mma_gemv(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None, gated: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` where ``takes`` holds; ``gated``: weight is [gate; up] and the result silu(gate) *
    up (half the columns); ``tile`` overrides ``tile_for``'s choice (the benchmark's sweep)."""
    n, k = weight.shape
    tile = tile or tile_for(n, k)
    cols = n // 2 if gated else n
    out = torch.empty((x.shape[0], cols), dtype=x.dtype, device=x.device)
    _mma_gemv[(triton.cdiv(cols, tile.rows // 2 if gated else tile.rows),)](
        x, weight, out, x.shape[0], n, k, x.stride(0), out.stride(0), BLOCK_N=tile.rows, BLOCK_K=tile.k,
        W_FIRST=tile.w_first, GATED=gated, num_warps=tile.warps, num_stages=tile.stages)
    return out
