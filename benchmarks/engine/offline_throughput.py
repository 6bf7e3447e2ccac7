"""Offline throughput: nano-vllm's workload or fixed lengths, optionally against
Hugging Face transformers' continuous batching on the same weights.

python -m benchmarks.engine.offline_throughput --model Qwen/Qwen3-0.6B --num-seqs 256 --min-len 100 --max-len 1024 --hf-peer
python -m benchmarks.engine.offline_throughput --model Qwen/Qwen3-8B --num-seqs 1000 --input-len 1024 --output-len 1024

nano-vllm's workload: 256 sequences, prompt and output lengths each uniform in [100, 1024], random token
ids below 10000, seed 0, ignore_eos. Throughput = output tokens / wall time, as nano-vllm reports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from benchmarks.args import run_main
from benchmarks.engine.length_curve import gpu_peaks
from pagedserve import LLM, SamplingParams
from pagedserve.builtin.known_models import KNOWN_MODELS
from pagedserve.config import ModelConfig
from pagedserve.memory import kv_bytes_per_token, weight_bytes


def workload(ns):
    rng = np.random.default_rng(ns.seed)
    if ns.input_len:
        ins = [ns.input_len] * ns.num_seqs
        outs = [ns.output_len] * ns.num_seqs
    else:
        ins = rng.integers(ns.min_len, ns.max_len + 1, ns.num_seqs).tolist()
        outs = rng.integers(ns.min_len, ns.max_len + 1, ns.num_seqs).tolist()
    prompts = [rng.integers(0, 10000, n).tolist() for n in ins]
    return prompts, outs


def triton_variants() -> dict[str, set]:
    """The specializations each of our Triton kernels has compiled in this process (Triton's in-memory
    cache, read for the report: a variant that first appears inside the timed run was compiled there)."""
    from triton.runtime.jit import JITFunction

    from pagedserve.model import fused, triton_attention

    return {name: {key for cache in fn.device_caches.values() for key in cache[0]}
            for mod in (fused, triton_attention) for name, fn in vars(mod).items() if isinstance(fn, JITFunction)}


def log_step_times(core) -> list[tuple[float, int, int]]:
    """(time its tokens arrived, prefill tokens, decode tokens) of every step the core collects. With one
    step in flight the gap between two arrivals is the device time of the later step, plus any time the
    device waited for the host: where the wall time goes, by kind of step."""
    log: list[tuple[float, int, int]] = []
    collect = core._collect

    def timed(sched, pending):
        out = collect(sched, pending)
        log.append((time.perf_counter(), sched.num_prefill_tokens, sched.num_decode_tokens))
        return out

    core._collect = timed
    return log


def summarize_steps(log: list[tuple[float, int, int]]) -> dict:
    """Wall seconds in steps with prompt tokens and in decode-only steps (the first step has no gap)."""
    gaps = [(t1 - t0, pre, dec) for (t0, _, _), (t1, pre, dec) in zip(log, log[1:])]
    mixed = [g for g in gaps if g[1]]
    decode = [g for g in gaps if not g[1]]
    full = max((g[2] for g in decode), default=0)
    return {"prefill_steps": len(mixed), "prefill_step_seconds": sum(g[0] for g in mixed),
            "decode_steps": len(decode), "decode_step_seconds": sum(g[0] for g in decode),
            "decode_batch_mean": float(np.mean([g[2] for g in decode])) if decode else 0.0,
            "decode_ms_at_full_batch": 1e3 * float(np.median([g[0] for g in decode if g[2] == full])) if decode else 0.0}


def floors(model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, ins: list[int], outs: list[int],
           steps: list[tuple[float, int, int]], peaks: tuple[float, float, str]) -> dict:
    """Seconds the run's work takes at the GPU's peaks with its kernels in series, as the engine runs them
    (no preemptions' recomputation): each step's projections read every weight or compute 2 x params FLOPs
    a token, whichever is longer; the decodes read their K/V; the prompts' attention computes. Which term
    is largest says what bounds the run, and their sum how near the run is to the hardware.

    ``floor_overlapped_seconds``: the same work with the memory-bound part (each step's weights read once, the
    decodes' K/V) running beside the compute-bound part (projections and prompts' attention), whichever is
    longer: what an engine that overlaps a batch's attention with another's GEMMs could reach at most."""
    peak_flops, peak_bytes, preset = peaks
    weights, flops_per_token = weight_bytes(model, dtype), 2 * model.active_params()
    projections = sum(max(weights / peak_bytes, flops_per_token * (pre + dec) / peak_flops) for _, pre, dec in steps)
    # a request's decodes read contexts of in + 1 ... in + out - 1 tokens (its first token ends the prompt)
    contexts = sum((o - 1) * i + o * (o - 1) // 2 for i, o in zip(ins, outs))
    kv = contexts * kv_bytes_per_token(model, kv_dtype) / peak_bytes
    attention = sum(2 * model.num_layers * model.num_heads * model.head_dim * i ** 2 for i in ins) / peak_flops
    reads = len(steps) * weights / peak_bytes + kv
    computes = flops_per_token * sum(pre + dec for _, pre, dec in steps) / peak_flops + attention
    return {"floor_peaks": [peak_flops, peak_bytes, preset], "floor_projection_seconds": projections,
            "floor_decode_kv_seconds": kv, "floor_prompt_attention_seconds": attention,
            "floor_seconds": projections + kv + attention, "floor_overlapped_seconds": max(reads, computes)}


def make_llm(model: str, ns) -> LLM:
    """The engine of the workload flags (random weights unless ``model`` is a checkpoint folder)."""
    return LLM(model, load_format="auto" if Path(model).is_dir() else "dummy", dtype="bfloat16",
               max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
               max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
               max_mixed_prefill_tokens=ns.max_mixed_prefill_tokens, kv_cache_dtype=ns.kv_cache_dtype)


def run_ours(model, prompts, outs, ns) -> dict:
    t0 = time.perf_counter()
    llm = make_llm(model, ns)
    init = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    # no warm-up generate: the engine compiles its kernels at start-up, and the report below checks it
    core = llm.engine.core
    pre, steps0 = core.counters.num_preemptions, core.counters.num_steps
    before = triton_variants()
    steps = log_step_times(core)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    compiled = {name: keys - before[name] for name, keys in triton_variants().items()}
    for name, keys in compiled.items():
        for key in keys:
            print(f"compiled inside the timed run: {name} {str(key)[:600]}", file=sys.stderr)
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    budget = core.worker.budget
    out = {"engine": "pagedserve", "output_tokens": tokens, "seconds": dt, "output_tok_per_s": tokens / dt,
           "total_tok_per_s": (tokens + sum(map(len, prompts))) / dt, "init_seconds": init,
           "steps": core.counters.num_steps - steps0, "preemptions": core.counters.num_preemptions - pre,
           "kv_cache_tokens": budget.kv_tokens, "peak_memory_gib": core.worker.device_memory()[1] / 2**30,
           "kernel_variants_compiled_in_run": {k: len(v) for k, v in compiled.items() if v},
           **summarize_steps(steps),
           **floors(llm.engine.config.model, llm.engine.config.dtype, llm.engine.config.kv_dtype,
                    list(map(len, prompts)), outs, steps, gpu_peaks())}
    del llm, core
    torch.cuda.empty_cache()
    return out


def run_hf(folder, prompts, outs) -> dict:
    """transformers' continuous batching (attn_implementation "paged|sdpa"), per-request lengths."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="paged|sdpa").cuda().eval()
    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        manager.add_request(input_ids=p, request_id=str(i), max_new_tokens=o)
    tokens, done = 0, 0
    while done < len(prompts):
        r = manager.get_result(timeout=600)
        if r is None:
            continue
        if r.is_finished():
            done += 1
            tokens += len(r.generated_tokens)
    dt = time.perf_counter() - t0
    manager.stop(block=True)
    return {"engine": "transformers generate (continuous batching, paged|sdpa)", "output_tokens": tokens,
            "seconds": dt, "output_tok_per_s": tokens / dt}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload and engine flags, shared with profile_steps.py."""
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=0, help="fixed lengths instead of nano-vllm's ranges")
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-mixed-prefill-tokens", type=int, default=0,
                    help="hold a step's prompt tokens to this many while requests decode (0: no bound)")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--hf-peer", action="store_true", help="also run transformers on the same weights")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--fp8-decode", choices=("cuda", "triton"), default="cuda",
                    help="the kernel of fp8 decodes (A/B of model/cuda_decode.py against the Triton kernel)")
    ns = ap.parse_args()
    from pagedserve.model.triton_attention import TritonAttentionBackend

    TritonAttentionBackend.CUDA_FP8_DECODE = ns.fp8_decode == "cuda"
    prompts, outs = workload(ns)
    results = []
    if ns.hf_peer:
        # one set of random weights, written once as an HF checkpoint, read by both engines
        from pagedserve.builtin.tiny import write_random_checkpoint

        folder = Path(tempfile.mkdtemp()) / "ckpt"
        cfg = {**KNOWN_MODELS[ns.model], "torch_dtype": "bfloat16"}
        t0 = time.perf_counter()
        write_random_checkpoint(folder, cfg, seed=0, std=0.02, with_tokenizer=False)
        print(f"wrote random {ns.model} checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        model = str(folder)
    else:
        model = ns.model
    ours = run_ours(model, prompts, outs, ns)
    results.append(ours)
    print(json.dumps(ours), flush=True)
    if ns.hf_peer:
        try:
            hf = run_hf(model, prompts, outs)
            results.append(hf)
            print(json.dumps(hf), flush=True)
            print(f"pagedserve / transformers output throughput: {ours['output_tok_per_s'] / hf['output_tok_per_s']:.1f}x")
        except Exception as e:  # report, do not hide, a failing peer
            print(f"transformers peer failed: {type(e).__name__}: {e}")
    print(f"{ns.model}: {ns.num_seqs} requests, {ours['output_tokens']} output tokens in {ours['seconds']:.2f} s = "
          f"{ours['output_tok_per_s']:.0f} output tok/s ({ours['steps']} steps, {ours['preemptions']} preemptions, "
          f"KV cache {ours['kv_cache_tokens']} tokens, peak {ours['peak_memory_gib']:.1f} GiB)")
    print(f"  steps with prompt tokens: {ours['prefill_steps']} taking {ours['prefill_step_seconds']:.2f} s; "
          f"decode-only: {ours['decode_steps']} taking {ours['decode_step_seconds']:.2f} s "
          f"({ours['decode_batch_mean']:.0f} requests a step on average; median "
          f"{ours['decode_ms_at_full_batch']:.2f} ms a step at the largest batch)")
    peak_flops, peak_bytes, preset = ours["floor_peaks"]
    print(f"  at the peaks of the {preset} ({peak_flops / 1e12:.0f} TFLOP/s, {peak_bytes / 1e12:.2f} TB/s), kernels "
          f"in series: projections {ours['floor_projection_seconds']:.1f} s, "
          f"decodes' K/V {ours['floor_decode_kv_seconds']:.1f} s, "
          f"prompts' attention {ours['floor_prompt_attention_seconds']:.1f} s; {ours['floor_seconds']:.1f} s in all "
          f"= {ours['output_tokens'] / ours['floor_seconds']:.0f} output tok/s at most, the run at "
          f"{100 * ours['floor_seconds'] / ours['seconds']:.0f} % of it; with reads and compute overlapped "
          f"{ours['floor_overlapped_seconds']:.1f} s = {ours['output_tokens'] / ours['floor_overlapped_seconds']:.0f} "
          "output tok/s at most")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_main(main)
