"""bf16 projections of one or two rows as a hand-written CUDA GEMV (gemv.cu), compiled once per reduction
length and row count with NVRTC through torch. A decode step of one or two sequences is ~145 such
projections whose weights are the whole cost; cuBLAS's kernels for so few rows leave SMs idle, add a
split-K reduce kernel, or read the weights at a lower rate. Three to sixteen rows go to a Triton kernel on the
tensor cores (mma_gemv.py); larger batches and every other shape keep cuBLAS (``F.linear``)."""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.model import mma_gemv
from pagedserve.model.fused import sm_count

logger = logging.getLogger(__name__)

_SOURCE, _KERNEL = Path(__file__).with_name("gemv.cu"), "gemv_bf16"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_MAX_DYNAMIC_SHARED_SIZE_BYTES, _PREFERRED_SHARED_MEMORY_CARVEOUT = 8, 9  # CUfunction_attribute


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class CudaGemv:
    """The compiled variants (by warps a CTA, reduction length, and what x is staged as: silu(gate) * up,
    or RMSNorm with or without a residual) and their launcher."""

    ENABLED = True  # False: cuBLAS for every projection (the engine's A/B switch)
    PDL = True  # programmatic dependent launch on sm_90+ (False: plain launches)
    FUSE_NORM = True  # RMSNorm (+ residual) staged by the projection after it (False: the norm kernel runs)
    # one CTA of up to 32 warps a multiprocessor, 4 16-byte loads a lane in flight (8 across a step boundary);
    # the shape benchmarks/kernels/gemv.py --cuda picked
    WARPS = 32
    WARP_CHOICES = (32, 28, 24, 20, 16)  # warps a CTA ``warps_for`` picks from (up to ``warps``)
    UNROLL = 4
    # rows of x a variant takes: the decode graphs of one and two sequences (other counts go to cuBLAS; at
    # four rows the kernel measured no faster than cuBLAS, at eight far slower: a lane's shared-memory reads
    # and conversions grow with the rows, its weight loads do not). Above one row, 32 warps x 4 loads for
    # every shape (fewer warps measured slower there)
    ROWS = (1, 2)
    ROW_WARPS, ROW_UNROLL = 32, 4
    MMA = True  # other row counts up to 16 on the tensor cores (mma_gemv; False: cuBLAS, the A/B switch)
    # the projection after attention (``staged``): its weights start copying into shared memory while the
    # attention kernel runs beside it; half the registers (16 warps at <= 64 a thread) and 160 KB of shared
    # memory a CTA leave room for one attention CTA on the same multiprocessor, and none for a second
    # staged CTA (smaller copies, which let two share a multiprocessor, measured slower than none)
    STAGE = True  # False: that projection runs as any other (the engine's A/B switch)
    STAGE_WARPS = 16
    STAGE_BYTES = 160 * 1024

    def __init__(self, device: torch.device, warps: int | None = None, unroll: int | None = None):
        self.device = device
        self.warps, self.unroll = warps or self.WARPS, unroll or self.UNROLL
        self.sms = sm_count(device)
        # the shared memory a CTA may opt in to: x's rows are staged there (an H100's or H200's off the GPU)
        self.max_shared = (torch.cuda.get_device_properties(device).shared_memory_per_block_optin
                           if device.type == "cuda" else 227 * 1024)
        self._kernels: dict[tuple[int, int, int, bool, bool, bool, int], tuple[object, int, int]] = {}
        # programmatic dependent launch where the device has it (griddepcontrol: sm_90+)
        self.pdl = self.PDL and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
        self._libcuda = torch.cuda._utils._get_gpu_runtime_library() if device.type == "cuda" else None
        self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed

    @staticmethod
    def unsupported(device: torch.device) -> str | None:
        """Why projections of up to 16 rows stay on cuBLAS on this device (None: the GEMV can take them)."""
        if device.type != "cuda":
            return "not a CUDA device"
        if not CudaGemv.ENABLED:
            return "switched off (CudaGemv.ENABLED)"
        if not hasattr(torch.cuda, "_compile_kernel"):
            return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
        return None

    @classmethod
    def build(cls, device: torch.device) -> CudaGemv | None:
        reason = cls.unsupported(device)
        if reason is None:
            gemv = cls(device)
            try:
                gemv._kernel(4096, 4096)  # compiles once here, so a failing NVRTC shows at start-up
                logger.info("projections of 1-2 rows: CUDA GEMV, up to %d warps a multiprocessor%s; of 3-%d rows: "
                            "%s", gemv.warps, ", programmatic dependent launch" if gemv.pdl else "",
                            mma_gemv.MAX_ROWS, "tensor cores" if cls.MMA else "cuBLAS")
                return gemv
            except Exception as e:  # NVRTC missing or refusing: cuBLAS serves every projection
                reason = f"NVRTC failed: {e}"
        logger.info("projections of up to 16 rows: cuBLAS (CUDA GEMV unused: %s)", reason)
        return None

    def unroll_for(self, k: int, rows: int = 1) -> int:
        """Loads in flight a lane: ``unroll`` (``ROW_UNROLL`` above one row), halved until a row splits into
        whole steps of 32 lanes."""
        unroll = self.unroll if rows == 1 else self.ROW_UNROLL
        while unroll > 1 and (k // 8) % (32 * unroll):
            unroll //= 2
        return unroll

    def x_shared(self, rows: int, k: int) -> int:
        """Bytes of dynamic shared memory ``rows`` rows of x take (one row's sit in a static array)."""
        return 0 if rows == 1 else rows * k * 2

    def warps_for(self, n: int) -> int:
        """Warps a CTA for n rows: of 32, 28, ... 16 (up to ``warps``), the count whose rows fall most evenly
        over all warps (a warp takes whole rows), the larger on a tie: e.g. 6144 rows over 132 x 32 warps
        leave the last round a quarter full, over 132 x 24 warps both rounds are full."""
        best, best_balance = self.warps, 0.0
        for w in [w for w in self.WARP_CHOICES if w <= self.warps] or [self.warps]:
            total = min(self.sms, -(-n // w)) * w
            balance = n / (-(-n // total) * total)
            if balance > best_balance:
                best, best_balance = w, balance
        return best

    def staged_chunks(self, n: int, k: int) -> int:
        """Chunks (one step's loads of a warp) each warp of a staged n x k projection copies to shared memory
        before its wait: what ``STAGE_BYTES`` holds, less the one chunk that waits in registers anyway."""
        unroll, warps = self.unroll_for(k), self.STAGE_WARPS
        chunks = -(-n // (min(self.sms, -(-n // warps)) * warps)) * (k // 8 // (32 * unroll))
        return max(0, min(self.STAGE_BYTES // (warps * unroll * 32 * 16), chunks - 1))

    def _chunks_to_stage(self, n: int, k: int) -> int:
        """``staged_chunks`` where staging is on (``STAGE``, and PDL for the early start it fills), else 0."""
        return self.staged_chunks(n, k) if self.STAGE and self.pdl else 0

    def stages(self, weight: torch.Tensor) -> bool:
        """Whether a one-row bf16 projection by ``weight`` after attention copies weights beside the attention."""
        return self.takes_weight(weight, torch.bfloat16) and self._chunks_to_stage(*weight.shape) > 0

    def _kernel(self, n: int, k: int, rows: int = 1, silu_mul: bool = False, norm: bool = False,
                residual: bool = False, staged: bool = False) -> tuple[object, int, int]:
        """(the compiled variant for an n x k weight and ``rows`` rows of x, its warps a CTA, its dynamic shared
        memory in bytes)."""
        chunks = self._chunks_to_stage(n, k) if staged and rows == 1 else 0  # (``takes`` held)
        warps = self.STAGE_WARPS if chunks else self.warps_for(n) if rows == 1 else self.ROW_WARPS
        key = (warps, k, rows, silu_mul, norm, residual, chunks)
        if key not in self._kernels:
            unroll = self.unroll_for(k, rows)
            options = ["-std=c++17", f"-DK={k}", f"-DWARPS={warps}", f"-DUNROLL={unroll}", f"-DROWS={rows}",
                       f"-DSILU_MUL={int(silu_mul)}", f"-DNORM={int(norm)}", f"-DHAS_RESIDUAL={int(residual)}"]
            if chunks:
                options += [f"-DSTAGED={chunks}", "-DMIN_CTAS=2"]
            # dynamic shared memory: the staged weights of one row, or x itself above one row
            shared = chunks * warps * unroll * 32 * 16 if rows == 1 else self.x_shared(rows, k)
            self._kernels[key] = self._compile(options, shared), warps, shared
        return self._kernels[key]

    def _compile(self, options: list[str], shared: int):
        """gemv.cu's kernel compiled with NVRTC ``options``, opted in to ``shared`` bytes of dynamic shared memory."""
        with torch.cuda.device(self.device):
            kernel = torch.cuda._compile_kernel(_SOURCE.read_text(), _KERNEL, nvcc_options=options)
            if shared:  # above 48 KB of dynamic shared memory a kernel must opt in
                for attr, value in ((_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                                    (_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)):  # L1 all shared memory
                    torch.cuda._utils._check_cuda(self._libcuda.cuFuncSetAttribute(kernel.func, attr, value))
        return kernel

    def takes(self, x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
        """``ROWS`` contiguous bf16 rows against a contiguous bf16 weight of rows a multiple of 256 values that
        fit the kernel's shared memory (with silu_mul, x holds gate and up: twice the weight's columns); other
        row counts where the tensor-core kernel takes them (``MMA``)."""
        if x.dim() == 2 and x.shape[0] not in self.ROWS:
            return self.MMA and not silu_mul and x.dtype == torch.bfloat16 and mma_gemv.takes(x, weight)
        k = weight.shape[1]
        return (x.dim() == 2 and x.shape[0] in self.ROWS and x.shape[1] == k * (2 if silu_mul else 1)
                and x.is_contiguous() and x.data_ptr() % 16 == 0 and self.takes_weight(weight, x.dtype)
                and self.x_shared(x.shape[0], k) <= self.max_shared)

    def takes_gated(self, x: torch.Tensor, gate_up: torch.Tensor) -> bool:
        """Whether gate_up_proj of x's rows (the norm's output) goes to the tensor-core kernel, which then forms
        silu(gate) * up itself (``gated``)."""
        return x.dim() == 2 and x.shape[0] not in self.ROWS and self.takes(x, gate_up)

    @staticmethod
    def takes_weight(weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
        """``takes`` for the weight alone, given one row of ``x_dtype`` laid out as the kernel needs."""
        k = weight.shape[1]
        return (x_dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous() and k % 256 == 0
                and k * 2 <= 48 * 1024 and weight.data_ptr() % 16 == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
                 staged: bool = False) -> torch.Tensor:
        """x @ weight.T (with ``silu_mul``: silu(gate) * up of each row x = [gate | up], then the product;
        ``staged``: x is one row from the attention kernel, and the weights are staged while it runs)."""
        if x.shape[0] not in self.ROWS:
            return mma_gemv.mma_gemv(x, weight)
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        variant = self._kernel(*weight.shape, x.shape[0], silu_mul, staged=staged)
        self._launch(variant, weight, x, out, x, x, x, 0.0)
        return out

    @staticmethod
    def gated(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x @ gate_up.T, gate_up being [gate; up], in one kernel (``takes_gated`` held)."""
        return mma_gemv.mma_gemv(x, gate_up, gated=True)

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   weight: torch.Tensor) -> bool:
        """``takes`` for ``norm_project`` (the CUDA GEMV's rows only): the residual and the norm's weight must be
        laid out as x is."""
        return (self.FUSE_NORM and x.shape[0] in self.ROWS and self.takes(x, weight)
                and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
                and norm_weight.data_ptr() % 16 == 0 and (residual is None or (
                    residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
                    and residual.data_ptr() % 16 == 0)))

    def norm_project(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x + residual) * norm_weight, then @ weight.T, in one kernel: (the product, the new residual)."""
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        new_residual = torch.empty_like(x) if residual is not None else x
        kernel = self._kernel(*weight.shape, x.shape[0], norm=True, residual=residual is not None)
        self._launch(kernel, weight, x, out, residual if residual is not None else x, norm_weight, new_residual, eps)
        return out, new_residual

    def _launch(self, variant, weight, x, out, residual, norm_weight, new_residual, eps: float) -> None:
        kernel, warps, shared = variant
        n = weight.shape[0]
        grid, block = min(self.sms, -(-n // warps)), 32 * warps
        # torch's launcher takes no launch attributes: the kernel's parameters go through cuLaunchKernelEx
        values = [ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                  ctypes.c_int(n), ctypes.c_void_p(residual.data_ptr()), ctypes.c_void_p(norm_weight.data_ptr()),
                  ctypes.c_void_p(new_residual.data_ptr()), ctypes.c_double(eps)]
        params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        config = _LaunchConfig((grid, 1, 1), (block, 1, 1), shared, torch.cuda.current_stream().cuda_stream,
                               ctypes.pointer(self._attr), int(self.pdl))
        torch.cuda._utils._check_cuda(self._libcuda.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: CudaGemv | None,
           staged: bool = False) -> torch.Tensor:
    """The projection: the CUDA GEMV where it takes the operands (``staged``: see ``CudaGemv.__call__``), else
    cuBLAS."""
    if gemv is not None and bias is None and gemv.takes(x, weight):
        return gemv(x, weight, staged=staged)
    return F.linear(x, weight, bias)
