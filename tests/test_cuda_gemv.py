"""Which projections the CUDA GEMV (model/gemv.cu) takes and which variant it compiles for them; its numbers
are checked against F.linear on the GPU by benchmarks/gpu_check.py, and every projection here on the CPU
stays on F.linear."""

from __future__ import annotations

import contextlib
import ctypes

import torch
import torch.nn.functional as F

from pagedserve import LLM
from pagedserve.model.cuda_gemv import CudaGemv, _LaunchAttribute, _LaunchConfig, linear
from pagedserve.model.layers import Linear, use_gemv

CPU = torch.device("cpu")


def test_takes_one_bf16_row_of_a_length_the_kernel_covers():
    g = CudaGemv(CPU)
    w = torch.zeros((6144, 4096), dtype=torch.bfloat16)
    x = torch.zeros((1, 4096), dtype=torch.bfloat16)
    assert g.takes(x, w)
    assert not g.takes(x.float(), w.float())
    assert not g.takes(torch.zeros((1, 4000), dtype=torch.bfloat16), torch.zeros((8, 4000), dtype=torch.bfloat16))
    assert not g.takes(torch.zeros((1, 8192), dtype=torch.bfloat16)[:, ::2], w)  # strided row
    assert not g.takes(torch.zeros((1, 32768), dtype=torch.bfloat16), torch.zeros((8, 32768), dtype=torch.bfloat16))
    down = torch.zeros((4096, 12288), dtype=torch.bfloat16)
    gate_up = torch.zeros((1, 2 * 12288), dtype=torch.bfloat16)
    assert g.takes(gate_up, down, silu_mul=True) and not g.takes(gate_up, down)


def test_takes_the_row_counts_of_small_decode_graphs_while_x_fits_shared_memory(monkeypatch):
    """Decode graphs of one and two sequences read each weight once in the CUDA GEMV, those of up to 16 in the
    tensor-core kernel; more rows stay on cuBLAS, and so do rows whose x would not fit the shared memory a CTA
    may opt in to."""
    g = CudaGemv(CPU)  # an H100's or H200's 227 KB off the GPU
    w = torch.zeros((6144, 4096), dtype=torch.bfloat16)
    rows = [m for m in range(1, 33) if g.takes(torch.zeros((m, 4096), dtype=torch.bfloat16), w)]
    assert rows == list(range(1, 17))
    monkeypatch.setattr(CudaGemv, "MMA", False)
    rows = [m for m in range(1, 33) if g.takes(torch.zeros((m, 4096), dtype=torch.bfloat16), w)]
    assert rows == [1, 2]
    down = torch.zeros((4096, 12288), dtype=torch.bfloat16)  # 2 rows of 12,288 values: 48 KB
    assert g.takes(torch.zeros((2, 2 * 12288), dtype=torch.bfloat16), down, silu_mul=True)
    monkeypatch.setattr(g, "max_shared", 32 * 1024)
    assert not g.takes(torch.zeros((2, 2 * 12288), dtype=torch.bfloat16), down, silu_mul=True)
    assert g.takes(torch.zeros((1, 2 * 12288), dtype=torch.bfloat16), down, silu_mul=True)  # a static array
    monkeypatch.setattr(CudaGemv, "ROWS", (1,))
    assert not g.takes(torch.zeros((2, 4096), dtype=torch.bfloat16), w)  # (MMA off above)


def test_variants_above_one_row_stage_x_in_dynamic_shared_memory(monkeypatch):
    """A variant is compiled for its row count; above one row with its own CTA shape, x in dynamic shared
    memory (which a kernel opts in to above 48 KB), and no weights staged beside the attention (one
    sequence's only)."""
    compiled, attrs = [], []

    class Kernel:
        func = None

    def compile_kernel(source, name, nvcc_options):
        compiled.append(dict(o[2:].split("=") for o in nvcc_options if o.startswith("-D")))
        return Kernel()

    class Driver:
        def cuFuncSetAttribute(self, func, attr, value):
            attrs.append((attr, value))
            return 0

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda._utils, "_check_cuda", lambda result: None)
    g = CudaGemv(CPU)
    g._libcuda, g.pdl = Driver(), True
    assert g._kernel(6144, 4096)[1:] == (24, 0) and compiled[-1]["ROWS"] == "1" and not attrs
    assert g._kernel(4096, 4096, staged=True)[1:] == (16, 5 * 16 * 4 * 32 * 16)
    assert compiled[-1]["STAGED"] == "5"
    _, warps, shared = g._kernel(6144, 4096, 2, norm=True, residual=True)
    assert (warps, shared) == (32, 2 * 4096 * 2)  # 32 warps at two rows, where one row's balance rule takes 24
    assert {k: compiled[-1][k] for k in ("ROWS", "WARPS", "UNROLL", "NORM", "HAS_RESIDUAL")} == {
        "ROWS": "2", "WARPS": "32", "UNROLL": "4", "NORM": "1", "HAS_RESIDUAL": "1"}
    assert g._kernel(4096, 24576, 2)[2] == 96 * 1024 and (8, 96 * 1024) in attrs  # opted in to 96 KB
    assert g._kernel(4096, 4096, 2, staged=True)[1:] == (32, 2 * 4096 * 2) and "STAGED" not in compiled[-1]
    assert g._kernel(6144, 4096, 2, norm=True, residual=True) == g._kernel(6144, 4096, 2, norm=True, residual=True)
    assert len(compiled) == 5  # variants are compiled once


