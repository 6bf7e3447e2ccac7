"""(CPU) The machine code of every CUDA GEMV variant a model's decode steps may compile, with no GPU: each variant
of model/gemv.cu that CudaGemv builds for the model's projection shapes, compiled for sm_90 by NVRTC and
disassembled by cuobjdump. It reports each variant's registers and spills, and fails where ptxas placed the
programmatic dependent launch's wait (griddepcontrol.wait, ACQBULK in SASS) before the first weight load: the
wait only acquires, so hoisting it is legal, and it silently turns off the weight stream a GEMV starts while the
kernel before it finishes. Small edits to the staging of x have moved it; check here before timing on a GPU.

pip install "nvidia-cuda-nvrtc>=13"   # CUDA's, from PyPI (the test extra has it); cuobjdump: Triton's own
python -m benchmarks.kernels.gemv_sass [--model Qwen/Qwen3-8B] [--arch sm_90]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.args import run_main
from pagedserve.builtin.known_models import KNOWN_MODELS
from pagedserve.config import ModelConfig
from pagedserve.model.cuda_gemv import _KERNEL, _SOURCE, CudaGemv


INSTALL = "pip install 'nvidia-cuda-nvrtc>=13'"


@functools.cache
def cuda_tools() -> tuple[ctypes.CDLL, Path]:
    """NVRTC from CUDA's wheel (namespace package ``nvidia``); cuobjdump from CUDA's wheel where installed, else
    the one Triton ships for its own kernels (found and loaded once a process)."""
    try:
        import nvidia
    except ImportError:
        sys.exit(f"needs CUDA's NVRTC: {INSTALL}")
    roots = [Path(p) for p in nvidia.__path__]
    nvrtc = [f for r in roots for f in sorted(r.glob("cu*/lib/libnvrtc.so.*")) if "alt" not in f.name]
    cuobjdump = [f for r in roots for f in r.glob("cu*/bin/cuobjdump")]
    try:
        import triton
        cuobjdump.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    cuobjdump = [f for f in cuobjdump if f.is_file()]
    if not nvrtc or not cuobjdump:
        sys.exit(f"NVRTC ({'found' if nvrtc else 'missing'}) under the nvidia package, cuobjdump "
                 f"({'found' if cuobjdump else 'missing'}) there or in Triton: {INSTALL}")
    for builtins in nvrtc[-1].parent.glob("libnvrtc-builtins.so.*"):  # NVRTC opens it by name at compile time
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(nvrtc[-1])), cuobjdump[0]


def cubin(nvrtc: ctypes.CDLL, source: str, options: list[str], arch: str) -> bytes:
    """``source`` compiled by NVRTC with the engine's ``options`` straight to machine code for ``arch``."""
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gemv.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [o.encode() for o in [f"--gpu-architecture={arch}", *options]]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC: {log.value.decode()}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, out)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw


def variants(model: ModelConfig) -> list[list[str]]:
    """The NVRTC options of every variant CudaGemv compiles for the model's decode steps at each row
    count it takes, with the engine's own choices (warps, unroll, staged chunks): q/k/v after the input norm
    (the first layer's without a residual), o_proj staged beside the attention or plain, gate/up after the
    post-attention norm, down_proj with the SiLU-mul, the LM head."""
    h, d, i = model.hidden_size, model.head_dim, model.intermediate_size
    q, kv = model.num_heads * d, model.num_kv_heads * d
    uses = [((q + 2 * kv, h), dict(norm=True)), ((q + 2 * kv, h), dict(norm=True, residual=True)),
            ((h, q), dict(staged=True)), ((h, q), {}), ((2 * i, h), dict(norm=True, residual=True)),
            ((h, i), dict(silu_mul=True)), ((model.vocab_size, h), {})]
    gemv = CudaGemv(torch.device("cpu"))
    gemv.pdl = True  # as on sm_90, where the staged variants exist
    compiled: dict[tuple[str, ...], None] = {}
    gemv._compile = lambda options, shared: compiled.setdefault(tuple(options))
    for (n, k), use in uses:
        weight = torch.empty((n, k), dtype=torch.bfloat16)
        for rows in gemv.ROWS:
            x = torch.empty((rows, k * (2 if use.get("silu_mul") else 1)), dtype=torch.bfloat16)
            if gemv.takes(x, weight, silu_mul=use.get("silu_mul", False)):
                gemv._kernel(n, k, rows, **use)
    return [list(options) for options in compiled]


def check(sass: str) -> tuple[bool, int]:
    """(the wait comes after the first weight load, or there is no wait; the SASS instruction count)."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    loads = [i for i, op in enumerate(ops) if op in ("LDG", "LDGSTS")]
    wait = ops.index("ACQBULK") if "ACQBULK" in ops else None
    return wait is None or (bool(loads) and loads[0] < wait), len(ops)


def machine_code(tools: tuple[ctypes.CDLL, Path], source: str, options: list[str], arch: str,
                 kernel: str) -> tuple[str, int | None, int | None]:
    """(SASS, registers a thread, stack bytes a thread) of ``kernel`` in ``source`` compiled with ``options``."""
    nvrtc, cuobjdump = tools
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin(nvrtc, source, options, arch))
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.search(rf"Function {kernel}:\s*\n\s*REG:(\d+) STACK:(\d+)", usage)
    return sass, *((int(found.group(1)), int(found.group(2))) if found else (None, None))


def inspect(model: ModelConfig, arch: str = "sm_90") -> list[tuple[str, bool, int, int | None, int | None]]:
    """For each GEMV variant of ``model``: (its macros, wait after the first weight load, instructions,
    registers, stack bytes)."""
    tools, source, rows = cuda_tools(), _SOURCE.read_text(), []
    for options in variants(model):
        sass, registers, stack = machine_code(tools, source, options, arch, _KERNEL)
        ok, count = check(sass)
        rows.append((" ".join(o[2:] for o in options if o.startswith("-D")), ok, count, registers, stack))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-8B", choices=sorted(KNOWN_MODELS))
    ap.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (programmatic dependent "
                    "launch needs sm_90 or later)")
    ns = ap.parse_args()
    print(f"{ns.model}: the CUDA GEMV's variants for {ns.arch}")
    rows = inspect(ModelConfig.from_hf_dict(KNOWN_MODELS[ns.model]), ns.arch)
    for macros, ok, count, registers, stack in rows:
        print(f"  {'ok  ' if ok else 'WAIT FIRST'} {macros}: {count} instructions, "
              f"{'?' if registers is None else registers} registers, stack {'?' if stack is None else stack} bytes")
    bad = sum(not ok for _, ok, *_ in rows)
    if bad:
        sys.exit(f"{bad} variant(s) wait for the kernel before them ahead of their first weight load")


if __name__ == "__main__":
    run_main(main)
