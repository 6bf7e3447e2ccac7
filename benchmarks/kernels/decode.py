"""Where decode time goes: a kernel-level profile of one eager decode step, and the paged-attention
kernel alone at a few tile shapes with its achieved bandwidth.

python -m benchmarks.kernels.decode [--kernels-only | --fp8 | --cuda | --fp8-step | --segments | --prefill
                                     | --prefill-shapes | --mixed | --ncu]

--mixed: a mixed step's attention, decode and prefill tiles in one launch against two.
--prefill: prompt tiles alone over tile shapes; --prefill-shapes: the engine's tile shape over serving's chunks.

--cuda: the fp8 decode alone, the CUDA kernel (2, 4, 8 warps a CTA; 4 without its L2 prefetch) against
the Triton kernel.
--fp8-step: the kernel profile of one 512-sequence Qwen3-8B decode step over an fp8 cache.

--ncu: only a few fp8 decode launches at 256 x 1536, for Nsight Compute:
ncu --clock-control none -k regex:_paged_attention --launch-skip 2 --launch-count 1 python -m benchmarks.kernels.decode --ncu
"""

from __future__ import annotations

import sys

import numpy as np
import torch


from benchmarks.kernels.harness import kernel_ms
from pagedserve import LLM, SamplingParams
from pagedserve.model.fused import sm_count
from pagedserve.model.triton_attention import TritonAttentionBackend
from tests.test_triton_attention import make_batch


