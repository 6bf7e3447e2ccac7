"""Whether a batch of decodes and a chunk of prompt tokens run faster side by side than as one batch.

A decode's attention reads its K/V from HBM while a prompt chunk's projections are bound by the tensor
cores, so two batches on two CUDA streams could each hide the other's time; the engine today runs a step's
decodes and prompt tokens as one batch, layer by layer, attention after projections. On the first
``--layers`` layers of a model (dummy weights, each layer its own weights and cache), captured as CUDA
graphs, this times:

- the decodes alone (``--decodes`` sequences, contexts drawn from [``--context``, 2 x ``--context``)),
- the prompt tokens alone (fresh prompts of up to 1,024 tokens, ``--prompt-tokens`` in all),
- both as one batch (what a mixed step runs today, prepared as a step launched kernel by kernel),
- both in series on one stream, and both on two streams (the decodes on the capture stream, the prompts on
  a second one),
- with ``--sm-carveout N,...``: two streams again, the prompts' GEMMs held to all but N multiprocessors
  (cuBLASLt's SM count target), so that the decodes' memory-bound attention has SMs of its own while the
  prompts' projections run; and the GEMMs split, the decodes' held to those N SMs as well (else one of
  theirs that starts beside a prompts' GEMM waits for SMs the other holds); every arm then runs on
  cuBLASLt, the one library that takes the target,

and scales each to the model's layer count. With as many prompt tokens as decodes a step, a workload of
equal input and output lengths (1,024 / 1,024) is in its steady state: the decodes a second of a step are
then its output tok/s.

python -m benchmarks.kernels.overlap [--model Qwen/Qwen3-8B] [--decodes 332] [--prompt-tokens 256,512,1024]
    [--kv-cache-dtype auto,fp8] [--layers 4] [--context 1024] [--sm-carveout 16,32,48]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import torch

from benchmarks.args import positives, run_main
from benchmarks.kernels.harness import captured, graph_ms
from pagedserve.args import positive_int
from pagedserve.config import EngineArgs
from pagedserve.model.attention import AttentionMetadata
from pagedserve.model.loader import build_model
from pagedserve.model.worker import attention_backend
from tests.test_triton_attention import make_batch

PROMPT_LEN = 1024  # the longest prompt chunk of the prompt batch
TWO_STREAMS = "two streams"


@contextlib.contextmanager
def sm_carveout(sms: int | None) -> Iterator[None]:
    """GEMMs issued inside leave ``sms`` multiprocessors to other work (None: every SM); cuBLASLt reads the
    target when a GEMM is issued, so a graph captured inside keeps it."""
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def carved(sms: int, split: bool = False) -> str:
    """The arm whose prompts' GEMMs leave ``sms`` multiprocessors free (``split``: the decodes' GEMMs run on
    those)."""
    return f"{TWO_STREAMS}, prompts' GEMMs on all but {sms} SMs" + (", decodes' on those" if split else "")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def rows(meta: AttentionMetadata, first: int, last: int) -> tuple[AttentionMetadata, slice]:
    """Requests ``first`` .. ``last`` - 1 of a step's metadata, and the slice of its tokens they own."""
    starts = meta.query_start_loc
    t0, t1 = int(starts[first]), int(starts[last])
    seq_lens = meta.seq_lens[first:last]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[t0:t1], query_start_loc=(starts[first:last + 1] - t0).contiguous(),
        seq_lens=seq_lens, block_tables=meta.block_tables[first:last],
        max_query_len=int(meta.query_lens_cpu[first:last].max()), max_seq_len=int(seq_lens.max()),
        query_lens_cpu=meta.query_lens_cpu[first:last])
    return sub, slice(t0, t1)


