"""Does a weight prefetched into L2 during a latency-bound kernel make the next projection faster?

python benchmarks/l2_prefetch.py

A stand-in for one layer's attention window: a kernel that only waits (``torch.cuda._sleep``), then a
bs=1 projection of Qwen3-8B's o_proj shape (4096 x 4096 bf16, 32 MiB), over 36 distinct weights so that
no weight is still in L2 from the previous layer. Captured in a CUDA graph, with and without
l2_prefetch.cu streaming the weight in on a second stream during the wait (bulk copy-engine prefetch and
one prefetch per 128-byte line), and the projection's time taken as the difference to waits alone.

Measured on the H200 (docs/benchmarks.md, section 1): the projection took 13.2 us after a wait and 12.3
with its weight prefetched, yet ~12.4 us back to back, i.e. it is not bound by where its bytes are. In the
engine (forward hooks launching this kernel after every projection, 16-64 MiB ahead) the bs=1 step got
slower, 5.06 -> 5.19-5.50 ms, so the engine has no prefetch; this file keeps the measurement.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.latency import graph_ms  # noqa: E402
from pagedserve.model.fused import sm_count  # noqa: E402

LAYERS = 36
_CHUNK = 16384  # bytes one thread asks for at a time
_SOURCE = r"""
// Streams a byte range of weights into the L2 cache and returns at once: the fills run in the background.
//
// Why: a decode step of one sequence is a chain of weight-bound projections with small latency-bound
// kernels (norms, rotary, attention) between them, during which HBM sits idle. Launched beside those
// kernels on a second stream, this moves the next projection's first bytes into L2 so that the
// projection reads them from there.
// BULK 1 (sm_90+): one cp.async.bulk.prefetch.L2 per CHUNK bytes (the copy engine does the rest);
// BULK 0: one prefetch.global.L2 per 128-byte line.
#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef BULK
#define BULK 1
#endif

extern "C" __global__ void l2_prefetch(const unsigned char* base, int bytes) {
    const int stride = gridDim.x * blockDim.x * CHUNK;
    for (int off = (blockIdx.x * blockDim.x + threadIdx.x) * CHUNK; off < bytes; off += stride) {
        const int n = bytes - off < CHUNK ? bytes - off : CHUNK;  // a multiple of 16: every range is
#if BULK
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + off), "r"(n) : "memory");
#else
        for (int i = 0; i < n; i += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(base + off + i));
#endif
    }
}
"""


def graph_us(fn, reps: int = 20) -> float:
    """GPU time of one replay of ``fn`` captured in a graph, in microseconds."""
    side = torch.cuda.Stream()
    fn(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(side)
    return graph_ms(graph, reps) * 1000


def main() -> None:
    dev = torch.device("cuda")
    sms = sm_count(dev)
    kernels = {bulk: torch.cuda._compile_kernel(_SOURCE, "l2_prefetch",
                                                nvcc_options=["-std=c++17", f"-DCHUNK={_CHUNK}", f"-DBULK={bulk}"])
               for bulk in (1, 0)}
    hz = torch.cuda.get_device_properties(dev).clock_rate * 1000 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9
    for n_out, n_in, label in ((4096, 4096, "o_proj 4096x4096"), (6144, 4096, "qkv 6144x4096")):
        weights = [torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(1, n_in, device=dev, dtype=torch.bfloat16)
        nbytes = weights[0].numel() * 2
        print(f"\n== {label} ({nbytes / 2**20:.0f} MiB), {LAYERS} distinct weights, SM clock ~{hz / 1e9:.2f} GHz")

        def chain(side, wait_cycles, project=True, bulk=None, prefetch_bytes=nbytes):
            main = torch.cuda.current_stream()
            for w in weights:
                if bulk is not None:
                    side.wait_stream(main)
                    view = w.view(-1).view(torch.uint8)[:prefetch_bytes]
                    with torch.cuda.stream(side):
                        kernels[bulk](grid=(min(sms, -(-view.numel() // (32 * _CHUNK))), 1, 1), block=(32, 1, 1),
                                      args=[view, view.numel()])
                if wait_cycles:
                    torch.cuda._sleep(wait_cycles)
                if project:
                    F.linear(x, w)
                if bulk is not None:
                    main.wait_stream(side)

        cold = graph_us(lambda s: chain(s, 0)) / LAYERS
        print(f"projection alone, back to back: {cold:.2f} us ({nbytes / cold / 1e6:.2f} TB/s)")
        for wait_us in (4, 8, 12, 16):
            cycles = int(wait_us * hz / 1e6)
            waits = graph_us(lambda s: chain(s, cycles, project=False)) / LAYERS
            plain = graph_us(lambda s: chain(s, cycles)) / LAYERS - waits
            row = [f"wait {waits:5.2f} us: projection after it {plain:5.2f} us"]
            for bulk, name in ((1, "bulk"), (0, "lines")):
                for frac in (1.0, 0.5):
                    t = graph_us(lambda s: chain(s, cycles, bulk=bulk,
                                                 prefetch_bytes=int(nbytes * frac) // 16 * 16)) / LAYERS - waits
                    row.append(f"{name} {frac:g}: {t:5.2f}")
            print(", ".join(row))


if __name__ == "__main__":
    main()