def profile_step(model: str, batch: int, ctx: int, kv_cache_dtype: str = "auto") -> None:
    chunk = max(8192, batch)
    max_tokens = -(-batch * ctx // chunk) + 32  # no request finishes before the last prompt is admitted
    llm = LLM(model, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=ctx + max_tokens + 16,
              gpu_memory_utilization=0.85 if kv_cache_dtype == "fp8" else 0.6, max_num_seqs=max(batch, 1),
              kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=chunk)
    engine = llm.engine
    rng = np.random.default_rng(0)  # distinct prompts: a shared one would be a cached prefix read from L2
    for i in range(batch):
        engine.add_request(str(i), rng.integers(0, 30000, ctx).tolist(),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    # past every prompt's prefill (its first token counts its prompt), so the profiled steps are decodes only
    while engine.core.counters.prompt_tokens < batch * ctx or engine.core.counters.generation_tokens < batch * 4:
        engine.step()
    tokens_before = engine.core.counters.generation_tokens
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    decodes = (engine.core.counters.generation_tokens - tokens_before) / 5
    print(f"\n== {model}, {decodes:.0f} decodes a step at context {ctx}+, KV {kv_cache_dtype}: CUDA time per step "
          "by kernel (5 steps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del llm, engine
    torch.cuda.empty_cache()


# (TILE, num_stages, segments (None: the backend's choice), warps)
CONFIGS = [(t, st, None, w) for t in (64, 128) for st in (2, 3, 4) for w in (2, 4)]
FP8_CONFIGS = [(t, st, None, w) for t in (16, 32, 64) for st in (2, 3, 4) for w in (1, 2, 4)]


BS, D = 16, 128  # block size and head dim of every shape below


def paged_inputs(heads, kv_heads, query_lens, context_lens, kv_dtype):
    """A random cache with room for every request, queries for the new tokens, and the step's metadata."""
    nblocks = sum(-(-(q + c) // BS) for q, c in zip(query_lens, context_lens)) + 4
    cache = torch.randn((2, nblocks, BS, kv_heads, D), device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn((sum(query_lens), heads, D), device="cuda", dtype=torch.bfloat16)
    meta, _ = make_batch(np.random.default_rng(0), query_lens, context_lens, BS, nblocks)
    return cache, q, meta


def attention_alone(name, heads, kv_heads, batch, ctx, kv_dtype=torch.bfloat16, configs=CONFIGS,
                    fp8_v_asm: bool = True) -> None:
    """The decode kernel alone over tile sizes, pipelining depths, split factors and warps: time and
    the bandwidth it reaches on the K/V bytes it must read. ``fp8_v_asm`` False: an fp8 V converted
    by a plain cast, which Triton stages as bytes (the engine's fp8 decode before it took the asm one)."""
    cache, q, meta = paged_inputs(heads, kv_heads, [1] * batch, [ctx] * batch, kv_dtype)
    kv_bytes = batch * (ctx + 1) * kv_heads * D * 2 * cache.element_size()
    sms = sm_count(cache.device)
    results = []
    for tile, stages, segs, warps in configs:
        be = TritonAttentionBackend(heads, kv_heads, D, sms)
        be.TILE = be.SPLIT_TILE = tile
        be.NUM_STAGES, be.NUM_WARPS, be.FP8_SPLIT_WARPS = stages, warps, warps
        be.FP8_DECODE, be.FP8_V_ASM = (tile, warps, stages), fp8_v_asm
        if segs is not None:
            be.decode_segments = lambda b, s, segs=segs: segs
        be.prepare(meta, BS)
        ms = kernel_ms(lambda be=be, meta=meta: be.attend(q, cache, meta, D ** -0.5), 100)
        results.append((ms, tile, stages, meta.backend_state.decode.num_segments, warps))
    results.sort()
    cast = "" if kv_dtype != torch.float8_e4m3fn else (", V converted in registers" if fp8_v_asm else ", V cast after staging")
    print(f"\n== {name}, K/V {kv_dtype}{cast}: {kv_bytes / 2**30:.2f} GiB of K/V per call; fastest first")
    for ms, tile, stages, segs, warps in results[:4] + results[-1:]:
        print(f"  TILE {tile:3d} stages {stages} segments {segs} warps {warps}: {ms * 1000:8.1f} us, "
              f"{kv_bytes / ms / 1e6:7.0f} GB/s")


def cuda_vs_triton(batch: int, context_lens: list[int], heads=32, kv_heads=8) -> None:
    """The fp8 decode alone: the CUDA kernel (cuda_decode.py) at 2, 4 and 8 warps a CTA (and at 4 without
    its L2 prefetch) against the Triton kernel at its engine shape, on the same cache, with the K/V
    bandwidth each reaches."""
    from pagedserve.model.cuda_decode import CudaFp8Decode

    cache, q, meta = paged_inputs(heads, kv_heads, [1] * batch, context_lens, torch.float8_e4m3fn)
    kv_bytes = sum(c + 1 for c in context_lens) * kv_heads * D * 2
    be = TritonAttentionBackend(heads, kv_heads, D, sm_count(cache.device))
    be.CUDA_FP8_DECODE = False
    be.decode_segments = lambda b, s: 1  # one CTA a (sequence, KV head), as the CUDA kernel runs
    be.prepare(meta, BS)
    arms = [("Triton", lambda: be.attend(q, cache, meta, D ** -0.5))]
    out = torch.empty_like(q)
    for warps, prefetch in ((2, None), (4, 0), (4, None), (8, None)):
        k = CudaFp8Decode.build(heads // kv_heads, kv_heads, D, BS, cache.device, warps=warps, prefetch=prefetch)
        name = f"CUDA {warps} warps" + (", no L2 prefetch" if prefetch == 0 else "")
        arms.append((name, lambda k=k: k(q, cache, out, meta, meta.backend_state.decode.tile_seq, D ** -0.5)))
    print(f"\n== fp8 decode alone, {batch} x context {min(context_lens)}..{max(context_lens)}, "
          f"{kv_bytes / 2**30:.2f} GiB of K/V per call")
    for name, fn in arms:
        ms = kernel_ms(fn, 200)
        print(f"  {name:<30}: {ms * 1000:8.1f} us, {kv_bytes / ms / 1e6:7.0f} GB/s")


def prefill_flops(prompts: int, heads: int, length: int, context: int) -> float:
    """Causal QK^T and PV of ``prompts`` chunks of ``length`` tokens, each after ``context`` cached tokens."""
    return 4 * prompts * heads * D * length * (context + (length + 1) / 2)


def prefill_alone(kv_dtype=torch.bfloat16, heads=32, kv_heads=8, prompts=16, length=1024, context=0) -> None:
    """Causal prefills of ``prompts`` chunks of ``length`` tokens, each after ``context`` cached tokens (16
    fresh 1,024-token prompts; a 32k prompt's last 8k chunk), over the prefill tile shape."""
    cache, q, meta = paged_inputs(heads, kv_heads, [length] * prompts, [context] * prompts, kv_dtype)
    sms = sm_count(cache.device)
    flops = prefill_flops(prompts, heads, length, context)
    results = []
    for rows, tile, warps, stages in [(r, t, w, s) for r in (64, 128) for t in (64, 128) for w in (4, 8) for s in (2, 3)]:
        be = TritonAttentionBackend(heads, kv_heads, D, sms)
        be.PREFILL_ROWS, be.PREFILL_TILE, be.NUM_WARPS, be.PREFILL_STAGES = rows, tile, warps, stages
        be.prefill_block_q = be.wide_block_q = rows // be.G
        be.prepare(meta, BS)
        ms = kernel_ms(lambda be=be, meta=meta: be.attend(q, cache, meta, D ** -0.5), 100)
        results.append((ms, rows, tile, warps, stages))
    cls = TritonAttentionBackend
    engine = (cls.PREFILL_ROWS, cls.PREFILL_TILE, cls.NUM_WARPS, cls.PREFILL_STAGES)
    shipped = next(r for r in results if r[1:] == engine)
    results.sort()
    print(f"\n== prefill attention, {prompts} x {length} tokens after {context}, {heads}/{kv_heads} heads, "
          f"K/V {kv_dtype}; fastest first, then the engine's shape")
    for ms, rows, tile, warps, stages in results[:4] + results[-1:] + [shipped]:
        print(f"  rows {rows:3d} TILE {tile:3d} warps {warps} stages {stages}: {ms * 1000:8.1f} us, "
              f"{flops / ms / 1e9:6.1f} TFLOP/s")


# (prompts, chunk tokens, cached tokens before each chunk): fresh prompts, a 32k prompt's 8k chunks, the online
# test's chunk beside decodes, chunks after a long context
PREFILL_SHAPES = [(16, 1024, 0), (1, 8192, 0), (1, 8192, 8192), (1, 8192, 24576), (1, 240, 768), (4, 2048, 6144)]


def prefill_shapes(kv_dtype=torch.bfloat16, heads=32, kv_heads=8) -> None:
    """The engine's prefill attention, at its own tile shape, over the chunks of PREFILL_SHAPES."""
    print(f"\n== prefill attention at the engine's tile shape, {heads}/{kv_heads} heads, K/V {kv_dtype}")
    for prompts, length, context in PREFILL_SHAPES:
        cache, q, meta = paged_inputs(heads, kv_heads, [length] * prompts, [context] * prompts, kv_dtype)
        be = TritonAttentionBackend(heads, kv_heads, D, sm_count(cache.device))
        be.prepare(meta, BS)
        ms = kernel_ms(lambda: be.attend(q, cache, meta, D ** -0.5), 200)
        flops = prefill_flops(prompts, heads, length, context)
        print(f"  {prompts:2d} x {length:5d} after {context:5d}: {ms * 1000:9.1f} us, {flops / ms / 1e9:6.1f} TFLOP/s")


# (name, decodes, their contexts from [lo, hi), prompt chunk tokens, the chunk's context)
MIXED_SHAPES = [("online test: 16 decodes + a 240-token chunk", 16, (1024, 1280), 240, 768),
                ("64 decodes + a 192-token chunk", 64, (1024, 1536), 192, 512),
                ("256 decodes + a 256-token chunk", 256, (1024, 2048), 256, 0),
                ("332 decodes + a fresh 1024-token prompt", 332, (1024, 2048), 1024, 0)]


def mixed_launches(kv_dtype=torch.bfloat16, heads=32, kv_heads=8) -> None:
    """A mixed step's attention (decodes beside a prompt chunk, unsplit, as in a padded graph step): its
    decode and prefill tiles in one launch against two launches, beside each kind alone, and which of the two
    the engine takes. The fp8 decodes are the Triton kernel's (the CUDA one serves only eager steps)."""
    sms = sm_count(torch.device("cuda"))
    rng = np.random.default_rng(5)
    print(f"\n== a mixed step's attention, Qwen3-8B heads, K/V {kv_dtype}: us a layer")
    for name, decodes, (lo, hi), chunk, chunk_ctx in MIXED_SHAPES:
        ctxs = [int(c) for c in rng.integers(lo, hi, decodes)]
        cache, q, meta = paged_inputs(heads, kv_heads, [1] * decodes + [chunk], ctxs + [chunk_ctx], kv_dtype)
        be = TritonAttentionBackend(heads, kv_heads, D, sms)
        be.CUDA_FP8_DECODE = False
        be.decode_segments = lambda b, s: 1
        be.prepare(meta, BS)
        st, out, scale = meta.backend_state, torch.empty_like(q), D ** -0.5

        def two():
            be._launch(q, cache, out, meta, st, st.decode, scale)
            be._launch(q, cache, out, meta, st, st.prefill, scale)

        times = {"one launch": kernel_ms(lambda: be._launch_mixed(q, cache, out, meta, st, scale), 200),
                 "two launches": kernel_ms(two, 200)}
        for arm, launch in (("decodes alone", st.decode), ("chunk alone", st.prefill)):
            times[arm] = kernel_ms(lambda launch=launch: be._launch(q, cache, out, meta, st, launch, scale), 200)
        taken = "one" if be._one_launch(q, cache, st) else "two"
        print(f"  {name:<44}" + "  ".join(f"{arm} {ms * 1000:6.1f}" for arm, ms in times.items())
              + f"  (the engine: {taken})")


def ncu_launches() -> None:
    cache, q, meta = paged_inputs(32, 8, [1] * 256, [1536] * 256, torch.float8_e4m3fn)
    be = TritonAttentionBackend(32, 8, D, sm_count(cache.device))
    be.prepare(meta, BS)
    for _ in range(3):
        be.attend(q, cache, meta, D ** -0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernels_only = "--kernels-only" in sys.argv
    if "--mixed" in sys.argv:
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            mixed_launches(kv)
        sys.exit(0)
    if "--prefill-shapes" in sys.argv:
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            prefill_shapes(kv)
        sys.exit(0)
    if "--prefill" in sys.argv:
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            prefill_alone(kv)
            prefill_alone(kv, prompts=1, length=8192, context=24576)
        sys.exit(0)
    if "--segments" in sys.argv:  # fp8 decode over forced split factors: the last partial wave of programs
        for kv in (torch.float8_e4m3fn, torch.bfloat16):
            attention_alone("Qwen3-8B heads, 256 decodes at 1536", 32, 8, 256, 1536, kv,
                            [(64, st, sg, 2) for st in (2, 3) for sg in (1, 2, 4, 8)])
        sys.exit(0)
    if "--cuda" in sys.argv:
        rng = np.random.default_rng(4)
        for batch in (256, 512):
            cuda_vs_triton(batch, [1536] * batch)
            cuda_vs_triton(batch, [int(c) for c in rng.integers(1, 2048, batch)])
        sys.exit(0)
    if "--fp8-step" in sys.argv:
        profile_step("Qwen/Qwen3-8B", 512, 1536, kv_cache_dtype="fp8")
        sys.exit(0)
    if "--ncu" in sys.argv:
        ncu_launches()
        sys.exit(0)
    if "--fp8" in sys.argv:  # the fp8 decode alone, down to one warp a program, V converted either way
        for batch in (256, 512):
            for asm, configs in ((True, FP8_CONFIGS), (False, [(64, 3, None, 2)])):  # the cast: its best
                attention_alone(f"Qwen3-8B heads, {batch} decodes at 1536", 32, 8, batch, 1536, torch.float8_e4m3fn,
                                configs, fp8_v_asm=asm)
        sys.exit(0)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        attention_alone("Qwen3-8B heads, 256 decodes at 1536", 32, 8, 256, 1536, kv)
    attention_alone("Qwen3-0.6B heads, 256 decodes at 800", 16, 8, 256, 800)
    attention_alone("Qwen3-8B heads, 1 decode at 1152", 32, 8, 1, 1152)
    if not kernels_only:
        profile_step("Qwen/Qwen3-8B", 1, 1024)
        profile_step("Qwen/Qwen3-0.6B", 256, 800)
