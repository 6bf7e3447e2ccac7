"""The model runner: owns the weights and the KV tensors, sizes the cache, turns a scheduler step into
tensors, runs the forward pass and samples."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import math
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.memory import GiB, MemoryBudget, activation_peak_estimate, compute_budget, kv_heads_per_rank
from pagedserve.model import parallel
from pagedserve.model.attention import AttentionMetadata, get_attention_backend, staged, to_device
from pagedserve.model.cuda_gemv import CudaGemv
from pagedserve.model.layers import use_gemv
from pagedserve.model.loader import build_model
from pagedserve.model.sampler import SamplerOutput, SamplingBatch, sample

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PendingSamples:
    """A launched step's samples on their way to the host: the copies are queued behind the step, and
    ``wait`` blocks only until they land (the one host sync of a step)."""

    samples: SamplerOutput         # host tensors (pinned) once the copies complete
    done: torch.cuda.Event | None  # None on the CPU, where the step has already run

    @classmethod
    def start(cls, result: SamplerOutput) -> PendingSamples:
        if result.token_ids.device.type != "cuda":
            return cls(result, None)
        host = SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in result.fields()))
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def wait(self) -> tuple[list[int], list | None, list | None, list | None]:
        """(token ids, logprobs, logprob ids, ranks) as lists."""
        if self.done is not None:
            self.done.synchronize()
        return tuple(None if t is None else t.tolist() for t in self.samples.fields())


_SEED_MASK = (1 << 63) - 1  # noise keys are non-negative int64
# a temperature this high already samples uniformly at float32 precision; larger ones would overflow it
_MAX_TEMPERATURE = 1e6


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph (the planner counts them too)."""
    top = min(max_num_seqs, 512)
    return sorted({b for b in [1, 2, 4, 8, *range(16, top + 1, 16)] if b <= top} | {top})


@dataclass
class StepInputs:
    """One step as arrays: what rank 0 broadcasts to the other tensor-parallel ranks."""

    ids: np.ndarray          # [T] int64
    positions: np.ndarray    # [T] int64
    slots: np.ndarray        # [T] int64
    query_lens: np.ndarray   # [B] int64
    seq_lens: np.ndarray     # [B] int32
    tables: np.ndarray       # [B, W] int32
    sample_rows: np.ndarray  # [S] int64: rows of the batch whose logits are sampled
    fill_rows: np.ndarray    # [F] int64: entries of ``ids`` whose token the previous step is sampling ...
    fill_from: np.ndarray    # [F] int64: ... and the row of that step's sampled tokens that holds it

    @property
    def decode_only(self) -> bool:
        return bool((self.query_lens == 1).all()) and len(self.sample_rows) == len(self.query_lens)