def test_unroll_halves_until_a_row_is_whole_steps():
    g = CudaGemv(CPU, unroll=8)  # 8 loads a lane: a step of 32 lanes is 256 * 8 values
    assert [g.unroll_for(k) for k in (4096, 12288, 14336, 1024, 3072, 768, 256)] == [8, 8, 8, 4, 4, 1, 1]
    g = CudaGemv(CPU, unroll=2)  # 2 loads a lane at one row, ROW_UNROLL (4) above
    assert [g.unroll_for(k, rows) for k, rows in ((4096, 1), (4096, 2), (1024, 2), (768, 2))] == [2, 4, 4, 1]


def test_projections_fall_back_to_f_linear():
    x, w, b = torch.randn(1, 512), torch.randn(64, 512), torch.randn(64)
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))
    assert torch.equal(linear(x, w, None, CudaGemv(CPU)), F.linear(x, w))  # fp32: not the GEMV's
    assert CudaGemv.unsupported(CPU) == "not a CUDA device" and CudaGemv.build(CPU) is None


def test_use_gemv_reaches_every_projection():
    model = LLM("tiny", max_model_len=64, max_num_seqs=2).engine.core.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.config.num_layers + 1 and all(m.gemv is None for m in linears)
    g = CudaGemv(CPU)
    use_gemv(model, g)
    assert all(m.gemv is g for m in linears)
    use_gemv(model, None)
    assert all(m.gemv is None for m in linears)


