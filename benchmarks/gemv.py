"""Skinny GEMMs at decode batch sizes: pagedserve's Triton GEMV against cuBLAS (F.linear) on the
projection shapes of Qwen3-8B, alone (a sweep of tile shapes) and as a whole step's worth of weights
replayed in a CUDA graph (where ramps, tails and gaps between kernels count).

python benchmarks/gemv.py [--quick] [--no-sweep]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.model import gemv as G  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
LAYERS = 36


@triton.jit
def _gemv_dot(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tensor-core alternative: x padded to 16 rows, one tl.dot per W tile (W tiles pipelined
    through shared memory)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + ms[:, None] * stride_xm + k0 + ks[None, :], mask=(ms < M)[:, None], other=0.0)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_wn + k0 + ks[None, :], mask=(rows < N)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(Out + ms[:, None] * stride_om + rows[None, :], acc.to(Out.dtype.element_ty),
             mask=(ms < M)[:, None] & (rows < N)[None, :])


def gemv_dot(x, w, cfg):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_dot[(triton.cdiv(n, cfg.block_n),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                              BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def configs(quick: bool):
    elem = [("elem", G.GemvConfig(bn, bk, w, s)) for bn in (4, 8, 16) for bk in (256, 512, 1024)
            for w in (4, 8) for s in (2, 3)]
    dot = [("dot", G.GemvConfig(bn, bk, w, s)) for bn in (16, 32, 64) for bk in (128, 256) for w in (4,)
           for s in (3, 4, 6)]
    if quick:
        return [("elem", G.DEFAULT)]
    return elem + dot


def run(kind, x, w, cfg):
    return G.gemv(x, w, config=cfg) if kind == "elem" else gemv_dot(x, w, cfg)


def sweep(quick: bool) -> dict[str, tuple[str, G.GemvConfig]]:
    dev = torch.device("cuda")
    best = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn((1, k), device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        nbytes = w.numel() * 2
        t_cublas = triton.testing.do_bench(lambda: F.linear(x, w), rep=100)
        rows = []
        for kind, cfg in configs(quick):
            if k % cfg.block_k:
                continue
            y = run(kind, x, w, cfg)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = triton.testing.do_bench(lambda kind=kind, cfg=cfg: run(kind, x, w, cfg), rep=100)
            rows.append((t, kind, cfg, err))
        rows.sort(key=lambda r: r[0])
        print(f"\n== {name} [{n} x {k}], {nbytes / 1e6:.0f} MB, M=1: cuBLAS {t_cublas * 1e3:.1f} us "
              f"({nbytes / t_cublas / 1e9:.2f} TB/s)")
        for t, kind, cfg, err in rows[:5] + rows[-1:]:
            print(f"  {kind:4s} {cfg}: {t * 1e3:7.1f} us, {nbytes / t / 1e9:.2f} TB/s, max rel err {err:.1e}")
        best[name] = (rows[0][1], rows[0][2])
        del w
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
    ms = triton.testing.do_bench(g.replay, rep=300)
    nbytes = sum(t.numel() * 2 for ws in weights for t in ws) + head.numel() * 2
    return ms, nbytes


def main() -> None:
    quick = "--quick" in sys.argv
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), rep=100)
    print(f"copy 1 GiB: {t * 1e3:.0f} us, {2 * 2**30 / t / 1e9:.2f} TB/s (read + write)")
    t = triton.testing.do_bench(lambda: a.view(torch.bfloat16).sum(), rep=100)
    print(f"sum of 1 GiB (bf16): {t * 1e3:.0f} us, {2**30 / t / 1e9:.2f} TB/s (read)")
    del a, b
    best = {} if "--no-sweep" in sys.argv else sweep(quick)
    print("\n== a step's projections in a CUDA graph (36 x [qkv, o, gate_up, down] + lm_head)")
    weights, head = step_weights()
    for m in (1,):  # at M = 2 and 4 cuBLAS won by far (docs/benchmarks.md)
        ms, nbytes = step_graph(m, lambda name, x, w: F.linear(x, w), weights, head)
        print(f"  M={m} cuBLAS:            {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
        for cfg in (G.DEFAULT, G.GemvConfig(8, 512, 4, 2), G.GemvConfig(16, 512, 4, 3), G.GemvConfig(4, 1024, 4, 2)):
            for pdl in (False, True):
                G.USE_PDL = pdl
                ms, nbytes = step_graph(m, lambda name, x, w: G.gemv(x, w, config=cfg), weights, head)
                print(f"  M={m} gemv {cfg} pdl={pdl}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
        G.USE_PDL = False
        if best:
            ms, nbytes = step_graph(m, lambda name, x, w: run(best[name][0], x, w, best[name][1]), weights, head)
            print(f"  M={m} best per shape (no pdl): {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s")
    print("best per shape:", {k: (v[0], v[1]) for k, v in best.items()})


if __name__ == "__main__":
    main()
