"""``pagedserve plan``: the start-up memory budget without a GPU, with the engine's own formulas.

The engine measures the activation peak and non-torch memory with a profiling pass; the planner puts
estimates in their place (``activation_peak_estimate`` and the constants below, set from what the
engine logs at start-up on a GPU) and then runs the same ``compute_budget`` and the same
start-up checks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedserve.config import EngineArgs, EngineConfig
from pagedserve.memory import (GiB, MemoryBudget, activation_peak_estimate, compute_budget, dtype_bytes, dtype_name,
                               fit_context, fmt_bytes, weight_bytes)
from pagedserve.model.runner import graph_sizes

MiB = 2**20
# Total device memory as torch reports it (H200: what torch reported on one; the others: the totals
# nvidia-smi shows for those cards). Pass --gpu-memory for your exact card.
GPU_PRESETS: dict[str, int] = {
    "H200-141GB": int(139.80 * GiB),
    "H100-80GB": 81559 * MiB,
    "A100-80GB": 81920 * MiB,
    "A100-40GB": 40960 * MiB,
    "L40S": 46068 * MiB,
    "RTX-4090": 24564 * MiB,
}
# Spec-sheet peaks of each preset: dense 16-bit tensor FLOP/s (FP32 accumulate) and memory bandwidth in
# bytes/s. The simulator scales a calibration's step costs by their ratios to estimate another GPU.
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "H200-141GB": (989e12, 4.8e12),
    "H100-80GB": (989e12, 3.35e12),
    "A100-80GB": (312e12, 2.039e12),
    "A100-40GB": (312e12, 1.555e12),
    "L40S": (362e12, 0.864e12),
    "RTX-4090": (165e12, 1.008e12),
}
FP8_KV_GPUS = ("H200-141GB", "H100-80GB", "L40S", "RTX-4090")  # the fp8 kernels need Ada or Hopper
NON_TORCH_ESTIMATE = 256 * MiB       # cuBLAS/Triton workspaces, with room above what an H200 run logged
NCCL_ESTIMATE = 512 * MiB            # communication buffers per rank when tensor parallel
GRAPH_OVERHEAD_PER_SIZE = 8 * MiB   # what a captured graph holds beyond its output (logs: 4.6-7.5 MiB, 0.6B to 8B)
WORKSPACE_HEADROOM = GiB             # what CUDA context, allocator slack and spikes need beyond graphs


@dataclass
class Plan:
    model: str
    gpu: str | None
    tensor_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    max_model_len: int
    model_context: int  # the longest context the model reaches (its positions, a rope scaling, a sliding window)
    max_num_seqs: int
    max_num_batched_tokens: int
    budget: MemoryBudget
    cuda_graphs: int
    concurrency: dict[str, float]
    tied_embeddings: bool
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        b = self.budget
        out = {k: v for k, v in asdict(self).items() if k != "budget"}
        out["budget"] = {**asdict(b), "bytes_per_block": b.bytes_per_block, "kv_tokens": b.kv_tokens,
                         "requested": b.requested, "headroom": b.headroom}
        out["starts"] = not self.failures
        return out

    def table(self) -> str:
        b = self.budget
        rows = [("Model", f"{self.model} ({self.dtype}, KV cache {self.kv_cache_dtype})")]
        if b.device_total is not None:
            rows += [("GPU", f"{self.gpu or 'custom'}: {fmt_bytes(b.device_total)} each, tensor parallel "
                             f"{self.tensor_parallel_size}"),
                     (f"Budget (x{b.utilization})", f"{fmt_bytes(b.requested)} per GPU; headroom {fmt_bytes(b.headroom)}")]
        tied = " (tied embeddings counted once)" if self.tied_embeddings else ""
        kv = (f"{fmt_bytes(b.kv_cache_bytes)} = {b.num_blocks:,} blocks of {b.block_size} = {b.kv_tokens:,} tokens "
              f"({b.kv_source})" if b.kv_cache_bytes > 0 else
              f"0 GiB: weights, activations and non-torch memory exceed the budget by {fmt_bytes(-b.kv_cache_bytes)} "
              f"(see below)")
        rows += [
            ("Context", f"{self.max_model_len:,} tokens a request (max_model_len) of the model's {self.model_context:,}"),
            ("Weights", f"{fmt_bytes(b.weights)} per GPU{tied}"),
            ("Activation peak", f"{fmt_bytes(b.activation_peak)} for {self.max_num_batched_tokens} tokens, "
                                f"{self.max_num_seqs} sequences (estimate)"),
            ("Non-torch memory", f"{fmt_bytes(b.non_torch)} (estimate)"),
            ("KV per token / block", f"{b.bytes_per_token / 1024:.1f} KiB / {fmt_bytes(b.bytes_per_block)}"),
            ("KV cache", kv),
            ("CUDA graphs", f"{fmt_bytes(self.cuda_graphs)} (estimate; must fit in the headroom)"),
        ]
        rows += [(f"Max concurrency @ {k}", f"{v:.2f} requests") for k, v in self.concurrency.items()]
        width = max(len(r[0]) for r in rows) + 2
        lines = [f"{k:<{width}}{v}" for k, v in rows]
        lines += [f"FAILS AT START-UP: {f}" for f in self.failures]
        lines += [f"warning: {w}" for w in self.warnings]
        if not self.failures and not self.warnings:
            lines.append("ok: starts, and every configured sequence fits at these lengths.")
        return "\n".join(lines)


def gpu_total_memory(gpu: str | None, gpu_memory_gib: float | None) -> int | None:
    """Bytes of the GPU named by ``--gpu-memory`` GiB, else by preset ``gpu``; None when neither is given."""
    from pagedserve.errors import ConfigError

    if gpu is not None and gpu not in GPU_PRESETS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join(GPU_PRESETS)} or give --gpu-memory GiB.")
    if gpu_memory_gib is not None and not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise ConfigError(f"--gpu-memory {gpu_memory_gib}: give the GPU's memory in GiB, a number above 0.")
    return int(gpu_memory_gib * GiB) if gpu_memory_gib is not None else GPU_PRESETS[gpu] if gpu else None


def make_plan(args: EngineArgs, gpu: str | None = None, gpu_memory_gib: float | None = None,
              input_len: int | None = None, output_len: int | None = None,
              recorded: list[int] | None = None) -> Plan:
    """The memory budget of ``args`` on a GPU (a preset or a size), and the concurrency it holds at
    max_model_len, at ``input_len`` + ``output_len``, and at the p50 / p95 / largest context of
    ``recorded`` requests (their prompt + output tokens, from a ``--record-lengths`` file)."""
    from pagedserve.errors import ConfigError

    total = gpu_total_memory(gpu, gpu_memory_gib)
    on_gpu = total is not None
    if not on_gpu and args.kv_cache_memory is None and args.num_gpu_blocks_override is None:
        raise ConfigError("Give --gpu (a preset) or --gpu-memory GiB, or --kv-cache-memory for a CPU plan.")
    cfg: EngineConfig = args.create_config(plan_for="cuda" if on_gpu else "cpu")
    tp = args.tensor_parallel_size
    m = cfg.model
    non_torch = (NON_TORCH_ESTIMATE + (NCCL_ESTIMATE if tp > 1 else 0)) if on_gpu else 0
    budget = compute_budget(
        model=m, kv_dtype=cfg.kv_dtype, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
        weights=weight_bytes(m, cfg.dtype, tp),
        activation_peak=activation_peak_estimate(m, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.dtype, tp),
        non_torch=non_torch, device_total=total, utilization=args.gpu_memory_utilization if on_gpu else None,
        kv_cache_memory=cfg.kv_cache_memory, num_blocks_override=args.num_gpu_blocks_override, tp=tp)
    context = cfg.max_model_len
    cfg, budget = fit_context(cfg, budget)
    decode_graphs, prompt_graphs = graph_sizes(cfg)  # none on a CPU, with --enforce-eager or the torch backend
    # each graph keeps its output (a decode graph its logits, a prompt graph its hidden states) and a little of
    # its own; they share one pool, which holds the largest prompt graph's activations
    outputs = (sum(decode_graphs) * m.vocab_size + sum(prompt_graphs) * m.hidden_size) * dtype_bytes(cfg.dtype)
    pool = activation_peak_estimate(m, prompt_graphs[-1], 0, cfg.dtype, tp) if prompt_graphs else 0
    graphs = GRAPH_OVERHEAD_PER_SIZE * (len(decode_graphs) + len(prompt_graphs)) + outputs + pool
    lengths = {f"max_model_len {cfg.max_model_len}": cfg.max_model_len}
    if input_len or output_len:
        n = (input_len or 0) + (output_len or 0)
        lengths[f"{input_len or 0} in + {output_len or 0} out"] = n
    typical = None
    if recorded:
        p50, typical = (int(np.percentile(recorded, q)) for q in (50, 95))
        lengths.update({f"recorded p50, {p50} tokens": p50, f"recorded p95, {typical} tokens": typical,
                        f"recorded largest, {max(recorded)} tokens": max(recorded)})
    concurrency = {k: budget.max_concurrency(n) for k, n in lengths.items()}
    plan = Plan(args.model, gpu, tp, dtype_name(cfg.dtype), dtype_name(cfg.kv_dtype),
                cfg.max_model_len, m.context_limit()[0], cfg.max_num_seqs, cfg.max_num_batched_tokens, budget, graphs, concurrency,
                m.tie_word_embeddings, failures=budget.failures())
    if plan.failures:
        return plan
    if cfg.max_model_len < context:
        plan.warnings.append(f"--max-model-len auto: the KV cache holds {cfg.max_model_len:,} tokens, fewer than the "
                             f"model's context of {context:,}, so the context is {cfg.max_model_len:,} and one "
                             f"request of it fills the cache; a length of your own leaves room for more at once.")
    if on_gpu and budget.headroom < graphs + WORKSPACE_HEADROOM:
        safe = math.floor((1 - (graphs + WORKSPACE_HEADROOM) / total) * 100) / 100
        plan.warnings.append(
            f"headroom {fmt_bytes(budget.headroom)} is below the {fmt_bytes(graphs + WORKSPACE_HEADROOM)} that CUDA "
            f"graphs and workspaces need: peaks can OOM after start-up. Use --gpu-memory-utilization {safe} or lower "
            f"(or --enforce-eager to drop the graphs).")
    per_req = (input_len or 0) + (output_len or 0) or typical or cfg.max_model_len
    fit = math.floor(budget.max_concurrency(per_req))
    if cfg.max_num_seqs > fit:
        # what would let them all run: fewer of them; shorter requests where the length is the cap's; a
        # smaller cache format where the cache is not yet fp8
        remedies = [f"set --max-num-seqs {max(fit, 1)}"]
        if per_req == cfg.max_model_len:
            remedies.append("lower --max-model-len")
        if budget.kv_element_bytes > 1:
            remedies.append("use --kv-cache-dtype fp8")
        plan.warnings.append(
            f"--max-num-seqs {cfg.max_num_seqs} can never all run at {per_req} tokens per request: the KV cache "
            f"holds {fit}. Expect preemptions above {fit} running requests; {', '.join(remedies[:-1])}"
            f"{' or ' if len(remedies) > 1 else ''}{remedies[-1]}.")
    return plan
