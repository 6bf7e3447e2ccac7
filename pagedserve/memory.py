"""The memory budget: weights, activations, KV cache, headroom.

One implementation serves the engine at start-up (fed with measured numbers) and the planner (fed with
the estimates below), so the two can never disagree on the arithmetic.

    budget   = device_total x gpu_memory_utilization
    kv_bytes = budget - weights - activation_peak - non_torch      (or --kv-cache-memory, if given)
    blocks   = kv_bytes // (block_size x kv_bytes_per_token)
    headroom = device_total - budget                               (CUDA graphs, workspaces, spikes)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pagedserve.config import ConfigError, ModelConfig

GiB = 2**30


def fmt_bytes(n: int | float) -> str:
    """GiB with two decimals, or MiB below one GiB (the tiny model's numbers stay readable)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.2f} MiB"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``, as the flags and reports spell dtypes."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    """KV heads split across ranks; replicated when there are fewer heads than ranks."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelConfig, kv_dtype: torch.dtype, tp: int = 1) -> int:
    """K and V, every layer, one rank."""
    return 2 * model.num_layers * kv_heads_per_rank(model, tp) * model.head_dim * dtype_bytes(kv_dtype)


def weight_bytes(model: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Weights on one rank (tied embeddings counted once; norms are negligible and split too)."""
    return math.ceil(model.num_params() / tp) * dtype_bytes(dtype)


def activation_peak_estimate(model: ModelConfig, num_tokens: int, num_seqs: int, dtype: torch.dtype,
                             tp: int = 1) -> int:
    """Peak activation bytes of one forward pass over ``num_tokens`` tokens plus sampling ``num_seqs``
    rows: the MLP holds x, the residual, gate|up and silu(gate)*up per token (a mixture of experts, those of
    each expert a token takes, and its rows in and out of them); the sampler holds the logits in the model dtype
    and three float32 copies (logits, probabilities, noise)."""
    b = dtype_bytes(dtype)
    expert_rows = 2 * model.experts_per_token * model.hidden_size if model.sparse_layers else 0
    per_token = (2 * model.hidden_size + 3 * model.mlp_rows_width // tp + expert_rows) * b
    sampler = num_seqs * model.vocab_size * (b + 3 * 4)
    return num_tokens * per_token + sampler


@dataclass(frozen=True)
class MemoryBudget:
    kv_source: str                 # gpu_memory_utilization | kv_cache_memory | num_gpu_blocks_override
    device_total: int | None       # bytes; None on CPU
    utilization: float | None
    weights: int
    activation_peak: int
    non_torch: int
    kv_cache_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_element_bytes: int          # 1: an fp8 cache, which cannot be halved again

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def requested(self) -> int | None:
        return None if self.device_total is None else int(self.device_total * self.utilization)

    @property
    def headroom(self) -> int | None:
        return None if self.device_total is None else self.device_total - self.requested

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, tokens_per_request: int | None = None) -> float:
        """How many requests of this many tokens (default max_model_len) fit in the cache at once."""
        tokens = tokens_per_request or self.max_model_len
        return self.num_blocks / math.ceil(tokens / self.block_size)

    def failures(self) -> list[str]:
        """Why this budget would not start, in the order the engine checks (empty: it starts)."""
        if self.kv_source == "gpu_memory_utilization":
            if self.weights > self.requested:
                return [weights_over_budget(self.weights, self.utilization, self.device_total)]
            if self.kv_cache_bytes < self.bytes_per_block:
                return [f"No memory left for the KV cache: weights {fmt_bytes(self.weights)} + activation peak "
                        f"{fmt_bytes(self.activation_peak)} + non-torch {fmt_bytes(self.non_torch)} leave "
                        f"{fmt_bytes(self.kv_cache_bytes)} of the {fmt_bytes(self.requested)} budget. Lower "
                        f"--max-num-batched-tokens (the activation peak grows with it) or raise --gpu-memory-utilization."]
        need_blocks = math.ceil(self.max_model_len / self.block_size)
        if self.num_blocks < need_blocks:
            fits = self.num_blocks * self.block_size
            shorter = f"Lower --max-model-len to at most {fits:,} (auto picks that), or give" if fits else "Give"
            more = "more memory (--gpu-memory-utilization / --kv-cache-memory)"
            return [f"The KV cache holds {fits:,} tokens ({self.num_blocks:,} blocks of {self.block_size}, "
                    f"{fmt_bytes(self.kv_cache_bytes)}), but one request of max_model_len={self.max_model_len:,} needs "
                    f"{need_blocks:,} blocks ({fmt_bytes(need_blocks * self.bytes_per_block)}). {shorter} the cache "
                    + (f"{more}, or halve its size per token with --kv-cache-dtype fp8." if self.kv_element_bytes > 1
                       else f"{more}.")]
        return []

    def check(self) -> "MemoryBudget":
        """Raise ``ConfigError`` (numbers and the flag to change) if this budget cannot start."""
        problems = self.failures()
        if problems:
            raise ConfigError(problems[0])
        return self

    def report_lines(self) -> list[str]:
        lines = []
        if self.device_total is not None:
            lines.append(f"Device memory: {fmt_bytes(self.device_total)} total; budget {fmt_bytes(self.requested)} "
                         f"(gpu_memory_utilization={self.utilization}); headroom {fmt_bytes(self.headroom)}")
        lines += [
            f"Model weights: {fmt_bytes(self.weights)}",
            f"Activation peak: {fmt_bytes(self.activation_peak)}; non-torch memory: {fmt_bytes(self.non_torch)}",
            f"Available KV cache memory: {fmt_bytes(self.kv_cache_bytes)} (from {self.kv_source}); "
            f"{self.bytes_per_token / 1024:.1f} KiB per token, {self.num_blocks:,} blocks of {self.block_size} tokens",
            f"KV cache size: {self.kv_tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency():.2f}x",
        ]
        return lines


def compute_budget(*, model: ModelConfig, kv_dtype: torch.dtype, block_size: int, max_model_len: int,
                   weights: int, activation_peak: int, non_torch: int = 0, device_total: int | None = None,
                   utilization: float | None = None, kv_cache_memory: int | None = None,
                   num_blocks_override: int | None = None, tp: int = 1) -> MemoryBudget:
    """Split the memory (no checks: ``MemoryBudget.failures`` says what would not start)."""
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    per_block = per_token * block_size
    if num_blocks_override is not None:
        source, kv_bytes = "num_gpu_blocks_override", num_blocks_override * per_block
    elif kv_cache_memory is not None:
        source, kv_bytes = "kv_cache_memory", kv_cache_memory
    elif device_total is None or utilization is None:
        raise ConfigError("The KV cache size needs --kv-cache-memory (bytes) or --num-gpu-blocks-override on CPU.")
    else:
        source = "gpu_memory_utilization"
        kv_bytes = int(device_total * utilization) - weights - activation_peak - non_torch
    return MemoryBudget(source, device_total, utilization, weights, activation_peak, non_torch, kv_bytes,
                        per_token, block_size, max(0, kv_bytes // per_block), max_model_len, dtype_bytes(kv_dtype))


def fit_context(config, budget: MemoryBudget):
    """(config, budget) with --max-model-len auto resolved: the model's context where one request of it fits in the
    cache, else what the whole cache holds (the longest that can run at all); as given otherwise."""
    if not config.fit_to_cache or budget.num_blocks == 0 or budget.kv_tokens >= config.max_model_len:
        return config, budget
    fitted = budget.kv_tokens
    return dataclasses.replace(config, max_model_len=fitted), dataclasses.replace(budget, max_model_len=fitted)


_SMALLER = "use a smaller --dtype, shard with --tensor-parallel-size, or pick a smaller model"


def weights_over_budget(weights: int, utilization: float, device_total: int) -> str:
    """Why weights larger than the budget cannot start, and what to change."""
    need, budget = weights / device_total, int(device_total * utilization)
    return (f"Model weights need {fmt_bytes(weights)} but the budget is only {fmt_bytes(budget)} "
            f"(--gpu-memory-utilization {utilization} of {fmt_bytes(device_total)}). "
            + (f"The weights alone need a utilization above {need:.2f}" if need < 1 else
               "They are larger than the whole device") + f": {_SMALLER}.")


def check_free_memory(free: int, total: int, config) -> None:
    """At start-up, before the weights load: the device must have the budget free (what other processes hold
    is not ours to take), and the weights must fit in it (else the load would end in an out-of-memory error
    part way), or, with the KV cache sized in bytes, in what is free."""
    utilization = config.args.gpu_memory_utilization
    requested = total * utilization
    weights = weight_bytes(config.model, config.dtype, config.args.tensor_parallel_size)
    if config.kv_cache_memory is None and free < requested:
        raise ConfigError(
            f"Free memory on the device ({free / GiB:.2f}/{total / GiB:.2f} GiB) at start-up is less than the "
            f"budget --gpu-memory-utilization {utilization} asks for ({requested / GiB:.2f} GiB). Lower "
            f"--gpu-memory-utilization or free memory used by other processes.")
    if config.kv_cache_memory is None and config.args.num_gpu_blocks_override is None:  # the budget sizes the cache
        if weights > requested:
            raise ConfigError(weights_over_budget(weights, utilization, total))
    elif weights > free:
        raise ConfigError(f"Model weights need {fmt_bytes(weights)} but the device has {fmt_bytes(free)} free: "
                          f"{_SMALLER}.")


def check_host_memory(config, available: int | None) -> None:
    """On the CPU the weights (of every rank) live in the machine's memory: weights larger than what is
    ``available`` (None: unknown) fail before the load, not as an allocation error or a killed process."""
    weights = weight_bytes(config.model, config.dtype)
    if available is not None and weights > available:
        raise ConfigError(
            f"Model weights need {fmt_bytes(weights)} ({dtype_name(config.dtype)}) but this machine has "
            f"{fmt_bytes(available)} of memory available: "
            + ("--dtype bfloat16 halves them, or " if dtype_bytes(config.dtype) > 2 else "")
            + "pick a smaller model, or run on a GPU.")


def host_memory_available() -> int | None:
    """Bytes of memory the kernel reports available to a new process (Linux's MemAvailable; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
