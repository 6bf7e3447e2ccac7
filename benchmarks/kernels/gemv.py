"""Skinny GEMMs at decode batch size 1: a Triton GEMV against cuBLAS (F.linear) on the projection
shapes of Qwen3-8B, alone (a sweep of tile shapes) and as a whole step's worth of weights replayed in a
CUDA graph (where ramps, tails and gaps between kernels count).

The GEMV streams W in [BLOCK_N, BLOCK_K] tiles and multiplies them by the rows of x on the CUDA cores;
optionally with programmatic dependent launch, and with silu(gate) * up formed as x is read. It was
tried in the model (commit eadc0a0) and taken out: 1.7 % faster than cuBLAS here, but the bs=1 ITL of
Qwen3-8B was 5.09 ms with it against 5.03 ms without (docs/lab-notes.md). Kept here as the measured
alternative to re-run on a newer Triton or GPU.

python -m benchmarks.kernels.gemv [--quick] [--no-sweep]
python -m benchmarks.kernels.gemv --cuda [--rows 1,2,4,8,16]   # the model's CUDA GEMV (model/gemv.cu) against
    cuBLAS instead, at each row count of x (the engine's GEMV takes 1 and 2; more rows run here all the same)
python -m benchmarks.kernels.gemv --dot --rows 4,8,16   # the engine's tensor-core kernel for 3-16 rows
    (model/mma_gemv.py) against cuBLAS at each row count: each tile shape, and a step's worth
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.args import positives, run_main
from benchmarks.kernels.harness import graph_ms, kernel_ms, per_call_us
from pagedserve.model.mma_gemv import Tile, mma_gemv, tile_for



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


USE_PDL = False  # set per run by main()
DEFAULT = GemvConfig()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: GemvConfig = DEFAULT) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` of a few rows whose length BLOCK_K divides; with
    ``silu_mul``, ``F.linear(silu(gate) * up, weight)`` where ``x`` is ``[gate | up]``."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if silu_mul else k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(1, triton.next_power_of_2(m))
    pdl = USE_PDL
    _gemv[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if pdl else {}))
    return out


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
LAYERS = 36


def dot_tiles() -> list[Tile]:
    """The tensor-core tiles compared at 3-16 rows of x (the engine's two among them)."""
    narrow = [Tile(rows, k, stages=st) for rows in (16, 32) for k in (128, 256) for st in (3, 4)]
    wide = [Tile(rows, k, True, st) for rows in (64, 128) for k in (64, 128) for st in (3, 4)]
    return narrow + wide


def configs(quick: bool):
    elem = [("elem", GemvConfig(bn, bk, w, s)) for bn in (4, 8, 16) for bk in (256, 512, 1024)
            for w in (4, 8) for s in (2, 3)]
    dot = [("dot", Tile(rows, k, stages=st)) for rows in (16, 32, 64) for k in (128, 256) for st in (3, 4, 6)]
    if quick:
        return [("elem", DEFAULT)]
    return elem + dot


def run(kind, x, w, cfg):
    return gemv(x, w, config=cfg) if kind == "elem" else mma_gemv(x, w, tile=cfg)


def sweep(quick: bool) -> dict[str, tuple[str, GemvConfig | Tile]]:
    dev = torch.device("cuda")
    best = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn((1, k), device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        nbytes = w.numel() * 2
        t_cublas = kernel_ms(lambda: F.linear(x, w))
        rows = []
        for kind, cfg in configs(quick):
            if k % (cfg.block_k if kind == "elem" else cfg.k):
                continue
            y = run(kind, x, w, cfg)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = kernel_ms(lambda kind=kind, cfg=cfg: run(kind, x, w, cfg))
            rows.append((t, kind, cfg, err))
        rows.sort(key=lambda r: r[0])
        print(f"\n== {name} [{n} x {k}], {nbytes / 1e6:.0f} MB, M=1: cuBLAS {t_cublas * 1e3:.1f} us "
              f"({nbytes / t_cublas / 1e9:.2f} TB/s)")
        for t, kind, cfg, err in rows[:5] + rows[-1:]:
            print(f"  {kind:4s} {cfg}: {t * 1e3:7.1f} us, {nbytes / t / 1e9:.2f} TB/s, max rel err {err:.1e}")
        best[name] = (rows[0][1], rows[0][2])
    return best


def step_weights():
    """A decode step's projection weights: 36 layers x [qkv, o, gate_up, down] + lm_head, all distinct."""
    dev = torch.device("cuda")
    layers = [[torch.empty(SHAPES[s], device=dev, dtype=torch.bfloat16).normal_(0, 0.02)
               for s in ("qkv", "o", "gate_up", "down")] for _ in range(LAYERS)]
    return layers, torch.empty(SHAPES["lm_head"], device=dev, dtype=torch.bfloat16).normal_(0, 0.02)


def step_graph(m: int, fn, weights, head) -> tuple[float, int]:
    """The step's projections in a CUDA graph: milliseconds per replay, and the weight bytes read."""
    dev = torch.device("cuda")
    x = torch.randn((m, 4096), device=dev, dtype=torch.bfloat16)
    xi = torch.randn((m, 12288), device=dev, dtype=torch.bfloat16)

    def step():
        for qkv, o, gu, down in weights:
            fn("qkv", x, qkv)
            fn("o", x, o)
            fn("gate_up", x, gu)
            fn("down", xi, down)
        return fn("lm_head", x, head)

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    ms = graph_ms(g.replay)
    nbytes = sum(t.numel() * 2 for ws in weights for t in ws) + head.numel() * 2
    return ms, nbytes


def label(g, m: int = 1) -> str:
    if m > 1:
        return f"{g.ROW_WARPS}w/u{g.ROW_UNROLL}"
    return f"{g.warps}w/u{g.unroll}{'' if g.pdl else ' no PDL'}"


def cuda_variants(dev: torch.device, m: int) -> list:
    """The CTA shapes compared at m rows: at one row the engine's (32 warps x 4 loads) first, the same with plain
    launches, and others; above one row the engine's first and others, each taking m rows whether or not the
    engine's GEMV does."""
    from pagedserve.model.cuda_gemv import CudaGemv

    if m == 1:
        variants = [CudaGemv(dev, warps, unroll) for warps, unroll in ((32, 4), (32, 4), (16, 8), (32, 2), (24, 4))]
        variants[1].pdl = False
        return variants
    variants = []
    for warps, unroll in ((CudaGemv.ROW_WARPS, CudaGemv.ROW_UNROLL), (16, 8), (24, 4), (16, 4)):
        g = CudaGemv(dev)
        g.ROW_WARPS, g.ROW_UNROLL, g.ROWS = warps, unroll, (1, m)
        variants.append(g)
    return variants


def cuda_report(row_counts: list[int]) -> None:
    """pagedserve's CUDA GEMV (model/gemv.cu) against cuBLAS at each row count, each shape on distinct weights
    back to back in a graph (what a decode step sees: no weight is in L2), then a whole step's projections."""
    from pagedserve.model import fused

    dev = torch.device("cuda")
    weights, head = step_weights()
    for m in row_counts:
        print(f"\n== {m} row{'s' if m > 1 else ''} of x")
        variants = cuda_variants(dev, m)
        for name, (n, k) in SHAPES.items():
            count = 4 if name == "lm_head" else LAYERS
            ws = [torch.empty((n, k), device=dev, dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(count)]
            silu = name == "down"
            x = torch.randn((m, 2 * k if silu else k), device=dev, dtype=torch.bfloat16)
            xin = fused.silu_mul(x) if silu else x
            ref = F.linear(xin.float(), ws[0].float())
            nbytes = n * k * 2
            t = per_call_us(lambda i: F.linear(fused.silu_mul(x) if silu else x, ws[i]), count)
            line = [f"{name} [{n} x {k}]: cuBLAS{' + silu_mul' if silu else ''} {t:6.2f} us "
                    f"({nbytes / t / 1e6:.2f} TB/s)"]
            for g in variants:
                if not g.takes(x, ws[0], silu_mul=silu):
                    continue
                err = ((g(x, ws[0], silu_mul=silu).float() - ref).abs().max() / ref.abs().max()).item()
                t = per_call_us(lambda i: g(x, ws[i], silu_mul=silu), count)
                line.append(f"{label(g, m)} {t:6.2f} us ({nbytes / t / 1e6:.2f} TB/s, err {err:.1e})")
            print(" | ".join(line))
        ms, nbytes = step_graph(m, lambda name, x, w: F.linear(x, w), weights, head)
        print(f"step's projections at {m} rows, cuBLAS: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
        for g in variants:  # shapes a variant does not take (x too large for shared memory) on cuBLAS
            ms, nbytes = step_graph(m, lambda name, x, w: g(x, w) if g.takes(x, w) else F.linear(x, w), weights, head)
            print(f"step's projections at {m} rows, CUDA GEMV {label(g, m)}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")


def dot_report(row_counts: list[int]) -> None:
    """The engine's tensor-core kernel for 3-16 rows (model/mma_gemv.py) against cuBLAS at each row count: every
    tile on each projection (distinct weights back to back in a graph), then a whole step's projections with the
    engine's tile for each shape and with each shape's fastest."""
    dev = torch.device("cuda")
    weights, head = step_weights()
    for m in row_counts:
        print(f"\n== {m} rows of x, tensor cores")
        best: dict[str, Tile] = {}
        for name, (n, k) in SHAPES.items():
            count = 4 if name == "lm_head" else LAYERS
            ws = [torch.empty((n, k), device=dev, dtype=torch.bfloat16).normal_(0, 0.02) for _ in range(count)]
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            nbytes = n * k * 2
            t_cublas = per_call_us(lambda i: F.linear(x, ws[i]), count)
            rows = []
            for tile in dot_tiles():
                if k % tile.k:
                    continue
                err = ((mma_gemv(x, ws[0], tile=tile).float() - ref).abs().max() / ref.abs().max()).item()
                rows.append((per_call_us(lambda i, tile=tile: mma_gemv(x, ws[i], tile=tile), count), tile, err))
            rows.sort(key=lambda r: r[0])
            best[name] = rows[0][1]
            print(f"{name} [{n} x {k}]: cuBLAS {t_cublas:6.2f} us ({nbytes / t_cublas / 1e6:.2f} TB/s); "
                  f"the engine's tile {tile_for(n, k)}")
            for t, tile, err in rows:
                print(f"  {tile}: {t:6.2f} us ({nbytes / t / 1e6:.2f} TB/s, err {err:.1e})")
        for label_, fn in (("cuBLAS", lambda name, x, w: F.linear(x, w)),
                           ("tensor cores, the engine's tiles", lambda name, x, w: mma_gemv(x, w)),
                           ("tensor cores, each shape's fastest tile",
                            lambda name, x, w: mma_gemv(x, w, tile=best[name]))):
            ms, nbytes = step_graph(m, fn, weights, head)
            print(f"step's projections at {m} rows, {label_}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")


def main() -> None:
    global USE_PDL
    quick = "--quick" in sys.argv
    rows = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv[:-1] else "1"
    try:
        row_counts = positives(rows)
    except argparse.ArgumentTypeError as e:
        sys.exit(f"--rows: {e}")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if "--cuda" in sys.argv:
        cuda_report(row_counts)
        return
    if "--dot" in sys.argv:
        dot_report(row_counts)
        return
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = kernel_ms(lambda: b.copy_(a))
    print(f"copy 1 GiB: {t * 1e3:.0f} us, {2 * 2**30 / t / 1e9:.2f} TB/s (read + write)")
    t = kernel_ms(lambda: a.view(torch.bfloat16).sum())
    print(f"sum of 1 GiB (bf16): {t * 1e3:.0f} us, {2**30 / t / 1e9:.2f} TB/s (read)")
    best = {} if "--no-sweep" in sys.argv else sweep(quick)
    print("\n== a step's projections in a CUDA graph (36 x [qkv, o, gate_up, down] + lm_head)")
    weights, head = step_weights()
    for m in (1,):  # at M = 2 and 4 cuBLAS won by far (docs/lab-notes.md)
        ms, nbytes = step_graph(m, lambda name, x, w: F.linear(x, w), weights, head)
        print(f"  M={m} cuBLAS:            {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
        for cfg in (DEFAULT, GemvConfig(8, 512, 4, 2), GemvConfig(16, 512, 4, 3), GemvConfig(4, 1024, 4, 2)):
            for pdl in (False, True):
                USE_PDL = pdl
                ms, nbytes = step_graph(m, lambda name, x, w: gemv(x, w, config=cfg), weights, head)
                print(f"  M={m} gemv {cfg} pdl={pdl}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
        USE_PDL = False
        if best:
            ms, nbytes = step_graph(m, lambda name, x, w: run(best[name][0], x, w, best[name][1]), weights, head)
            print(f"  M={m} best per shape (no pdl): {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
    print("best per shape:", {k: (v[0], v[1]) for k, v in best.items()})


if __name__ == "__main__":
    run_main(main)
