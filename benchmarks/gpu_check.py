"""Correctness on the GPU: the Triton attention path (fused q/k norm + rotary + K/V store, paged
attention) against the torch reference on real shapes in bf16, the CUDA GEMV, the Gumbel sampler's draws
against the softmax, a mixture of experts' grouped GEMMs and graphs, the engine's greedy tokens with both backends
(also with penalties and logit biases) and its prompt logprobs.  python -m benchmarks.gpu_check"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F


from benchmarks.args import run_main
from pagedserve import LLM, SamplingParams
from pagedserve.model import fused
from pagedserve.model.cuda_gemv import CudaGemv
from pagedserve.model.mma_gemv import tile_for
from pagedserve.model.triton_attention import TritonAttentionBackend
from tests.test_triton_attention import compare, read_path_error


def main() -> None:
    cases = [
        ("Qwen3-8B decode x64, ctx 1-4k", 32, 8, 128, 16, [1] * 64, list(np.random.default_rng(1).integers(1, 4096, 64))),
        ("Qwen3-8B decode x1, ctx 1280 (split-KV)", 32, 8, 128, 16, [1], [1279]),
        ("Qwen3-8B decode x4, ctx 1-2k (split-KV), and a 1-token prompt", 32, 8, 128, 16, [1] * 5, [1900, 700, 64, 1, 0]),
        ("Qwen3-8B prefill 1024", 32, 8, 128, 16, [1024], [0]),
        ("Qwen3-8B mixed: 2k chunk after 3k ctx + 31 decodes", 32, 8, 128, 16, [2048] + [1] * 31, [3000] + [500] * 31),
        ("Qwen3-0.6B mixed, block 32", 16, 8, 128, 32, [300, 1, 1, 77], [0, 900, 15, 40]),
        ("Llama-3-8B decode, fp8 KV", 32, 8, 128, 16, [1] * 16, [700] * 16),
        ("Qwen3-8B decode x256, ctx 1-2k, fp8 KV", 32, 8, 128, 16, [1] * 256, list(np.random.default_rng(2).integers(1, 2048, 256))),
        ("Qwen3-8B mixed, fp8 KV: 1k chunk after 1k ctx + 15 decodes", 32, 8, 128, 16, [1024] + [1] * 15, [1000] + [900] * 15),
        ("Qwen3-0.6B decode x300, ctx 1-3k, block 32, fp8 KV", 16, 8, 128, 32, [1] * 300, list(np.random.default_rng(3).integers(1, 3000, 300))),
        ("Qwen3-8B mixed, fp8 KV: 300-token prefill + 100 decodes", 32, 8, 128, 16, [300] + [1] * 100, [0] + list(range(1, 1000, 10))),
    ]
    for name, h, kvh, d, bs, ql, cl in cases:
        cl = [int(c) for c in cl]
        kv_dtype = torch.float8_e4m3fn if "fp8" in name else None
        arch = "llama" if "Llama" in name else "qwen3"
        err, cache_err = compare(arch, h, kvh, d, bs, ql, cl, torch.bfloat16, kv_dtype)
        # fp8: torch and the fused store may round a written element one e4m3 step apart (up to 12 %),
        # which a long chunk's own keys carry into its scores; the read path below is checked tightly
        ok = err < (5e-2 if kv_dtype is not None else 2e-2) and cache_err < 2e-2
        print(f"{name:<55} rel err {err:.2e} (K/V cache {cache_err:.2e}) {'OK' if ok else 'FAIL'}", flush=True)
        if kv_dtype is not None:  # the read path on one shared cache: the CUDA decode, Triton's V by asm / cast,
            # and decodes unsplit as in a graph's padded step (a mixed step's few decodes then share its launch)
            for label, cuda, asm, unsplit in (("CUDA decode", True, True, False), ("Triton, V asm", False, True, False),
                                              ("Triton, V cast", False, False, False),
                                              ("Triton unsplit, V asm", False, True, True)):
                be = TritonAttentionBackend(h, kvh, d)
                be.CUDA_FP8_DECODE, be.FP8_V_ASM = cuda, asm
                if unsplit:
                    be.decode_segments = lambda batch, max_seq_len: 1
                rerr = read_path_error(h, kvh, d, bs, ql, cl, kv_dtype, be)
                print(f"  read path only, {label}: rel err {rerr:.2e} {'OK' if rerr < 1e-2 else 'FAIL'}")
    check_gemv()
    check_sampler()
    check_moe()
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    agreement("bf16, one request at a time, CUDA GEMV vs cuBLAS", gemv_runs(prompts, params), params)
    agreement("bf16, two requests at a time, CUDA GEMV vs cuBLAS", gemv_runs(prompts, params, 2), params)
    agreement("bf16, twelve requests at a time, tensor-core GEMV vs cuBLAS", gemv_runs(prompts, params, 12), params)
    # rows with presence/frequency penalties, a repetition penalty, a logit bias (the newest token the
    # penalties count is taken on the device from the step in flight)
    penalized = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                **[{}, {"presence_penalty": 1.5, "frequency_penalty": 0.5},
                                   {"repetition_penalty": 1.3}, {"logit_bias": {7: 3.0, 11: -100.0}}][i % 4])
                 for i in range(len(prompts))]
    outs, pen, scored = {}, {}, {}
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for backend in ("torch", "triton"):
        t0 = time.perf_counter()
        llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", attention_backend=backend, dtype="float32",
                  max_model_len=1024, gpu_memory_utilization=0.3, max_num_batched_tokens=256, max_num_seqs=8)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        pen[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, penalized, use_tqdm=False)]
        scored[backend] = [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                           for o in llm.generate(prompts, scoring, use_tqdm=False)]
        print(f"engine ({backend}, fp32): {time.perf_counter() - t0:.1f} s", flush=True)
        del llm
        torch.cuda.empty_cache()
    # prompt steps of 513-1,024 tokens (eight prompts at once) through the larger prompt-step graphs
    llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", attention_backend="triton", dtype="float32", max_model_len=1024,
              gpu_memory_utilization=0.3, max_num_batched_tokens=1024, max_num_seqs=8, max_cudagraph_capture_size=1024)
    large = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs["torch"], outs["triton"]))
    print(f"greedy sequences identical, triton vs torch backend (fp32, chunked prefill + CUDA graphs): {same}/{len(prompts)}")
    same = sum(a == b for a, b in zip(outs["torch"], large))
    print(f"... triton with prompt-step graphs up to 1,024 tokens (--max-cudagraph-capture-size 1024): "
          f"{same}/{len(prompts)}")
    same = sum(a == b for a, b in zip(pen["torch"], pen["triton"]))
    changed = sum(a != b for a, b in zip(pen["triton"], outs["triton"]))
    print(f"... with penalties or a logit bias on 9 of 12 rows: {same}/{len(prompts)} identical ({changed} differ "
          f"from the plain run)")
    # on the GPU, tl.dot rounds fp32 operands to tf32 (10-bit mantissa) in the prefill attention, where
    # torch's fp32 matmul does not: the backends' prompt logprobs differ by ~1e-3 through 28 layers
    diff = max(abs(a - b) for x, y in zip(scored["torch"], scored["triton"]) for a, b in zip(x, y))
    print(f"prompt logprobs (fp32, prompts through the prompt-step graphs), triton vs torch: max |diff| {diff:.2e} "
          f"{'OK' if diff < 5e-3 else 'FAIL'}")
    # bf16 with an fp8 cache, decodes graphed: the torch reference, Triton with the CUDA fp8 decode, and
    # Triton alone. bf16 rounding flips near-tie argmaxes of random weights, so this reports agreement
    # (sequences identical, mean common prefix) for each against the reference rather than demanding it
    fp8, default = {}, TritonAttentionBackend.CUDA_FP8_DECODE
    for label, backend, cuda in (("torch", "torch", False), ("CUDA decode", "triton", True),
                                 ("Triton decode", "triton", False)):
        TritonAttentionBackend.CUDA_FP8_DECODE = cuda
        llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", kv_cache_dtype="fp8", attention_backend=backend,
                  max_model_len=1024, gpu_memory_utilization=0.3, max_num_batched_tokens=256, max_num_seqs=8)
        fp8[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    TritonAttentionBackend.CUDA_FP8_DECODE = default
    for label in ("CUDA decode", "Triton decode"):
        agreement(f"bf16 + fp8 KV, {label} vs torch", (fp8["torch"], fp8[label]), params)


def agreement(label: str, runs: tuple[list, list], params: SamplingParams) -> None:
    """Sequences identical and mean common prefix of two runs' greedy tokens."""
    pairs = list(zip(*runs))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    print(f"{label}: {sum(a == b for a, b in pairs)}/{len(pairs)} identical, "
          f"mean common prefix {np.mean(prefix):.1f}/{params.max_tokens} tokens")


