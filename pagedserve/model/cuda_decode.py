"""The fp8 (e4m3) decode as a hand-written CUDA kernel (fp8_decode.cu), compiled once with NVRTC through
torch. Triton's staging of fp8 K/V through shared memory left the decode well short of the bandwidth a
bf16 one reaches (docs/lab-notes.md); this kernel loads each thread's bytes straight into registers. It covers the
decodes that dominate large batches (not split over segments, bf16 queries, head dim 128, up to 8 query
heads a KV head, blocks a multiple of 16 tokens); every other launch stays on the Triton kernel."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE, _KERNEL = Path(__file__).with_name("fp8_decode.cu"), "fp8_paged_decode"
_LOG2E = 1.4426950408889634


class CudaFp8Decode:
    """One compiled variant (warps, G, block size) of the kernel; calling it writes ``out``'s decode rows."""

    WARPS = 4
    PREFETCH = 3  # steps ahead a warp prefetches its K/V lines into L2 (0: none)

    def __init__(self, kernel, warps: int, num_kv_heads: int):
        self.kernel, self.warps, self.num_kv_heads = kernel, warps, num_kv_heads

    @staticmethod
    def unsupported(group: int, head_dim: int, block_size: int, device: torch.device) -> str | None:
        """Why the kernel cannot serve this model and cache on this device (None: it can)."""
        if head_dim != 128 or not 1 <= group <= 8 or block_size % 16:
            return (f"head dim {head_dim}, {group} query heads a KV head, block size {block_size} "
                    "(it takes head dim 128, up to 8 heads, blocks a multiple of 16)")
        if device.type != "cuda":
            return "not a CUDA device"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "needs compute capability 8.9+ (cvt.e4m3x2)"
        if not hasattr(torch.cuda, "_compile_kernel"):
            return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
        return None

    @staticmethod
    def options(group: int, block_size: int, warps: int, prefetch: int) -> list[str]:
        """NVRTC's options for one variant."""
        return ["-std=c++17", "--use_fast_math", f"-DWARPS={warps}", f"-DG={group}", f"-DBLOCK_SIZE={block_size}",
                f"-DPREFETCH={prefetch}"]

    @classmethod
    def build(cls, group: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
              warps: int | None = None, prefetch: int | None = None) -> CudaFp8Decode | None:
        """Compile the variant, or say (once, in the log) why fp8 decodes stay on Triton."""
        warps = warps or cls.WARPS
        prefetch = cls.PREFETCH if prefetch is None else prefetch
        reason = cls.unsupported(group, head_dim, block_size, device)
        if reason is None:
            try:
                with torch.cuda.device(device):
                    kernel = torch.cuda._compile_kernel(_SOURCE.read_text(), _KERNEL,
                                                        nvcc_options=cls.options(group, block_size, warps, prefetch))
                logger.info("fp8 decodes: CUDA kernel, %d warps a (sequence, KV head)", warps)
                return cls(kernel, warps, num_kv_heads)
            except Exception as e:  # NVRTC missing or refusing: Triton still serves every launch
                reason = f"NVRTC failed: {e}"
        logger.info("fp8 decodes: Triton kernel (CUDA kernel unused: %s)", reason)
        return None

    @staticmethod
    def takes(q: torch.Tensor) -> bool:
        """The kernel reads each thread's 32 query values with 16-byte loads: rows must stay 16-byte aligned."""
        return q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, meta, tile_seq: torch.Tensor,
                 scale: float) -> None:
        kc = kv_cache.view(torch.uint8)
        self.kernel(
            grid=(tile_seq.shape[0], self.num_kv_heads, 1), block=(32 * self.warps, 1, 1),
            args=[q, kc[0], kc[1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc, tile_seq,
                  scale * _LOG2E, q.stride(0), q.stride(1), kc.stride(1), kc.stride(2), kc.stride(3),
                  meta.block_tables.stride(0), out.stride(0), out.stride(1)])