class MixedStep:
    """The first ``layers`` layers of a model (embedding and final norm included, no logits) and one step's
    decodes and prompt tokens, each of the three batches prepared for the attention backend."""

    def __init__(self, args: EngineArgs, layers: int, decodes: int, context: int, prompt_tokens: int, seed: int = 0):
        config = args.create_config()
        self.full_layers = config.model.num_layers
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=layers))
        m, dev = config.model, config.device
        backend = attention_backend(args.attention_backend, dev, m.num_heads, m.num_kv_heads, m.head_dim)
        self.model = build_model(config, backend)
        rng = np.random.default_rng(seed)
        prompts = [min(PROMPT_LEN, prompt_tokens - i) for i in range(0, prompt_tokens, PROMPT_LEN)]
        query_lens = [1] * decodes + prompts
        context_lens = rng.integers(context, 2 * context, decodes).tolist() + [0] * len(prompts)
        bs = config.block_size
        num_blocks = sum(-(-(q + c) // bs) for q, c in zip(query_lens, context_lens))
        meta, positions = make_batch(rng, query_lens, context_lens, bs, num_blocks)
        shape = (2, num_blocks, bs, m.num_kv_heads, m.head_dim)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.caches = [torch.randn(shape, generator=gen, device=dev, dtype=config.dtype).to(config.kv_dtype)
                       for _ in range(layers)]
        ids = torch.from_numpy(rng.integers(0, m.vocab_size, len(positions))).to(dev)
        self.batches: dict[str, Batch] = {"one batch": Batch(ids, positions, meta)}
        for name, first, last in (("decodes", 0, decodes), ("prompts", decodes, len(query_lens))):
            if last > first:
                sub, tokens = rows(meta, first, last)
                self.batches[name] = Batch(ids[tokens], positions[tokens], sub)
        for b in self.batches.values():
            backend.prepare(b.meta, bs)

    @torch.no_grad()
    def forward(self, name: str) -> torch.Tensor:
        b = self.batches[name]
        return self.model(b.ids, b.positions, self.caches, b.meta)

    @torch.no_grad()
    def side_by_side(self, side: torch.cuda.Stream | None, carveout: int | None = None,
                     split: bool = False) -> torch.Tensor:
        """The decodes on the current stream and the prompts on ``side`` (None: one after the other), the
        prompts' GEMMs leaving ``carveout`` SMs to the decodes (``split``: the decodes' GEMMs held to those);
        the rows in one-batch order."""
        if side is None:
            return torch.cat([self.forward("decodes"), self.forward("prompts")])
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side), sm_carveout(carveout):
            prompts = self.forward("prompts")
        held = torch.cuda.get_device_properties(main.device).multi_processor_count - carveout if split else None
        with sm_carveout(held):
            decodes = self.forward("decodes")
        main.wait_stream(side)
        return torch.cat([decodes, prompts])

    def arms(self, carveouts: tuple[int, ...] = ()) -> dict[str, Callable[[], torch.Tensor]]:
        arms = {name: (lambda name=name: self.forward(name)) for name in ("decodes", "prompts", "one batch")}
        arms["in series"] = lambda: self.side_by_side(None)
        if torch.cuda.is_available():
            side = torch.cuda.Stream()
            arms[TWO_STREAMS] = lambda: self.side_by_side(side)
            for sms in carveouts:
                for split in (False, True):
                    arms[carved(sms, split)] = lambda sms=sms, split=split: self.side_by_side(side, sms, split)
        return arms


def time_arms(step: MixedStep, carveouts: tuple[int, ...] = (), reps: int = 20) -> tuple[dict[str, float], float]:
    """Milliseconds of one replay of each arm's graph, and the largest difference of any two-stream arm's rows
    from the one-batch rows (the same sums in other tile orders)."""
    ms: dict[str, float] = {}
    results = {}
    for name, fn in step.arms(carveouts).items():
        graph = captured(lambda _, name=name, fn=fn: results.__setitem__(name, fn()), 1)
        ms[name] = graph_ms(graph.replay, reps)
        results[name] = results[name].float().clone()
        del graph
    ref = results["one batch"]
    diff = max(float((rows - ref).abs().max() / ref.abs().max())
               for name, rows in results.items() if name.startswith(TWO_STREAMS))
    return ms, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen3-8B")
    p.add_argument("--decodes", type=positive_int, default=332)
    p.add_argument("--context", type=positive_int, default=1024,
                   help="decode contexts are drawn from [this, twice this)")
    p.add_argument("--prompt-tokens", type=positives, default=[256, 512, 1024], help="comma-separated prompt tokens a step")
    p.add_argument("--kv-cache-dtype", default="auto,fp8", help="comma-separated")
    p.add_argument("--layers", type=positive_int, default=4, help="layers run (each its own weights and cache)")
    p.add_argument("--sm-carveout", type=positives, default=[],
                   help="comma-separated SM counts the prompts' GEMMs leave to the decodes, each two arms: the "
                        "decodes' GEMMs on every SM or held to those (every arm then on cuBLASLt)")
    ns = p.parse_args()
    carveouts = tuple(ns.sm_carveout)
    if carveouts:
        if not hasattr(torch._C, "_set_sm_carveout_experimental"):
            p.error(f"--sm-carveout: torch {torch.__version__} has no cuBLASLt SM carveout")
        if max(carveouts) >= (sms := torch.cuda.get_device_properties(0).multi_processor_count):
            p.error(f"--sm-carveout: this GPU has {sms} SMs; leave the GEMMs at least one")
        torch.backends.cuda.preferred_blas_library("cublaslt")
    print(f"{torch.cuda.get_device_name()}; {ns.model}, first {ns.layers} layers; {ns.decodes} decodes at contexts "
          f"{ns.context}..{2 * ns.context - 1}; times scaled to every layer; GEMMs on "
          f"{torch.backends.cuda.preferred_blas_library().name}")
    for kv in ns.kv_cache_dtype.split(","):
        for tokens in ns.prompt_tokens:
            args = EngineArgs(model=ns.model, load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv, device="cuda")
            step = MixedStep(args, ns.layers, ns.decodes, ns.context, tokens)
            ms, diff = time_arms(step, carveouts)
            scale = step.full_layers / ns.layers
            print(f"\n== KV {kv}, {tokens} prompt tokens beside the decodes: ms a step of {step.full_layers} layers "
                  f"(decodes a second); two streams against one batch: rows differ by {diff:.1e}")
            width = max(map(len, ms))
            for name, t in ms.items():
                rate = "" if name == "prompts" else f" ({ns.decodes / (t * scale) * 1e3:6.0f} /s)"
                print(f"  {name:<{width}} {t * scale:8.2f} ms{rate}")
            for name in (n for n in ms if n.startswith(TWO_STREAMS)):
                hidden = (ms["decodes"] + ms["prompts"] - ms[name]) / min(ms["decodes"], ms["prompts"])
                print(f"  {name}: hide {100 * hidden:.0f} % of the shorter batch; against one batch "
                      f"{100 * (ms['one batch'] / ms[name] - 1):+.1f} % decodes a second")
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    run_main(main)
