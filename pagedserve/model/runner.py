"""The model runner: one rank's model, KV cache and decode CUDA graphs. It turns a step's arrays
(``model.step``) into tensors, runs the forward pass and samples; start-up (memory profile, cache
allocation, graph capture, warm-up) is driven by the Worker, which owns it."""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.config import EngineConfig
from pagedserve.memory import GiB, kv_heads_per_rank
from pagedserve.model import parallel
from pagedserve.model.attention import AttentionBackend, AttentionMetadata, staged, to_device
from pagedserve.model.sampler import Penalties, SamplerOutput, SamplingBatch, sample, token_logprobs
from pagedserve.model.step import PenaltyInputs, SamplingInputs, StepInputs

logger = logging.getLogger(__name__)


@dataclass
class PendingSamples:
    """A launched step's samples on their way to the host: the copies are queued behind the step, and
    ``wait`` blocks only until they land (the one host sync of a step)."""

    samples: SamplerOutput | None  # host tensors (pinned) once the copies complete
    scores: SamplerOutput | None   # the scored prompt tokens' (prompt_logprobs), likewise
    done: torch.cuda.Event | None  # None on the CPU, where the step has already run

    @classmethod
    def start(cls, result: SamplerOutput | None, scores: SamplerOutput | None = None) -> PendingSamples:
        device = (result or scores).token_ids.device
        if device.type != "cuda":
            return cls(result, scores, None)
        host = [None if r is None else SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=True)
                                                       for t in r.fields())) for r in (result, scores)]
        done = torch.cuda.Event()
        done.record()
        return cls(*host, done)

    def wait(self) -> tuple[list[int], list | None, list | None, list | None, tuple[list, list, list] | None]:
        """(token ids, logprobs, logprob ids, ranks) as lists, and the scored prompt tokens' (logprobs,
        logprob ids, ranks) or None."""
        if self.done is not None:
            self.done.synchronize()
        samples = ([], None, None, None) if self.samples is None else \
            tuple(None if t is None else t.tolist() for t in self.samples.fields())
        scores = None if self.scores is None else tuple(t.tolist() for t in self.scores.fields()[1:])
        return (*samples, scores)


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph (the planner counts them too)."""
    top = min(max_num_seqs, 512)
    return sorted({b for b in [1, 2, 4, 8, *range(16, top + 1, 16)] if b <= top} | {top})


# Token counts of the steps with prompt tokens that replay a CUDA graph (padded up to the next size):
# launched kernel by kernel, such a step takes the host longer than the GPU up to a few hundred tokens
# (a small model's, up to thousands). Below 256 tokens padding is cheap (a step's projections cost the
# weights' read up to ~100 tokens); from 256 on, a padded token costs about what a real one does.
PROMPT_GRAPH_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256)


def graphs_captured(config) -> bool:
    """Whether the engine of ``config`` replays its steps as CUDA graphs (a CUDA device, the Triton
    attention backend, not --enforce-eager)."""
    return config.device.type == "cuda" and not config.args.enforce_eager and config.args.attention_backend != "torch"


def graph_sizes(config) -> tuple[list[int], list[int]]:
    """(the decode batches, the token counts of steps with prompt tokens) that the engine of ``config``
    replays as CUDA graphs, each padding a step up to its size; ([], []): every step is launched kernel by
    kernel."""
    if not graphs_captured(config):
        return [], []
    return decode_graph_sizes(config.max_num_seqs), prompt_graph_sizes(config.max_cudagraph_capture_size)


def prompt_graph_sizes(top: int) -> list[int]:
    """Token counts of the prompt-carrying steps that get a CUDA graph (the planner counts them too): the
    sizes above up to ``top`` (the config's capture size, never above the step's token budget), then an
    eighth of the power of two below each further size (288, 320, ..., 512, 576, ..., 1024, 1152, ...),
    ending at ``top``: a step over 256 tokens is padded by at most an eighth (a prompt chunk of 1,024 tokens
    beside a few decodes, by at most 12 %)."""
    sizes = [t for t in PROMPT_GRAPH_SIZES if t <= top]
    t = PROMPT_GRAPH_SIZES[-1]
    while t < top:
        t = min(top, t + (1 << (t.bit_length() - 1)) // 8)
        sizes.append(t)
    return sizes


# the 1-D StepInputs arrays a graph reads: name, dtype, and whether it has an entry a token (else one a
# sequence: an in-flight token belongs to one sequence, so the sequences bound those too)
_STEP_ARRAYS = (("ids", torch.int64, True), ("positions", torch.int64, True), ("slots", torch.int64, True),
                ("fill_rows", torch.int64, False), ("fill_from", torch.int64, False), ("seq_lens", torch.int32, False))


def step_fields(tokens: int, rows: int) -> list[tuple[str, torch.dtype, int]]:
    """The step arrays of a graph of ``tokens`` tokens over ``rows`` sequences: name, dtype and length."""
    return [(name, dtype, tokens if per_token else rows) for name, dtype, per_token in _STEP_ARRAYS]


class GraphInputs(Mapping[str, torch.Tensor]):
    """A CUDA graph's 1-D inputs as views of a device byte buffer, each field on its own 128-byte line (aligned
    as a separate allocation would be). Graphs replay one at a time, so graphs of different sizes lay their
    fields over the same buffer; a step writes its values and the padding into a host image of the bytes and
    uploads it with one copy."""

    ALIGN = 128

    def __init__(self, buffer: torch.Tensor, fields: list[tuple[str, torch.dtype, int]]):
        spans, end = self._layout(fields)
        self._buffer = buffer[:end]
        self._views = {name: self._buffer[a:b].view(dtype) for name, (a, b, dtype) in spans.items()}
        # the same spans for the host image, in numpy's dtypes
        self._spans = {name: (a, b, np.dtype(str(t).removeprefix("torch."))) for name, (a, b, t) in spans.items()}

    @classmethod
    def _layout(cls, fields: list[tuple[str, torch.dtype, int]]) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
        """Each field's (first byte, end, dtype), and the bytes of them all."""
        spans, at = {}, 0
        for name, dtype, n in fields:
            spans[name] = (at, at + n * dtype.itemsize, dtype)
            at = -(-(at + n * dtype.itemsize) // cls.ALIGN) * cls.ALIGN
        return spans, at

    @classmethod
    def nbytes(cls, fields: list[tuple[str, torch.dtype, int]]) -> int:
        return cls._layout(fields)[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def upload(self, values: dict[str, np.ndarray], pads: dict[str, int]) -> None:
        """Each field's values first, then its pad value (0 unless ``pads`` names another), in one copy."""
        image = np.zeros(len(self._buffer), dtype=np.uint8)
        for name, (a, b, dtype) in self._spans.items():
            field, v = image[a:b].view(dtype), values[name]
            field[:len(v)] = v
            if name in pads:
                field[len(v):] = pads[name]
        self._buffer.copy_(staged(image, self._buffer.device), non_blocking=True)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend):
        self.config, self.model, self.backend = config, model, backend
        self.device = config.device
        self.block_size = config.block_size
        self.num_kv_heads = kv_heads_per_rank(config.model, config.args.tensor_parallel_size)
        self.kv_caches: list[torch.Tensor] = []
        self.trash_slot = 0
        # the last launched step's sampled tokens, still on the device (later inputs are filled from them)
        self._last_tokens: torch.Tensor | None = None
        # decode-only steps by batch size, and steps with prompt tokens by padded token count: (replay, logits
        # or hidden states, the inputs it reads, the metadata whose device arrays it reads); a graph holds
        # only addresses, so these keep what they point at alive
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor, GraphInputs, AttentionMetadata]] = {}
        self._prompt_graphs: dict[int, tuple[Callable[[], None], torch.Tensor, GraphInputs, AttentionMetadata]] = {}
        self._graph_pool = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The cache, plus one block beyond the pool's: padded rows of a CUDA-graph batch write there."""
        m = self.config.model
        self.trash_slot = num_blocks * self.block_size
        shape = (2, num_blocks + 1, self.block_size, self.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.config.kv_dtype, device=self.device) for _ in range(m.num_layers)]

    # ------------------------------------------------------------------ memory

    @torch.inference_mode()
    def profile_run(self, non_torch_baseline: int) -> tuple[int, int]:
        """One forward pass over a full token budget plus sampling: (activation peak, non-torch memory it
        added beyond ``non_torch_baseline``)."""
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
        sample(logits, self._dummy_sampling(seqs, filtered=True, num_logprobs=self.config.max_logprobs))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device) - non_torch_baseline)
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
    def warm_up(self) -> None:
        """Run every kernel variant a step may choose once, at start-up, so that none is compiled while
        serving (a first Triton compile takes seconds): decode-only and mixed prefill + decode steps at
        each attention variant the backend can pick (decode graphs cover only their own batch sizes), and
        each sampler path. Every new token goes to the trash slot; nothing in the pool is touched."""
        t0 = time.perf_counter()
        dev = self.device
        # a decode-only step (its attention is a kernel of its own), a mixed one (request 0 prefills two
        # tokens, request 1 decodes one) and a prompt alone; all read block 0, which nobody owns yet
        variants = 0
        for query_lens in (np.array([1]), np.array([2, 1]), np.array([2])):
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
    def capture_decode_graphs(self, graphs: bool = True) -> None:
        """One graph per decode batch size; a step of B decodes replays the smallest graph >= B with
        the extra rows padded (sequence length 0, K/V written to the trash slot). ``graphs=False`` keeps
        the same padded steps but runs them kernel by kernel (how they are checked without CUDA graphs)."""
        t0 = time.perf_counter()
        free0 = self._free_memory(graphs)
        sizes = decode_graph_sizes(self.config.max_num_seqs)
        top, dev = sizes[-1], self.device
        # the 1-D inputs of every size share one device buffer, each graph its own layout of it
        self._decode_inputs = torch.zeros(GraphInputs.nbytes(step_fields(top, top)), dtype=torch.uint8, device=dev)
        self._decode_tables = torch.zeros((top, self.config.blocks_per_max_len_request), dtype=torch.int32, device=dev)
        starts = torch.arange(top + 1, dtype=torch.int32, device=dev)
        for bs in reversed(sizes):
            inputs = GraphInputs(self._decode_inputs, step_fields(bs, bs))
            segs = self.backend.decode_segments(bs, self.config.max_model_len)
            meta = AttentionMetadata(inputs["slots"], starts[:bs + 1], inputs["seq_lens"], self._decode_tables[:bs],
                                     1, self.config.max_model_len, np.ones(bs, dtype=np.int64),
                                     self.backend.make_state(dev, np.arange(bs), np.zeros((2, 0), np.int32), segs))

            def run(inputs=inputs, meta=meta):
                return self.model.compute_logits(self.model(inputs["ids"], inputs["positions"], self.kv_caches, meta))

            self._graphs[bs] = (*self._graphed(run, graphs), inputs, meta)
        used = free0 - self._free_memory(graphs)
        logger.info("Graph capturing finished in %.1f secs, took %.2f GiB (%d decode batch sizes up to %d)",
                    time.perf_counter() - t0, used / GiB, len(sizes), top)

    def _free_memory(self, graphs: bool) -> int:
        """Free device bytes once the work queued so far has run (0 where nothing is captured): read before
        and after a capture, the memory its graphs took."""
        if not graphs:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    def _graphed(self, run: Callable[[], torch.Tensor], graphs: bool) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, output) of ``run``: run once (compiling its kernels outside any capture), then captured in
        the shared graph pool; with ``graphs`` off, a replay runs it again into the first run's output."""
        out = run()
        if not graphs:
            return (lambda: out.copy_(run())), out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = run()
        self._graph_pool = graph.pool()
        return graph.replay, out

    def _replay_decode(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits of an all-decode step through a captured graph, or None if the step does not fit one."""
        n = len(inp.query_lens)
        bs = min((b for b in self._graphs if b >= n), default=None)
        if bs is None or not inp.decode_only:
            return None
        replay, logits, inputs, _ = self._graphs[bs]
        self._upload(inputs, inp, {}, self._decode_tables[:n])
        replay()
        return logits[:n]

    def _upload(self, inputs: GraphInputs, inp: StepInputs, values: dict[str, np.ndarray],
                tables: torch.Tensor) -> None:
        """A graph's inputs: the step's arrays and ``values`` in one copy (padding tokens' K/V to the trash
        slot; sequence rows past the step's start at its end, so they are empty), the block tables' columns
        in use in a second, then the in-flight tokens filled in."""
        inputs.upload({name: getattr(inp, name) for name, _, _ in _STEP_ARRAYS} | values,
                      {"slots": self.trash_slot, "starts": len(inp.ids)})
        tables[:, :inp.tables.shape[1]].copy_(staged(inp.tables, self.device), non_blocking=True)
        fills = self._fills(inp, inputs["fill_from"][:len(inp.fill_from)])
        if fills is not None:
            inputs["ids"].index_copy_(0, inputs["fill_rows"][:len(inp.fill_rows)], fills)

    @torch.inference_mode()
    def capture_prompt_graphs(self, graphs: bool = True) -> None:
        """One graph per size of ``prompt_graph_sizes``, for steps with prompt tokens (with or without
        decodes) over up to ``max_num_seqs`` sequences. Inputs live in fixed buffers: the step's tokens
        first, padding tokens after them (their K/V go to the trash slot), and one empty sequence row that
        the attention tiles a step does not use point at. ``graphs=False`` keeps the same padded steps
        but runs them kernel by kernel (how they are checked where CUDA graphs do not exist)."""
        sizes = prompt_graph_sizes(self.config.max_cudagraph_capture_size)
        if not sizes:
            return
        t0 = time.perf_counter()
        rows, top, dev = self.config.max_num_seqs, sizes[-1], self.device
        free0 = self._free_memory(graphs)
        self._prompt_inputs = torch.zeros(GraphInputs.nbytes(self._prompt_fields(rows, top)), dtype=torch.uint8,
                                          device=dev)
        self._prompt_tables = torch.zeros((rows + 1, self.config.blocks_per_max_len_request), dtype=torch.int32,
                                          device=dev)
        for size in reversed(sizes):
            inputs = GraphInputs(self._prompt_inputs, self._prompt_fields(rows, size))
            meta = AttentionMetadata(inputs["slots"], inputs["starts"], inputs["seq_lens"], self._prompt_tables, size,
                                     self.config.max_model_len, np.zeros(0, dtype=np.int64),
                                     self.backend.padded_state(inputs))

            def run(inputs=inputs, meta=meta):
                return self.model(inputs["ids"], inputs["positions"], self.kv_caches, meta)

            self._prompt_graphs[size] = (*self._graphed(run, graphs), inputs, meta)
        used = free0 - self._free_memory(graphs)
        logger.info("Captured %d graphs for steps with prompt tokens (up to %d tokens) in %.1f secs, took %.2f GiB",
                    len(sizes), top, time.perf_counter() - t0, used / GiB)

    def _prompt_fields(self, rows: int, size: int) -> list[tuple[str, torch.dtype, int]]:
        """A prompt graph's inputs: ``size`` tokens over up to ``rows`` sequences and one empty row, the
        sequences' starts, and the backend's tile arrays."""
        return [*step_fields(size, rows + 1), ("starts", torch.int32, rows + 2),
                *((name, torch.int32, n) for name, n in self.backend.padded_fields(rows, size))]

    def _replay_prompt(self, inp: StepInputs) -> torch.Tensor | None:
        """Hidden states of a step with prompt tokens through a captured graph, or None if it fits none."""
        n, rows = len(inp.ids), len(inp.query_lens)
        size = min((t for t in self._prompt_graphs if t >= n), default=None)
        if size is None or rows >= len(self._prompt_tables):  # more sequences than at capture (limits raised since)
            return None
        replay, hidden, inputs, meta = self._prompt_graphs[size]
        starts = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(inp.query_lens, out=starts[1:])
        self._upload(inputs, inp, {"starts": starts, **self.backend.fill_padded(meta.backend_state, inp.query_lens)},
                     self._prompt_tables[:rows])
        replay()
        return hidden[:n]

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

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

    def _fills(self, inp: StepInputs, fill_from: torch.Tensor | None = None) -> torch.Tensor | None:
        """The in-flight input tokens, gathered on the device from the previous step's samples (rank 0
        holds those and hands them to the other ranks); ``fill_from``: ``inp.fill_from`` already uploaded."""
        if not len(inp.fill_rows):
            return None
        if parallel.tp().rank == 0:
            fills = self._last_tokens[self._to_device(inp.fill_from) if fill_from is None else fill_from]
        else:
            fills = torch.empty(len(inp.fill_rows), dtype=torch.long, device=self.device)
        return parallel.broadcast_tensor(fills)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> tuple[torch.Tensor | None, SamplerOutput | None]:
        """Logits of the sampled rows (None if no row samples), and the scores of the prompt tokens it
        scores (prompt_logprobs). Every rank runs it on the same inputs."""
        logits = self._replay_decode(inp)
        if logits is not None:
            return logits, None
        hidden = self._replay_prompt(inp) if self._prompt_graphs else None
        if hidden is None:
            meta = self._metadata(self._to_device(inp.slots), inp.query_lens, inp.seq_lens, inp.tables)
            ids = self._to_device(inp.ids)
            fills = self._fills(inp)
            if fills is not None:
                ids = ids.index_copy(0, self._to_device(inp.fill_rows), fills)
            hidden = self.model(ids, self._to_device(inp.positions), self.kv_caches, meta)
        scores = self._score_prompt(hidden, inp) if len(inp.score_rows) else None
        if not len(inp.sample_rows):
            return None, scores
        return self.model.compute_logits(hidden[self._to_device(inp.sample_rows)]), scores

    def _score_prompt(self, hidden: torch.Tensor, inp: StepInputs) -> SamplerOutput:
        """Log-probabilities of prompt tokens from the positions before them, a slice of rows at a time:
        the full-vocabulary logits of a few rows at once fit the headroom the sampler was profiled with."""
        rows, targets = self._to_device(inp.score_rows), self._to_device(inp.score_targets)
        step = self.config.max_num_seqs
        parts = [token_logprobs(self.model.compute_logits(hidden[rows[i:i + step]]), targets[i:i + step], inp.score_top)
                 for i in range(0, len(rows), step)]
        return SamplerOutput(*(torch.cat(f) for f in zip(*(p.fields() for p in parts))))

    def execute(self, inp: StepInputs, sampling: SamplingInputs | None) -> PendingSamples | None:
        """Launch one step without waiting for it; its sampled tokens (one per sampling row) come back
        through the returned handle."""
        logits, scores = self.forward(inp)
        previous, self._last_tokens = self._last_tokens, None
        if logits is None:
            return None if scores is None else PendingSamples.start(None, scores)
        with torch.inference_mode():
            result = sample(logits, self.sampling_batch(sampling, previous))
        self._last_tokens = result.token_ids
        return PendingSamples.start(result, scores)

    def sampling_batch(self, s: SamplingInputs, previous: torch.Tensor | None = None) -> SamplingBatch:
        """The rows' parameters as device tensors: one upload for the table, one for the noise keys (and
        one for the penalized rows' tokens; ``previous``, the last step's samples, holds those in flight)."""
        if s.table is None:
            return SamplingBatch.greedy_only(s.num_logprobs)
        table, vocab = s.table, self.config.model.vocab_size
        rows = self._to_device(table)
        return SamplingBatch(
            temperature=rows[0], greedy=rows[1] > 0,
            top_k=rows[2].long() if (table[2] < vocab).any() else None,
            top_p=rows[3] if (table[3] < 1.0).any() else None,
            min_p=rows[4] if (table[4] > 0.0).any() else None,
            seeds=self._to_device(np.array(s.seeds, dtype=np.int64)), seed_list=s.seeds, all_greedy=False,
            num_logprobs=s.num_logprobs,
            penalties=None if s.penalties is None else self._penalties(s.penalties, previous),
            logit_bias=None if s.bias_index is None else (self._to_device(s.bias_index),
                                                          self._to_device(s.bias_values)),
            allowed=None if s.allowed_rows is None else (self._to_device(s.allowed_rows),
                                                         self._to_device(s.allowed_bitmask)))

    def _penalties(self, p: PenaltyInputs, previous: torch.Tensor | None) -> Penalties:
        tokens = self._to_device(p.tokens)
        if (p.in_flight >= 0).any():  # one more column: the newest token, still on the device
            at = self._to_device(p.in_flight)
            newest = torch.where(at >= 0, previous[at.clamp(min=0)], self.config.model.vocab_size)
            tokens = torch.cat([tokens, newest.unsqueeze(1)], 1)
        return Penalties(self._to_device(p.rows), self._to_device(p.values), tokens, self._to_device(p.num_prompt))
