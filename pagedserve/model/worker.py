"""The worker: one rank's start-up, in vLLM V1's order, and then its steps.

Start-up: the device (and its free memory against the budget), the tensor-parallel group (rank 0 starts
one process per other rank), the weights, the memory budget (a profiling pass measures the activation
peak on CUDA), the KV cache, the CUDA graphs (decode batches, and steps with prompt tokens up to a few
hundred tokens; captured after the cache, so they must fit in the headroom), a warm-up that compiles every kernel variant a step may choose, and a heap freeze. Then each
step's arrays go to the model runner (and, with tensor parallelism, to the other ranks first).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import os
import socket
import time

import torch
import torch.multiprocessing as mp

from pagedserve.config import EngineConfig
from pagedserve.memory import (GiB, MemoryBudget, activation_peak_estimate, check_free_memory, check_host_memory,
                               compute_budget, fit_context, host_memory_available, kv_heads_per_rank)
from pagedserve.model import parallel
from pagedserve.model.attention import AttentionBackend, TorchAttentionBackend
from pagedserve.model.cuda_gemv import CudaGemv
from pagedserve.model.layers import use_gemv
from pagedserve.model.loader import build_model
from pagedserve.model.runner import ModelRunner, PendingSamples, graphs_captured
from pagedserve.model.step import SamplingInputs, StepInputs

logger = logging.getLogger(__name__)


def attention_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> AttentionBackend:
    """auto: Triton kernels on CUDA, the torch reference elsewhere (the name is validated by the config)."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    from pagedserve.model.fused import sm_count
    from pagedserve.model.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, sm_count(device),
                                  TritonAttentionBackend.pdl_supported(device))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_GC_YOUNG_THRESHOLD = 7000  # ten times Python's default