def _freeze_startup_heap() -> None:
    """Take what start-up made (imported modules: torch, Triton, the tokenizers; the model; the compiled
    kernels) out of the garbage collector's view, or every full collection walks it again while a step
    waits. On the H200 such collections stalled an 8B run's device for 100-170 ms every ~370 steps with
    nothing frozen, and 30-64 ms every ~130 steps with only the imports frozen; on the CPU one took 285 ms.
    Frozen objects are still freed when their last reference goes (an engine that is dropped frees its
    weights and cache); only reference cycles among them wait for the exit, where they are handed back so
    that the interpreter's last collection frees them (nanobind, under Triton, reports what it does not)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines start
    atexit.register(gc.unfreeze)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, port: int | None = None):
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.tp_size = config.args.tensor_parallel_size
        self._workers = self._start_group(rank, port)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            requested = total * config.args.gpu_memory_utilization
            if config.kv_cache_memory is None and free < requested:
                raise ConfigError(
                    f"Free memory on the device ({free / GiB:.2f}/{total / GiB:.2f} GiB) at start-up is less than "
                    f"the budget --gpu-memory-utilization {config.args.gpu_memory_utilization} asks for "
                    f"({requested / GiB:.2f} GiB). Lower --gpu-memory-utilization or free memory used by "
                    f"other processes.")
            self._device_total = total
            self._non_torch_baseline = (total - free) - torch.cuda.memory_reserved(self.device)

        m = config.model
        self.num_kv_heads = kv_heads_per_rank(m, self.tp_size)
        self.backend = get_attention_backend(config.args.attention_backend, self.device,
                                             m.num_heads // self.tp_size, self.num_kv_heads, m.head_dim)
        t0 = time.perf_counter()
        self.model = build_model(config, self.backend)
        use_gemv(self.model, CudaGemv.build(self.device) if on_cuda else None)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("Model loading took %.2f GiB memory and %.2f seconds",
                    self.weight_bytes / GiB, time.perf_counter() - t0)

        self.budget = self._plan_memory()
        # one block beyond the pool's: padded rows of a CUDA-graph batch write their K/V there
        self.trash_slot = self.budget.num_blocks * self.block_size
        shape = (2, self.budget.num_blocks + 1, self.block_size, self.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=config.kv_dtype, device=self.device) for _ in range(m.num_layers)]
        # noise keys of unseeded sampled rows: (engine seed, step, row)
        self._seed_base = config.args.seed
        self._num_sampling_steps = 0
        # the last launched step's sampled tokens, still on the device, and each request's row in them
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        torch.manual_seed(config.args.seed)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        if on_cuda and self.backend.name == "triton" and not config.args.enforce_eager:
            self._capture_decode_graphs()
        self._warm_up()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        _freeze_startup_heap()

    def _start_group(self, rank: int, port: int | None) -> list:
        """With tensor parallelism, rank 0 starts one process per other rank; all join one group."""
        if self.tp_size == 1:
            return []
        workers = []
        if rank == 0:
            port = _free_port()
            ctx = mp.get_context("spawn")
            workers = [ctx.Process(target=parallel.worker_main, args=(self.config.args, r, self.tp_size, port),
                                   daemon=True, name=f"pagedserve-tp{r}") for r in range(1, self.tp_size)]
            for w in workers:
                w.start()
        parallel.init_group(rank, self.tp_size, port, self.device)
        return workers

    def shutdown(self) -> None:
        """Stop the other ranks (rank 0 only; a no-op without tensor parallelism)."""
        if self._workers:
            parallel.broadcast_object(None)
            for w in self._workers:
                w.join(timeout=30)
            self._workers = []
            parallel.destroy_group()

    # ------------------------------------------------------------------ memory

    def _plan_memory(self) -> MemoryBudget:
        c = self.config
        common = dict(model=c.model, kv_dtype=c.kv_dtype, block_size=self.block_size,
                      max_model_len=c.max_model_len, weights=self.weight_bytes,
                      kv_cache_memory=c.kv_cache_memory, num_blocks_override=c.args.num_gpu_blocks_override)
        if self.device.type != "cuda":
            peak = activation_peak_estimate(c.model, c.max_num_batched_tokens, c.max_num_seqs, c.dtype, self.tp_size)
            budget = compute_budget(**common, activation_peak=peak, tp=self.tp_size)
        else:
            peak, non_torch = self._profile_run()
            budget = compute_budget(**common, activation_peak=peak, non_torch=non_torch, tp=self.tp_size,
                                    device_total=self._device_total, utilization=c.args.gpu_memory_utilization)
        # one scheduler drives every rank: all use the smallest rank's block count
        blocks = parallel.all_reduce_min(budget.num_blocks, self.device)
        return dataclasses.replace(budget, num_blocks=blocks).check()

    @torch.inference_mode()
    def _profile_run(self) -> tuple[int, int]:
        """One forward pass over a full token budget plus sampling, to measure the activation peak."""
        c = self.config
        tokens = c.max_num_batched_tokens
        # as many dummy requests as the step may hold, but none longer than max_model_len
        seqs = max(min(c.max_num_seqs, tokens), -(-tokens // c.max_model_len))
        lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
        blocks = [math.ceil(n / self.block_size) for n in lens]
        m = c.model
        scratch = [torch.zeros((2, sum(blocks), self.block_size, self.num_kv_heads, m.head_dim),
                               dtype=c.kv_dtype, device=self.device) for _ in range(m.num_layers)]
        tables, first = [], 0
        for b in blocks:
            tables.append(list(range(first, first + b)))
            first += b
        ids = torch.randint(0, m.vocab_size, (tokens,), device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        slots = torch.cat([torch.tensor(t).repeat_interleave(self.block_size)[:n] * self.block_size
                           + torch.arange(n) % self.block_size for t, n in zip(tables, lens)]).to(self.device)
        width = max(blocks)
        meta = self._metadata(slots, np.asarray(lens), np.asarray(lens, dtype=np.int32),
                              np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        hidden = self.model(ids, positions, scratch, meta)
        last = torch.tensor(np.cumsum(lens) - 1, device=self.device)
        logits = self.model.compute_logits(hidden[last])
        sample(logits, self._dummy_sampling(seqs, filtered=True, num_logprobs=5))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device) - self._non_torch_baseline)
        del hidden, logits, scratch, meta
        gc.collect()
        torch.cuda.empty_cache()
        return peak, non_torch

    def _dummy_sampling(self, rows: int, filtered: bool, num_logprobs: int = -1) -> SamplingBatch:
        """Non-greedy sampling parameters for ``rows`` rows: temperature only, or with top-k/top-p/min-p too."""
        dev = self.device
        ones = torch.ones(rows, device=dev)
        return SamplingBatch(ones * 0.7, torch.zeros(rows, dtype=torch.bool, device=dev),
                             torch.full((rows,), 50, device=dev) if filtered else None,
                             ones * 0.9 if filtered else None, ones * 0.05 if filtered else None,
                             torch.arange(rows, device=dev), list(range(rows)), False, num_logprobs)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run every kernel variant a step may choose once, at start-up, so that none is compiled while
        serving (a first Triton compile takes seconds): decode-only and mixed prefill + decode steps at
        each attention variant the backend can pick (decode graphs cover only their own batch sizes), and
        each sampler path. Every new token goes to the trash slot; nothing in the pool is touched."""
        t0 = time.perf_counter()
        dev = self.device
        # a decode-only step (its attention is a kernel of its own), then a mixed one (request 0 prefills
        # two tokens, request 1 decodes one); all read block 0, which nobody owns yet
        variants = 0
        for query_lens in (np.array([1]), np.array([2, 1])):
            n = int(query_lens.sum())
            slots = torch.full((n,), self.trash_slot, dtype=torch.long, device=dev)
            meta = self._metadata(slots, query_lens, np.full(len(query_lens), 2, dtype=np.int32),
                                  np.zeros((len(query_lens), 1), dtype=np.int32))
            ids = torch.zeros(n, dtype=torch.long, device=dev)
            positions = torch.tensor(np.concatenate([np.arange(2 - q, 2) for q in query_lens]), device=dev)
            for _ in self.backend.variants(meta, self.config.max_model_len):
                hidden = self.model(ids, positions, self.kv_caches, meta)
                variants += 1
        logits = self.model.compute_logits(hidden[1:])
        sample(logits, SamplingBatch.greedy_only())
        for filtered in (False, True):
            sample(logits, self._dummy_sampling(2, filtered))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        logger.info("Warm-up ran %d attention variant(s) and the sampler in %.1f secs", variants,
                    time.perf_counter() - t0)

    # ------------------------------------------------------------------ CUDA graphs for decode

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        """One graph per decode batch size; a step of B decodes replays the smallest graph >= B with
        the extra rows padded (sequence length 0, K/V written to the trash slot)."""
        t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        sizes = decode_graph_sizes(self.config.max_num_seqs)
        top, dev = sizes[-1], self.device
        width = self.config.blocks_per_max_len_request
        self._static = {
            "ids": torch.zeros(top, dtype=torch.long, device=dev),
            "pos": torch.zeros(top, dtype=torch.long, device=dev),
            "slots": torch.full((top,), self.trash_slot, dtype=torch.long, device=dev),
            "seq_lens": torch.zeros(top, dtype=torch.int32, device=dev),
            "starts": torch.arange(top + 1, dtype=torch.int32, device=dev),
            "tables": torch.zeros((top, width), dtype=torch.int32, device=dev),
        }
        st = self._static
        pool = None
        for bs in reversed(sizes):
            segs = self.backend.decode_segments(bs, self.config.max_model_len)
            meta = AttentionMetadata(st["slots"][:bs], st["starts"][:bs + 1], st["seq_lens"][:bs], st["tables"][:bs],
                                     1, self.config.max_model_len, np.ones(bs, dtype=np.int64),
                                     self.backend.make_state(dev, np.arange(bs), [], segs))
            def run(bs=bs, meta=meta):
                return self.model.compute_logits(self.model(st["ids"][:bs], st["pos"][:bs], self.kv_caches, meta))

            run()  # warm-up: compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = run()
            pool = graph.pool()
            self._graphs[bs] = (graph, logits, meta)
        torch.cuda.synchronize(dev)
        used = free0 - torch.cuda.mem_get_info(dev)[0]
        logger.info("Graph capturing finished in %.1f secs, took %.2f GiB (%d decode batch sizes up to %d)",
                    time.perf_counter() - t0, used / GiB, len(sizes), top)

    def _replay_decode(self, inp: StepInputs, fills: torch.Tensor | None) -> torch.Tensor | None:
        """Logits of an all-decode step through a captured graph, or None if the step does not fit one."""
        n = len(inp.query_lens)
        bs = min((b for b in self._graphs if b >= n), default=None)
        if bs is None or not inp.decode_only:
            return None
        st = self._static
        for key, a in (("ids", inp.ids), ("pos", inp.positions), ("slots", inp.slots), ("seq_lens", inp.seq_lens)):
            st[key][:n].copy_(staged(a, self.device), non_blocking=True)
        st["tables"][:n, :inp.tables.shape[1]].copy_(staged(inp.tables, self.device), non_blocking=True)
        st["slots"][n:bs].fill_(self.trash_slot)
        st["seq_lens"][n:bs].zero_()
        if fills is not None:
            st["ids"].index_copy_(0, self._to_device(inp.fill_rows), fills)
        graph, logits, _ = self._graphs[bs]
        graph.replay()
        return logits[:n]

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

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

    # ------------------------------------------------------------------ a step

    def _metadata(self, slots: torch.Tensor, query_lens: np.ndarray, seq_lens: np.ndarray,
                  tables: np.ndarray) -> AttentionMetadata:
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=self._to_device(starts), seq_lens=self._to_device(seq_lens),
            block_tables=self._to_device(tables),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()), query_lens_cpu=query_lens)
        self.backend.prepare(meta, self.block_size)
        return meta

    def prepare(self, out: SchedulerOutput, pool: BlockPool) -> StepInputs:
        """The step's token ids, positions, cache slots and block tables as arrays (one Python pass over
        the requests; tables come pre-laid-out from the pool). A request's input that the previous step
        is still sampling gets a placeholder and an entry in ``fill_rows``/``fill_from``."""
        bs, items = self.block_size, out.scheduled
        n = len(items)
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=n)
        query_lens = np.fromiter((it.num_tokens for it in items), dtype=np.int64, count=n)
        tables = pool.stacked_tables([it.request.request_id for it in items])
        ids: list[int] = []
        fill_rows, fill_from = [], []
        for it in items:
            known = it.request.all_token_ids
            end = it.start + it.num_tokens
            ids.extend(known[it.start:end])
            if end > len(known):  # only the last input can be in flight (one step runs at a time)
                fill_rows.append(len(ids))
                fill_from.append(self._last_rows[it.request.request_id])
                ids.append(0)
        if (query_lens == 1).all():  # decode steps: one token each, at position start
            pos, rows = starts, np.arange(n)
        else:
            rows = np.repeat(np.arange(n), query_lens)
            pos = np.arange(len(rows)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens) + starts[rows]
        slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        ends = np.cumsum(query_lens) - 1
        samples = np.fromiter((it.samples for it in items), dtype=bool, count=n)
        return StepInputs(np.asarray(ids, dtype=np.int64), pos, slots, query_lens,
                          (starts + query_lens).astype(np.int32), np.ascontiguousarray(tables), ends[samples],
                          np.asarray(fill_rows, dtype=np.int64), np.asarray(fill_from, dtype=np.int64))

    def _fills(self, inp: StepInputs) -> torch.Tensor | None:
        """The in-flight input tokens, gathered on the device from the previous step's samples (rank 0
        holds those and hands them to the other ranks)."""
        if not len(inp.fill_rows):
            return None
        if parallel.tp().rank == 0:
            fills = self._last_tokens[self._to_device(inp.fill_from)]
        else:
            fills = torch.empty(len(inp.fill_rows), dtype=torch.long, device=self.device)
        return parallel.broadcast_tensor(fills)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits of the sampled rows (None if no row samples). Every rank runs it on the same inputs."""
        fills = self._fills(inp)
        logits = self._replay_decode(inp, fills)
        if logits is not None:
            return logits
        meta = self._metadata(self._to_device(inp.slots), inp.query_lens, inp.seq_lens, inp.tables)
        ids = self._to_device(inp.ids)
        if fills is not None:
            ids = ids.index_copy(0, self._to_device(inp.fill_rows), fills)
        hidden = self.model(ids, self._to_device(inp.positions), self.kv_caches, meta)
        if not len(inp.sample_rows):
            return None
        return self.model.compute_logits(hidden[self._to_device(inp.sample_rows)])

    def execute(self, out: SchedulerOutput, pool: BlockPool) -> PendingSamples | None:
        """Launch one scheduled step without waiting for it; its sampled tokens (one per request whose
        ``samples`` is set) come back through the returned handle."""
        inp = self.prepare(out, pool)
        if self._workers:
            dead = [w.name for w in self._workers if not w.is_alive()]
            if dead:  # a collective with a dead rank would wait forever
                raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} exited; see their log above")
            parallel.broadcast_object(inp)
        logits = self.forward(inp)
        self._last_tokens, self._last_rows = None, {}
        if logits is None:
            return None
        sampled = [it.request for it in out.scheduled if it.samples]
        with torch.inference_mode():
            result = sample(logits, self._sampling_batch(sampled))
        self._last_tokens = result.token_ids
        self._last_rows = {r.request_id: row for row, r in enumerate(sampled)}
        return PendingSamples.start(result)

    def _sampling_batch(self, params: list[Request]) -> SamplingBatch:
        """Per-row sampling parameters of the requests that sample this step, in row order."""
        sp = [r.sampling_params for r in params]
        num_logprobs = max((p.logprobs for p in sp if p.logprobs is not None), default=-1)
        if all(p.greedy for p in sp):  # the common benchmark case: no per-row tensors to build
            return SamplingBatch.greedy_only(num_logprobs)
        vocab = self.config.model.vocab_size
        # rows: temperature (1 for greedy rows), greedy, top-k (vocab when off), top-p, min-p; one upload
        table = np.array([(1.0 if p.greedy else min(p.temperature, _MAX_TEMPERATURE), p.greedy,
                           p.top_k if 0 < p.top_k < vocab else vocab,
                           p.top_p, p.min_p) for p in sp], dtype=np.float32).T
        rows = self._to_device(table)
        # a seeded request's noise is keyed by (its seed, the index of the token being sampled): the same
        # token gets the same noise whatever the batch, and again when it is recomputed after preemption
        self._num_sampling_steps += 1
        step = (self._seed_base, self._num_sampling_steps)
        seeds = [hash((p.seed, r.num_tokens_with_pending) if p.seed is not None else (*step, i)) & _SEED_MASK
                 for i, (r, p) in enumerate(zip(params, sp))]
        return SamplingBatch(
            temperature=rows[0], greedy=rows[1] > 0,
            top_k=rows[2].long() if (table[2] < vocab).any() else None,
            top_p=rows[3] if (table[3] < 1.0).any() else None,
            min_p=rows[4] if (table[4] > 0.0).any() else None,
            seeds=self._to_device(np.array(seeds, dtype=np.int64)), seed_list=seeds, all_greedy=False,
            num_logprobs=num_logprobs)