def test_the_norm_folds_into_a_projection_only_where_laid_out_as_x(monkeypatch):
    g = CudaGemv(CPU)
    w = torch.zeros((6144, 4096), dtype=torch.bfloat16)
    x, nw = torch.zeros((1, 4096), dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
    assert g.takes_norm(x, None, nw, w) and g.takes_norm(x, x.clone(), nw, w)
    assert not g.takes_norm(x, x.float(), nw, w) and not g.takes_norm(x, None, nw.float(), w)
    assert not g.takes_norm(x, torch.zeros((1, 8192), dtype=torch.bfloat16)[:, ::2], nw, w)
    monkeypatch.setattr(CudaGemv, "FUSE_NORM", False)
    assert not g.takes_norm(x, None, nw, w) and g.takes(x, w)


def test_launch_structs_match_the_driver_layout():
    """cuLaunchKernelEx reads CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out (64-bit)."""
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert (_LaunchConfig.shared_mem.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset, ctypes.sizeof(_LaunchConfig)) == (24, 32, 40, 48, 56)


def test_warps_a_cta_spread_rows_evenly():
    g = CudaGemv(CPU)  # 132 SMs off the GPU
    assert g.warps_for(6144) == 24  # 2 full rounds of 3,168 warps, where 4,224 warps leave one 45 % full
    assert g.warps_for(4096) == 32 and g.warps_for(12288) == 32 and g.warps_for(24576) == 32
    assert g.warps_for(151936) == 32
    assert CudaGemv(CPU, warps=16).warps_for(6144) == 16


def test_o_proj_alone_stages_most_of_its_weights_beside_attention(monkeypatch):
    """The projection after attention copies what 160 KB a CTA of 16 warps holds, less the chunk that waits
    in registers anyway; nothing without programmatic dependent launch (no early start to fill)."""
    g = CudaGemv(CPU)  # 132 SMs off the GPU
    # Qwen3-8B o_proj: 4096 rows over 132 x 16 warps, 2 rows (8 chunks of 4 loads a lane) a warp: 5 fit
    assert g.staged_chunks(4096, 4096) == 5
    assert g.staged_chunks(1024, 2048) == 1  # Qwen3-0.6B: one row of 2 chunks a warp, the second in registers
    assert g.staged_chunks(100, 768) == 2  # one load a lane: a row is 3 chunks
    w = torch.zeros((4096, 4096), dtype=torch.bfloat16)
    assert not g.stages(w)  # no PDL on the CPU
    monkeypatch.setattr(g, "pdl", True)
    assert g.stages(w) and not g.stages(w.float()) and not g.stages(torch.zeros((4096, 4000), dtype=torch.bfloat16))
    monkeypatch.setattr(CudaGemv, "STAGE", False)
    assert not g.stages(w)


def test_o_proj_stages_only_after_an_attention_that_releases_it_early(monkeypatch):
    """o_proj's copy fills the time the attention kernel runs beside it; after a kernel that lets it start
    only at its end (a plain launch: a biased or cuBLAS q/k/v projection, the three-kernel path), the copy
    would only lengthen the projection."""
    import pagedserve.model.layers as layers

    class Backend:
        def __init__(self, early: bool):
            self.early = early

        def forward(self, qkv, positions, layer, kv_cache, meta):
            return torch.zeros((qkv.shape[0], layer.num_heads, layer.head_dim)), self.early

    def projection(x, weight, bias, gemv, staged):
        calls.append(staged)
        return x.new_zeros((x.shape[0], weight.shape[0]))

    attn = LLM("tiny", max_model_len=64, max_num_seqs=2).engine.core.worker.runner.model.model.layers[0].self_attn
    calls = []
    monkeypatch.setattr(layers, "linear", projection)
    for early in (True, False):
        monkeypatch.setattr(attn, "backend", Backend(early))
        attn(torch.zeros(1, dtype=torch.long), torch.zeros((1, 1)), None, None)
    assert calls == [True, False]


def test_the_sass_check_lists_each_variant_once_and_finds_a_hoisted_wait():
    """benchmarks/kernels/gemv_sass.py (run where CUDA's NVRTC and cuobjdump are installed): the variants it
    compiles are the engine's own choices for the model's shapes, and it fails a variant whose wait for the
    kernel before comes ahead of its first weight load."""
    from benchmarks.kernels.gemv_sass import check, variants
    from pagedserve.builtin.known_models import KNOWN_MODELS
    from pagedserve.config import ModelConfig

    found = variants(ModelConfig.from_hf_dict(KNOWN_MODELS["Qwen/Qwen3-8B"]))
    macros = [dict(o[2:].split("=") for o in options if o.startswith("-D")) for options in found]
    assert len(found) == len({tuple(options) for options in found})
    assert {m["ROWS"] for m in macros} == {"1", "2"} and {m["K"] for m in macros} == {"4096", "12288"}
    assert {m["WARPS"] for m in macros if m["ROWS"] == "1" and "STAGED" not in m} == {"24", "32"}  # per shape
    assert [m["K"] for m in macros if "STAGED" in m] == ["4096"]  # o_proj of one sequence, beside attention
    assert {(m["K"], m["ROWS"]) for m in macros if m["SILU_MUL"] == "1"} == {("12288", "1"), ("12288", "2")}
    sass = "        /*{:04x}*/                   {} R1, [R2] ;\n"
    good = "".join(sass.format(16 * i, op) for i, op in enumerate(["S2R", "LDG.E.128", "ACQBULK", "LDG.E", "FFMA"]))
    hoisted = "".join(sass.format(16 * i, op) for i, op in enumerate(["S2R", "ACQBULK", "LDG.E.128", "LDG.E"]))
    staged = "".join(sass.format(16 * i, op) for i, op in enumerate(["@!P0 LDGSTS.E.BYPASS.128", "ACQBULK"]))
    assert check(good) == (True, 5) and check(hoisted) == (False, 4) and check(staged)[0]


def test_every_gemv_variant_compiles_for_hopper_with_its_wait_after_its_first_weight_loads():
    """gemv.cu as the engine compiles it for the decode steps of every model whose facts ship, built for sm_90
    by NVRTC on this GPU-less machine: every variant compiles and waits for the kernel before it only after its
    first weight loads are in flight (else the dependent launch's overlap is silently lost), and none of a 7-8B
    model's spills (ptxas keeps a few words of one Qwen3-0.6B variant on the stack)."""
    from benchmarks.kernels.gemv_sass import inspect
    from pagedserve.builtin.known_models import KNOWN_MODELS
    from pagedserve.config import ModelConfig

    for name, facts in KNOWN_MODELS.items():
        rows = inspect(ModelConfig.from_hf_dict(facts))
        assert rows and all(ok and registers is not None for _, ok, _, registers, _ in rows), (name, rows)
        if "0.6B" not in name:
            assert all(stack == 0 for *_, stack in rows), (name, rows)


def test_the_tensor_core_kernel_matches_f_linear():
    """model/mma_gemv.py under the interpreter, both of the engine's tiles (fp16: the interpreter's bf16 dot is
    not exact); 3 and 16 rows, weights whose last tile is partial."""
    from pagedserve.model.mma_gemv import NARROW, WIDE, mma_gemv

    torch.manual_seed(0)
    w = torch.randn((80, 512), dtype=torch.float16)
    for m in (3, 16):
        for tile in (NARROW, WIDE):
            x = torch.randn((m, 512), dtype=torch.float16)
            ref = F.linear(x.float(), w.float())
            y = mma_gemv(x, w, tile=tile)
            assert y.shape == (m, 80) and y.dtype == x.dtype
            assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-3, tile


def test_the_tensor_core_kernel_forms_silu_gate_times_up_in_gate_up_projections():
    """``gated``: a program's tile holds matching gate and up rows; what it writes equals F.linear, then silu(gate)
    rounded, times up (fp16 under the interpreter), for both tiles, 3 and 16 rows, and a width whose last tile is
    partial; the plain kernel of the same tile gives the product both halves come from."""
    from pagedserve.model.mma_gemv import NARROW, WIDE, mma_gemv

    torch.manual_seed(0)
    w = torch.randn((2 * 72, 512), dtype=torch.float16)
    for m in (3, 16):
        for tile in (NARROW, WIDE):
            x = torch.randn((m, 512), dtype=torch.float16)
            gate, up = mma_gemv(x, w, tile=tile).float().chunk(2, dim=-1)
            want = (gate / (1 + torch.exp(-gate))).half().float() * up
            y = mma_gemv(x, w, tile=tile, gated=True)
            assert y.shape == (m, 72) and y.dtype == x.dtype
            assert ((y.float() - want).abs().max() / want.abs().max()).item() < 1e-3, (m, tile)


def test_gate_up_projections_of_a_few_rows_are_gated_on_the_tensor_cores(monkeypatch):
    """3-16 rows of bf16 go to the gated kernel (silu-mul in gate_up_proj's kernel); one or two rows keep the CUDA
    GEMV (silu-mul folded into down_proj), and with the tensor-core kernel off nothing is gated."""
    g = CudaGemv(CPU)
    gate_up = torch.zeros((2 * 12288, 4096), dtype=torch.bfloat16)
    gated = [m for m in range(1, 33) if g.takes_gated(torch.zeros((m, 4096), dtype=torch.bfloat16), gate_up)]
    assert gated == list(range(3, 17))
    assert not g.takes_gated(torch.zeros((8, 4096)), gate_up.float())
    monkeypatch.setattr(CudaGemv, "MMA", False)
    assert not g.takes_gated(torch.zeros((8, 4096), dtype=torch.bfloat16), gate_up)


def test_the_tensor_core_kernel_takes_wide_weights_of_a_few_rows():
    """Which projections go to the tensor-core kernel, and with which tile; the norm stays a kernel of its own there,
    and down_proj takes no [gate | up] rows (gate_up_proj's kernel forms silu(gate) * up, ``gated``)."""
    from pagedserve.model.mma_gemv import NARROW, WIDE, tile_for

    assert tile_for(6144, 4096) is WIDE and tile_for(151936, 4096) is WIDE and tile_for(24576, 4096) is WIDE
    assert tile_for(4096, 4096) is NARROW and tile_for(4096, 12288) is NARROW
    assert tile_for(2048, 1024) is None and tile_for(4096, 4000) is None  # too few rows; K not whole steps
    g = CudaGemv(CPU)
    down, x8 = torch.zeros((4096, 12288), dtype=torch.bfloat16), torch.zeros((8, 12288), dtype=torch.bfloat16)
    assert g.takes(x8, down) and not g.takes(torch.zeros((8, 2 * 12288), dtype=torch.bfloat16), down, silu_mul=True)
    assert not g.takes(x8.float(), down.float())  # fp32: cuBLAS, not a TF32 dot
    assert not g.takes(torch.zeros((8, 2 * 12288), dtype=torch.bfloat16)[:, ::2], down)
    w, nw = torch.zeros((6144, 4096), dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
    x4 = torch.zeros((4, 4096), dtype=torch.bfloat16)
    assert g.takes(x4, w) and not g.takes_norm(x4, None, nw, w)
