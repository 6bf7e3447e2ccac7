"""Correctness on the GPU: the Triton attention path (fused q/k norm + rotary + K/V store, paged
attention) against the torch reference on real shapes in bf16, and the engine's greedy tokens with both
backends.  python benchmarks/gpu_check.py"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.model import gemv  # noqa: E402
from tests.test_triton_attention import compare  # noqa: E402


def main() -> None:
    cases = [
        ("Qwen3-8B decode x64, ctx 1-4k", 32, 8, 128, 16, [1] * 64, list(np.random.default_rng(1).integers(1, 4096, 64))),
        ("Qwen3-8B decode x1, ctx 1280 (split-KV)", 32, 8, 128, 16, [1], [1279]),
        ("Qwen3-8B prefill 1024", 32, 8, 128, 16, [1024], [0]),
        ("Qwen3-8B mixed: 2k chunk after 3k ctx + 31 decodes", 32, 8, 128, 16, [2048] + [1] * 31, [3000] + [500] * 31),
        ("Qwen3-0.6B mixed, block 32", 16, 8, 128, 32, [300, 1, 1, 77], [0, 900, 15, 40]),
        ("Llama-3-8B decode, fp8 KV", 32, 8, 128, 16, [1] * 16, [700] * 16),
    ]
    for name, h, kvh, d, bs, ql, cl in cases:
        kv_dtype = torch.float8_e4m3fn if "fp8" in name else None
        arch = "llama" if "Llama" in name else "qwen3"
        err, cache_err = compare(arch, h, kvh, d, bs, ql, [int(c) for c in cl], torch.bfloat16, kv_dtype)
        ok = err < 2e-2 and cache_err < 2e-2
        print(f"{name:<55} rel err {err:.2e} (K/V cache {cache_err:.2e}) {'OK' if ok else 'FAIL'}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 12288), (151936, 4096)):
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for m in (1, 3, 4):
            x = torch.randn((m, 2 * k), device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = torch.nn.functional.linear(x[:, :k].float(), w.float())
            err = ((gemv.gemv(x[:, :k].contiguous(), w).float() - ref).abs().max() / ref.abs().max()).item()
            g, u = x.chunk(2, -1)
            ref = torch.nn.functional.linear((torch.nn.functional.silu(g.float()).bfloat16() * u).float(), w.float())
            err2 = ((gemv.gemv(x, w, silu_mul=True).float() - ref).abs().max() / ref.abs().max()).item()
            ok = max(err, err2) < 1e-2
            print(f"gemv [{m} x {k}] @ [{n} x {k}]^T (pdl {gemv.USE_PDL}): rel err {err:.1e}, "
                  f"with silu-mul {err2:.1e} {'OK' if ok else 'FAIL'}", flush=True)
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for backend, max_m in (("torch", 0), ("triton", 0), ("triton", gemv.MAX_M)):
        t0 = time.perf_counter()
        gemv.MAX_M, default_max_m = max_m, gemv.MAX_M
        llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", attention_backend=backend, dtype="float32",
                  max_model_len=1024, gpu_memory_utilization=0.3, max_num_batched_tokens=256, max_num_seqs=8)
        outs[backend, max_m] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        gemv.MAX_M = default_max_m
        print(f"engine ({backend}, fp32, gemv for <= {max_m} rows): {time.perf_counter() - t0:.1f} s", flush=True)
        del llm
        torch.cuda.empty_cache()
    (a, b, c) = outs.values()
    print(f"greedy sequences identical (fp32, chunked prefill + CUDA graphs): triton vs torch backend "
          f"{sum(x == y for x, y in zip(a, b))}/{len(prompts)}, gemv vs cuBLAS {sum(x == y for x, y in zip(b, c))}/{len(prompts)}")


if __name__ == "__main__":
    main()
