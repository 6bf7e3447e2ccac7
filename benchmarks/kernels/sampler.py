"""The Gumbel-max sampler alone on the GPU: rows x Qwen3's vocabulary of bf16 logits, against a plain
argmax (one read of the logits, what a greedy step costs).

python -m benchmarks.kernels.sampler
"""

from __future__ import annotations


import torch


from benchmarks.args import run_main
from benchmarks.kernels.harness import kernel_ms
from pagedserve.model import fused


def main(vocab: int = 151936) -> None:
    dev = torch.device("cuda")
    print(f"Gumbel-max sampling over {vocab} bf16 logits a row (triton.testing.do_bench)")
    for rows in (1, 64, 256, 512):
        logits = torch.randn((rows, vocab), device=dev, dtype=torch.bfloat16)
        inv_t = torch.full((rows,), 1 / 0.6, device=dev)
        seeds = torch.arange(rows, device=dev) * 7919 + 1
        noisy = torch.ones(rows, dtype=torch.bool, device=dev)
        gumbel = kernel_ms(lambda: fused.gumbel_argmax(logits, inv_t, seeds, noisy), 200)
        argmax = kernel_ms(lambda: logits.argmax(-1), 200)
        gb = logits.numel() * logits.element_size() / 1e9
        print(f"  {rows:4d} rows: gumbel_argmax {gumbel * 1e3:8.1f} us ({gb / gumbel * 1e3:6.0f} GB/s of logits), "
              f"argmax {argmax * 1e3:8.1f} us")


if __name__ == "__main__":
    run_main(main)