def row_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's largest error against an fp32 product, relative to that row's largest value."""
    return ((y.float() - ref).abs().amax(1) / ref.abs().amax(1)).max().item()


def check_gemv() -> None:
    """The CUDA GEMV on Qwen3-8B's and Qwen3-0.6B's projection shapes against an fp32 product."""
    dev = torch.device("cuda")
    gemv = CudaGemv(dev)
    for n, k, silu in ((6144, 4096, False), (4096, 4096, False), (24576, 4096, False), (4096, 12288, True),
                       (151936, 4096, False), (4096, 1024, False), (1024, 3072, True), (100, 768, False)):
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn((1, 2 * k if silu else k), device=dev, dtype=torch.bfloat16)
        ref = F.linear(fused.silu_mul(x).float() if silu else x.float(), w.float())
        err = row_error(gemv(x, w, silu_mul=silu), ref)
        print(f"CUDA GEMV [{n} x {k}]{' silu-mul' if silu else ''}: rel err {err:.2e} {'OK' if err < 1e-2 else 'FAIL'}")
    for n, k in ((4096, 4096), (1024, 2048), (100, 768)):  # o_proj's shapes, staged into shared memory
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn((1, k), device=dev, dtype=torch.bfloat16)
        y, ref = gemv(x, w, staged=True), F.linear(x.float(), w.float())
        err = row_error(y, ref)
        same = torch.equal(y, gemv(x, w))  # each row is summed by one warp in one order either way
        print(f"CUDA GEMV staged ({gemv.staged_chunks(n, k)} chunks a warp) [{n} x {k}]: rel err {err:.2e}, "
              f"{'equal to' if same else 'DIFFERS from'} the plain kernel {'OK' if err < 1e-2 and same else 'FAIL'}")
    for n, k, has_res in ((6144, 4096, False), (6144, 4096, True), (24576, 4096, True), (2048, 1024, True)):
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        x, r = (torch.randn((1, k), device=dev, dtype=torch.bfloat16) for _ in range(2))
        nw = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
        normed, want_res = fused.rms_norm(x, nw, 1e-6, r) if has_res else (fused.rms_norm(x, nw, 1e-6), x)
        ref = F.linear(normed.float(), w.float())
        y, res = gemv.norm_project(x, r if has_res else None, nw, 1e-6, w)
        err = row_error(y, ref)
        ok = err < 1e-2 and torch.equal(res, want_res)
        print(f"CUDA GEMV with RMSNorm{' + residual' if has_res else ''} [{n} x {k}]: rel err {err:.2e}, "
              f"residual {'equal' if torch.equal(res, want_res) else 'DIFFERS'} {'OK' if ok else 'FAIL'}")
    for m in (r for r in CudaGemv.ROWS if r > 1):  # decode steps of a few sequences: every row against its own
        for n, k, kind in ((6144, 4096, "norm"), (4096, 4096, ""), (4096, 12288, "silu-mul"), (151936, 4096, ""),
                           (2048, 1024, "norm")):
            w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn((m, 2 * k if kind == "silu-mul" else k), device=dev, dtype=torch.bfloat16)
            same = True
            if kind == "norm":
                r, nw = torch.randn_like(x), (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
                normed, want_res = fused.rms_norm(x, nw, 1e-6, r)
                y, res = gemv.norm_project(x, r, nw, 1e-6, w)
                ref, same = F.linear(normed.float(), w.float()), torch.equal(res, want_res)
            else:
                y = gemv(x, w, silu_mul=kind == "silu-mul")
                ref = F.linear((fused.silu_mul(x) if kind else x).float(), w.float())
            err = row_error(y, ref)
            print(f"CUDA GEMV {m} rows [{n} x {k}]{' ' + kind if kind else ''}: rel err {err:.2e}"
                  f"{', residual equal' if same else ', residual DIFFERS'} {'OK' if err < 1e-2 and same else 'FAIL'}")

    for m in (3, 4, 8, 16):  # the tensor-core kernel (mma_gemv) for a few rows, each tile it picks
        for n, k in ((6144, 4096), (4096, 4096), (4096, 12288), (151936, 4096)):
            w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            err = row_error(gemv(x, w), ref)
            print(f"tensor-core GEMV {m} rows [{n} x {k}] ({tile_for(n, k)}): "
                  f"rel err {err:.2e} {'OK' if err < 1e-2 else 'FAIL'}")
        w = torch.randn((24576, 4096), device=dev, dtype=torch.bfloat16) * 0.02  # gate_up_proj, silu-mul formed in it
        x = torch.randn((m, 4096), device=dev, dtype=torch.bfloat16)
        same = torch.equal(gemv.gated(x, w), fused.silu_mul(gemv(x, w)))
        print(f"tensor-core GEMV {m} rows gated [24576 x 4096]: {'equal to' if same else 'DIFFERS from'}"
              f" the product then the silu-mul kernel {'OK' if same else 'FAIL'}")


def check_sampler() -> None:
    """The Gumbel sampler at Qwen3's vocabulary: 8192 draws of one row against its softmax (the noise of
    the GPU's kernel: Philox, four columns a call, lg2.approx), a split of the vocabulary that must not
    change any draw, and greedy rows that must be the argmax."""
    dev = torch.device("cuda")
    v, n = 151936, 8192
    logits = torch.full((v,), float("-inf"), device=dev)
    cols = torch.tensor([7, 263, 519, 775, 1031, 90000, 151935], device=dev)  # every quarter of a tile, far ones
    logits[cols] = torch.tensor([1.0, 1.0, 0.0, 2.0, 1.5, 0.5, 1.0], device=dev)
    x = logits.to(torch.bfloat16).repeat(n, 1)
    inv_t, seeds = torch.full((n,), 1 / 0.8, device=dev), torch.arange(n, device=dev) * 7919 + 3
    noisy = torch.ones(n, dtype=torch.bool, device=dev)
    tokens = fused.gumbel_argmax(x, inv_t, seeds, noisy)
    freq = torch.bincount(tokens, minlength=v).float() / n
    want = torch.softmax(logits * 1.25, dim=0)
    dev_max = (freq[cols] - want[cols]).abs().max().item()  # 3 standard errors at 8192 draws: ~0.017
    same_split = torch.equal(fused.gumbel_argmax(x, inv_t, seeds, noisy, num_sms=1), tokens)
    r = torch.randn((64, v), device=dev, dtype=torch.bfloat16)
    greedy = torch.equal(fused.gumbel_argmax(r, torch.ones(64, device=dev), seeds[:64],
                                               torch.zeros(64, dtype=torch.bool, device=dev)),
                         r.argmax(1))
    ok = dev_max < 0.02 and abs(freq[cols].sum().item() - 1) < 1e-6 and same_split and greedy
    print(f"Gumbel sampler [{n} x {v}]: max |frequency - softmax| {dev_max:.4f}, split-invariant {same_split}, "
          f"greedy rows = argmax {greedy} {'OK' if ok else 'FAIL'}")


def check_moe(device: str = "cuda") -> None:
    """A mixture of experts: the grouped-GEMM layer at Qwen3-30B-A3B's shapes against a loop over each token's
    experts in float32, and a small random Qwen3-MoE's greedy tokens replaying CUDA graphs against the same model
    launched kernel by kernel (bf16; agreement reported, as near-ties of random weights flip)."""
    import tempfile

    from pagedserve.builtin.tiny import write_random_checkpoint
    from pagedserve.model.layers import RMSNorm, SparseMoE

    torch.manual_seed(0)
    with torch.inference_mode():
        moe = SparseMoE(2048, 768, 128, 8, renormalize=True).to(device, torch.bfloat16)
        for w in moe.parameters():
            w.normal_(0.0, 0.02)
        norm = RMSNorm(2048, 1e-6).to(device, torch.bfloat16)
        x = torch.randn(300, 2048, device=device, dtype=torch.bfloat16)
        got, _ = moe(norm, x, torch.zeros_like(x))
        h = norm(x, torch.zeros_like(x))[0].float()
        weights, chosen = (h.to(torch.bfloat16) @ moe.gate.weight.T).float().softmax(-1).topk(8, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ref = torch.zeros_like(h)
        for e in range(128):
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = (h[tokens] @ moe.w13[e].float().T).chunk(2, dim=-1)
            ref.index_add_(0, tokens, weights[tokens, slot, None] * ((F.silu(gate) * up) @ moe.w2[e].float().T))
    err = row_error(got.float(), ref)
    print(f"experts [300 x 2048, top 8 of 128]: grouped GEMMs vs a loop, rel err {err:.2e} "
          f"{'OK' if err < 2e-2 else 'FAIL'}", flush=True)
    if device != "cuda":
        return
    facts = dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=4096,
                 num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048)
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        path = write_random_checkpoint(folder, facts, with_tokenizer=False)
        runs = []
        for eager in (True, False):
            llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=eager, max_model_len=1024,
                      gpu_memory_utilization=0.2, max_num_seqs=8, max_num_batched_tokens=256)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            del llm
            torch.cuda.empty_cache()
    agreement("Qwen3-MoE bf16, CUDA graphs vs kernel by kernel", (runs[0], runs[1]), params)


def gemv_runs(prompts, params, max_num_seqs: int = 1) -> tuple[list, list]:
    """Qwen3-0.6B bf16 greedy tokens, ``max_num_seqs`` requests at a time (decodes of that many rows), on
    cuBLAS and on the GEMV."""
    runs, default = [], CudaGemv.ENABLED
    for on in (False, True):
        CudaGemv.ENABLED = on
        llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", max_model_len=1024, gpu_memory_utilization=0.3,
                  max_num_seqs=max_num_seqs)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
        torch.cuda.empty_cache()
    CudaGemv.ENABLED = default
    return runs[0], runs[1]


if __name__ == "__main__":
    run_main(main)