def freeze_startup_heap() -> None:
    """Take what start-up made (imported modules: torch, Triton, the tokenizers; the model; the compiled
    kernels) out of the garbage collector's view, or every full collection walks it again while a step
    waits. Frozen objects are still freed when their last reference goes (an engine that is dropped frees
    its weights and cache); only reference cycles among them wait for the exit, where they are handed back
    so that the interpreter's last collection frees them (nanobind, under Triton, reports what it does not).

    Young collections then wait for ``_GC_YOUNG_THRESHOLD`` net new containers, not Python's 700: a step's
    objects die with it, so what crosses the threshold is mostly the live requests, and each collection it
    starts leads, every hundredth or so, to a full one that walks them all while the device waits."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, _GC_YOUNG_THRESHOLD), *older)
    atexit.unregister(gc.unfreeze)  # once, however many engines start
    atexit.register(gc.unfreeze)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, port: int | None = None):
        self.config = config
        self.device = config.device
        self.tp_size = config.args.tensor_parallel_size
        on_cuda = self.device.type == "cuda"
        if not on_cuda and rank == 0:
            check_host_memory(config, host_memory_available())
        self._ranks = self._start_group(rank, port)
        if on_cuda:
            torch.cuda.set_device(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            check_free_memory(free, total, config)
            self._device_total = total
            self._non_torch_baseline = (total - free) - torch.cuda.memory_reserved(self.device)

        m = config.model
        backend = attention_backend(config.args.attention_backend, self.device, m.num_heads // self.tp_size,
                                    kv_heads_per_rank(m, self.tp_size), m.head_dim)
        t0 = time.perf_counter()
        model = build_model(config, backend)
        use_gemv(model, CudaGemv.build(self.device) if on_cuda else None)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("Model loading took %.2f GiB memory and %.2f seconds",
                    self.weight_bytes / GiB, time.perf_counter() - t0)
        self.runner = ModelRunner(config, model, backend)

        self.budget = self._plan_memory()
        self.runner.allocate_kv_cache(self.budget.num_blocks)
        torch.manual_seed(config.args.seed)
        if graphs_captured(config):
            self.runner.capture_decode_graphs()
            self.runner.capture_prompt_graphs()
        self.runner.warm_up()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        freeze_startup_heap()

    def _start_group(self, rank: int, port: int | None) -> list:
        """With tensor parallelism, rank 0 starts one process per other rank; all join one group."""
        if self.tp_size == 1:
            return []
        ranks = []
        if rank == 0:
            port = _free_port()
            ctx = mp.get_context("spawn")
            ranks = [ctx.Process(target=worker_main, args=(self.config.args, r, self.tp_size, port),
                                 daemon=True, name=f"pagedserve-tp{r}") for r in range(1, self.tp_size)]
            for w in ranks:
                w.start()
        parallel.init_group(rank, self.tp_size, port, self.device)
        return ranks

    def _plan_memory(self) -> MemoryBudget:
        c = self.config
        common = dict(model=c.model, kv_dtype=c.kv_dtype, block_size=c.block_size,
                      max_model_len=c.max_model_len, weights=self.weight_bytes,
                      kv_cache_memory=c.kv_cache_memory, num_blocks_override=c.args.num_gpu_blocks_override)
        if self.device.type != "cuda":
            peak = activation_peak_estimate(c.model, c.max_num_batched_tokens, c.max_num_seqs, c.dtype, self.tp_size)
            budget = compute_budget(**common, activation_peak=peak, tp=self.tp_size)
        else:
            peak, non_torch = self.runner.profile_run(self._non_torch_baseline)
            budget = compute_budget(**common, activation_peak=peak, non_torch=non_torch, tp=self.tp_size,
                                    device_total=self._device_total, utilization=c.args.gpu_memory_utilization)
        # one scheduler drives every rank: all use the smallest rank's block count
        blocks = parallel.all_reduce_min(budget.num_blocks, self.device)
        fitted, budget = fit_context(c, dataclasses.replace(budget, num_blocks=blocks))
        if fitted.max_model_len < c.max_model_len:
            logger.warning("--max-model-len auto: the KV cache holds %d tokens, fewer than the model's context of %d; "
                           "serving a context of %d (one request of it fills the cache)", fitted.max_model_len,
                           c.max_model_len, fitted.max_model_len)
            self.config = self.runner.config = fitted
        return budget.check()

    def execute(self, inp: StepInputs, sampling: SamplingInputs | None) -> PendingSamples | None:
        """Launch one step on every rank (rank 0 hands the others its arrays) without waiting for it."""
        if self._ranks:
            dead = [w.name for w in self._ranks if not w.is_alive()]
            if dead:  # a collective with a dead rank would wait forever
                raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} exited; see their log above")
            parallel.broadcast_object(inp)
        return self.runner.execute(inp, sampling)

    def shutdown(self) -> None:
        """Stop the other ranks (rank 0 only; a no-op without tensor parallelism)."""
        if self._ranks:
            parallel.broadcast_object(None)
            for w in self._ranks:
                w.join(timeout=30)
            self._ranks = []
            parallel.destroy_group()

    def device_memory(self) -> tuple[int, int]:
        """(bytes in use now, peak bytes since the last ``reset_peak_memory``) of this engine's device
        memory: torch's reserved memory on CUDA, the process's resident memory on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device), torch.cuda.max_memory_reserved(self.device)
        status = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value, _ = line.split()
                    status[key] = int(value) * 1024
        return status["VmRSS:"], status["VmHWM:"]

    def reset_peak_memory(self) -> None:
        """Start a new peak window (Linux resets the resident-memory high-water mark through clear_refs)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # not permitted here: the peak stays the process's lifetime peak
            pass


def worker_main(args, rank: int, size: int, port: int) -> None:
    """A rank > 0: start up the same way, then run every step rank 0 broadcasts until it sends None."""
    if torch.cuda.is_available() and args.device in ("auto", "cuda"):
        torch.cuda.set_device(rank)
    config = args.create_config()
    worker = Worker(config, rank=rank, port=port)
    try:
        while True:
            inputs = parallel.broadcast_object()
            if inputs is None:
                break
            worker.runner.forward(inputs)
    finally:
        parallel.destroy_group()
        os._exit(0)  # skip interpreter teardown in a forked-off rank (no atexit hooks to run)
