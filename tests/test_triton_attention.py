"""The Triton attention path (fused norms/rotary/K-V store + paged attention) against the torch
reference, on mixed batches of decodes and prefill chunks with cached context: GQA, Qwen3's q/k norms,
several block sizes, split-KV decode. On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from pagedserve.model.cuda_gemv import CudaGemv  # noqa: E402
from pagedserve.model.decoder import Attention  # noqa: E402
from pagedserve.model.layers import RotaryEmbedding, use_gemv  # noqa: E402
from pagedserve.model.triton_attention import TritonAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(rng, query_lens, context_lens, block_size, num_blocks):
    """Block tables from a shuffled pool, slots for the new tokens, metadata as the runner builds it."""
    free = list(rng.permutation(num_blocks))
    tables, slots = [], []
    for q, c in zip(query_lens, context_lens):
        table = [int(free.pop()) for _ in range(-(-(q + c) // block_size))]
        tables.append(table)
        pos = np.arange(c, c + q)
        slots.append(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
    bt = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = np.asarray(query_lens) + np.asarray(context_lens)
    positions = np.concatenate([np.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(DEV),
        query_start_loc=torch.from_numpy(starts).to(DEV),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(DEV),
        block_tables=torch.from_numpy(bt).to(DEV),
        max_query_len=int(max(query_lens)), max_seq_len=int(seq_lens.max()),
        query_lens_cpu=np.asarray(query_lens))
    return meta, torch.from_numpy(positions).to(DEV)


def attention_pair(model_type, heads, kv_heads, head_dim, dtype, sms=132):
    """The same attention layer (same weights) on the torch and the Triton backend; on a GPU the Triton
    layer's one-row projections run on the CUDA GEMV, as in the engine (which decides how the fused decode
    is launched)."""
    cfg = ModelConfig.from_hf_dict(dict(
        model_type=model_type, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=64,
        max_position_embeddings=8192, rope_theta=1e6))
    rotary = RotaryEmbedding(cfg, 8192).to(DEV)
    ref = Attention(cfg, rotary, TorchAttentionBackend()).to(DEV, dtype)
    backend = TritonAttentionBackend(heads, kv_heads, head_dim, sms, TritonAttentionBackend.pdl_supported(DEV))
    tri = Attention(cfg, rotary, backend).to(DEV, dtype)
    use_gemv(tri, CudaGemv.build(DEV) if DEV.type == "cuda" else None)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.ndim > 1 else 1.0)
    tri.load_state_dict(ref.state_dict())
    rotary.cos, rotary.sin = rotary.cos.float(), rotary.sin.float()
    return ref, tri


def compare(model_type, heads, kv_heads, head_dim, block_size, query_lens, context_lens, dtype=torch.float32,
            kv_dtype=None, sms=132, segmented=False, wide=False):
    rng = np.random.default_rng(block_size + heads)
    torch.manual_seed(block_size)
    num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 4
    ref, tri = attention_pair(model_type, heads, kv_heads, head_dim, dtype, sms)
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), device=DEV).to(kv_dtype or dtype)
    meta_ref, positions = make_batch(rng, query_lens, context_lens, block_size, num_blocks)
    meta_tri = AttentionMetadata(**{**meta_ref.__dict__, "backend_state": None})
    ref.backend.prepare(meta_ref, block_size)
    tri.backend.prepare(meta_tri, block_size)
    if segmented:
        assert meta_tri.backend_state.decode.num_segments > 1  # the split-KV path is exercised
    if wide:
        assert meta_tri.backend_state.prefill.block_q == tri.backend.wide_block_q > tri.backend.prefill_block_q
    x = torch.randn((sum(query_lens), heads * head_dim), device=DEV, dtype=dtype)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        want = ref(positions, ref.qkv_proj(x), ref_cache, meta_ref).float()
        got = tri(positions, tri.qkv_proj(x), tri_cache, meta_tri).float()
    cache_err = (tri_cache.float() - ref_cache.float()).norm() / ref_cache.float().norm()
    return float((got - want).norm() / want.norm()), float(cache_err)


@pytest.mark.parametrize("model_type, block_size, heads, kv_heads, sms", [
    ("llama", 16, 4, 2, 132), ("qwen3", 8, 8, 2, 100000), ("qwen3", 32, 2, 2, 132)])
def test_triton_matches_reference_on_mixed_batches(model_type, block_size, heads, kv_heads, sms):
    # decodes, a prefill chunk after cached context (whole key tiles, then the diagonal's), a short chunk,
    # a fresh prompt
    segmented = sms > 1000  # so many SMs to fill that long decodes are split over segments
    contexts = [700, 3, 150, 530, 0] if segmented else [70, 3, 150, 130, 0]
    err, cache_err = compare(model_type, heads, kv_heads, 16, block_size, [1, 1, 37, 1, 5], contexts,
                             sms=sms, segmented=segmented)
    assert err < 1e-4 and cache_err < 1e-5, (err, cache_err)


def test_each_requests_longest_prompt_tiles_start_first():
    """A prompt tile's keys grow with its offset: the tiles go to the launch last offset first, so the longest
    do not make up its last wave."""
    backend = TritonAttentionBackend(8, 2, 16, 132)  # 4 query heads a KV head: 16-token tiles
    decodes, tiles = backend._tiles(np.array([1, 40, 1, 17]), backend.prefill_block_q)
    assert decodes.tolist() == [0, 2]
    assert tiles.tolist() == [[3, 3, 1, 1, 1], [16, 0, 32, 16, 0]] and tiles.flags["C_CONTIGUOUS"]


def test_prompt_tiles_widen_where_they_fill_the_gpu_even_so():
    """Few SMs to fill: the step's prompt chunks run wide tiles (twice the tokens a tile), still exact."""
    err, cache_err = compare("qwen3", 8, 2, 16, 16, [1, 37, 1, 70], [90, 100, 33, 0], sms=2, wide=True)
    assert err < 1e-4 and cache_err < 1e-5, (err, cache_err)
    backend = TritonAttentionBackend(8, 2, 16, 132)
    assert backend._block_q(np.array([1, 240, 1])) == backend.prefill_block_q  # 8 wide tiles x 2 heads < 264
    assert backend._block_q(np.array([1, 8192])) == backend.wide_block_q


@pytest.mark.parametrize("one_launch", [True, False])
def test_a_mixed_steps_tiles_run_in_one_launch_or_two_alike(monkeypatch, one_launch):
    """Unsplit decodes and prefill tiles (chunks after context, a fresh prompt) in one kernel launch, or in
    two: both match the reference (the padded steps of CUDA graphs take the same path: the engine test of
    padded prompt steps)."""
    import pagedserve.model.triton_attention as ta

    monkeypatch.setattr(TritonAttentionBackend, "ONE_LAUNCH", one_launch)
    if one_launch:
        monkeypatch.setattr(ta, "_paged_attention", _Refused())
    else:
        monkeypatch.setattr(ta, "_mixed_attention", _Refused())
    err, cache_err = compare("qwen3", 8, 2, 16, 16, [1, 19, 1, 1, 6], [90, 100, 0, 33, 0])
    assert err < 1e-4 and cache_err < 1e-5, (err, cache_err)


class _Refused:
    """Stands in for a kernel (``fn[grid](...)``) or a function (``fn(...)``) that must not run."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("a kernel or function this path must not take ran")

    __getitem__ = __call__ = _refuse


@pytest.mark.parametrize("model_type, heads, kv_heads, sms", [
    ("qwen3", 8, 2, 100000), ("llama", 4, 2, 100000), ("qwen3", 4, 4, 1)])
def test_decode_only_steps_run_one_fused_kernel_that_matches_the_reference(monkeypatch, model_type, heads, kv_heads,
                                                                           sms):
    """q/k norm + rotary, the K/V store, attention and (split over segments) the merge in one kernel: no
    qkv_rope_store, no merge kernel; a one-token prompt (nothing cached yet) among long decodes."""
    import pagedserve.model.triton_attention as ta

    monkeypatch.setattr(ta, "qkv_rope_store", _Refused())
    monkeypatch.setattr(ta, "_merge_segments", _Refused())
    monkeypatch.setattr(ta, "_paged_attention", _Refused())
    segmented = sms > 1000
    err, cache_err = compare(model_type, heads, kv_heads, 16, 16, [1] * 5, [700, 0, 130, 1, 64], sms=sms,
                             segmented=segmented)
    assert err < 1e-4 and cache_err < 1e-5, (err, cache_err)


def test_fused_decode_resets_its_counts_and_leaves_padding_rows_at_zero(monkeypatch):
    """A CUDA graph pads a batch with rows of sequence length 0: their output is 0 (no key, not NaN) and
    they leave the real rows alone; every (request, KV head) count is back at 0 for the next layer."""
    import pagedserve.model.triton_attention as ta

    monkeypatch.setattr(ta, "qkv_rope_store", _Refused())  # the fused kernel, not the three-kernel path
    ref, tri = attention_pair("qwen3", 8, 2, 16, torch.float32, sms=100000)
    meta, positions = make_batch(np.random.default_rng(0), [1, 1, 1], [300, 40, 0], 16, 40)
    meta.seq_lens[2] = 0  # the padding row (its one token goes to a slot nobody reads)
    tri.backend.prepare(meta, 16)
    assert meta.backend_state.decode.num_segments > 1
    cache = torch.randn((2, 40, 16, 2, 16), device=DEV)
    x = torch.randn((3, 8 * 16), device=DEV)
    with torch.no_grad():
        out, _ = tri.backend.forward(tri.qkv_proj(x), positions, tri, cache, meta)
    assert torch.isfinite(out).all() and not out[2].any()
    assert not meta.backend_state.counts.any()
    with torch.no_grad():  # the first two rows as a batch of their own: the same output
        meta2, _ = make_batch(np.random.default_rng(0), [1, 1], [300, 40], 16, 40)
        tri.backend.prepare(meta2, 16)
        again, _ = tri.backend.forward(tri.qkv_proj(x[:2]), positions[:2], tri, cache.clone(), meta2)
    torch.testing.assert_close(again, out[:2])


def read_path_error(heads, kv_heads, head_dim, block_size, query_lens, context_lens, kv_dtype,
                    triton_backend=None) -> float:
    """Both backends attend over ONE shared cache: the read path alone, without the writes' rounding
    (fp8 writes may round an element one step apart, and an e4m3 step is up to 12 %)."""
    nblocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 2
    cache = torch.randn((2, nblocks, block_size, kv_heads, head_dim), device=DEV).to(kv_dtype)
    q = torch.randn((sum(query_lens), heads, head_dim), device=DEV, dtype=torch.bfloat16 if DEV.type == "cuda" else torch.float32)
    outs = []
    for backend in (TorchAttentionBackend(), triton_backend or TritonAttentionBackend(heads, kv_heads, head_dim)):
        meta, _ = make_batch(np.random.default_rng(1), query_lens, context_lens, block_size, nblocks)
        backend.prepare(meta, block_size)
        outs.append(backend.attend(q, cache, meta, head_dim ** -0.5).float())
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


@pytest.mark.parametrize("sms, one_launch", [(132, True), (2, False)])
def test_triton_reads_an_fp8_cache_like_the_reference(monkeypatch, sms, one_launch):
    """fp8 keys/values (the kernel computes its dots in fp16, exact for e4m3 values); the interpreter
    rounds fp32 -> fp8 writes its own way, so the GPU's writes are checked in benchmarks/gpu_check.py. A mixed
    step's fp8 decodes (one warp in their own launch, the prefill tiles four) share its launch only while
    they are too few to fill the GPU: 2 decodes x 2 KV heads on 132 SMs, not on 2."""
    import pagedserve.model.triton_attention as ta

    monkeypatch.setattr(ta, "_paged_attention" if one_launch else "_mixed_attention", _Refused())
    err = read_path_error(4, 2, 16, 16, [1, 1, 9], [40, 75, 12], torch.float8_e4m3fn,
                          TritonAttentionBackend(4, 2, 16, num_sms=sms))
    assert err < 2e-3, err


def test_engine_with_triton_backend_matches_torch_backend():
    from pagedserve import LLM, SamplingParams

    prompts = ["Hello world", "The scheduler limits each step by the number of sequences", "Paris"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(kv_cache_memory="4MiB", max_num_batched_tokens=16, max_num_seqs=4)  # chunks mixed with decodes
    ref = LLM("tiny", attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    tri = LLM("tiny", attention_backend="triton", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]


def test_padded_prompt_steps_match_the_torch_backend(monkeypatch):
    """The fixed-size steps that CUDA graphs replay (inputs uploaded in one copy, padding tokens, unused
    tiles pointing at the empty row), run here kernel by kernel: every step with prompt tokens goes through
    them, with and without decodes, and the greedy tokens equal the reference backend's."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.model.runner import ModelRunner

    prompts = ["Hello world", "The scheduler limits each step by the number of sequences and tokens", "Paris",
               "A fourth prompt, long enough to be cut into several chunks by the token budget of a step"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(kv_cache_memory="4MiB", max_num_batched_tokens=40, max_num_seqs=3)
    ref = LLM("tiny", attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", attention_backend="triton", **kw)
    runner = llm.engine.core.worker.runner
    runner.capture_prompt_graphs(graphs=False)
    assert sorted(runner._prompt_graphs) == [16, 32]
    padded, filled, real = [], [], ModelRunner._replay_prompt

    def spy(self, inp):
        hidden = real(self, inp)
        padded.append((hidden is not None, bool((inp.query_lens == 1).any())))
        filled.append(hidden is not None and len(inp.fill_rows) > 0)
        return hidden

    monkeypatch.setattr(ModelRunner, "_replay_prompt", spy)
    tri = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
    assert (True, True) in padded and (True, False) in padded  # mixed with decodes, and prompts alone
    assert (False, True) in padded or (False, False) in padded  # over 32 tokens: kernel by kernel
    assert any(filled)  # decodes whose input token was still in flight, filled in on the device


def test_padded_decode_steps_match_the_torch_backend(monkeypatch):
    """The decode steps that CUDA graphs replay (inputs uploaded in one copy, padding rows, in-flight
    tokens filled in on the device), run here kernel by kernel: the greedy tokens equal the reference
    backend's, over batches that fill a graph's size and batches padded up to one."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.model.runner import ModelRunner

    prompts = ["Hello world", "The scheduler limits each step", "Paris", "A fourth prompt"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 9, 6, 3)]
    kw = dict(kv_cache_memory="4MiB", max_num_seqs=5)
    ref = LLM("tiny", attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", attention_backend="triton", **kw)
    runner = llm.engine.core.worker.runner
    runner.capture_decode_graphs(graphs=False)
    assert sorted(runner._graphs) == [1, 2, 4, 5]
    replayed, real = [], ModelRunner._replay_decode

    def spy(self, inp):
        logits = real(self, inp)
        if logits is not None:
            replayed.append((len(inp.query_lens), len(inp.fill_rows)))
        return logits

    monkeypatch.setattr(ModelRunner, "_replay_decode", spy)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    batches = {n for n, _ in replayed}
    assert {4, 3, 2, 1} <= batches  # 3 rows replay the graph of 4
    assert all(fills == n for n, fills in replayed)  # each decode's input token was still in flight


def test_start_up_runs_every_attention_variant_a_step_can_choose(monkeypatch):
    """Decode graphs compile only their own batch sizes' variants; eager steps choose split factors by
    batch and length, so the runner's warm-up must launch each of them next to prefill tiles (unsplit:
    both in one launch), prefill tiles alone, and a decode-only step (the fused kernel)."""
    from pagedserve import LLM

    launched, fused, mixed = [], [], []
    real, real_fused = TritonAttentionBackend._launch, TritonAttentionBackend._fused_decode
    real_mixed = TritonAttentionBackend._launch_mixed

    def spy(self, q, kv_cache, out, meta, st, launch, scale):
        launched.append((launch.block_q, launch.num_segments, st.decode is None))
        return real(self, q, kv_cache, out, meta, st, launch, scale)

    def spy_mixed(self, q, kv_cache, out, meta, st, scale):
        mixed.append(st.decode.num_segments)
        return real_mixed(self, q, kv_cache, out, meta, st, scale)

    def spy_fused(self, qkv, positions, layer, qw, kw, eps, kv_cache, meta, st, pdl):
        fused.append(st.decode.num_segments)
        return real_fused(self, qkv, positions, layer, qw, kw, eps, kv_cache, meta, st, pdl)

    monkeypatch.setattr(TritonAttentionBackend, "_launch", spy)
    monkeypatch.setattr(TritonAttentionBackend, "_fused_decode", spy_fused)
    monkeypatch.setattr(TritonAttentionBackend, "_launch_mixed", spy_mixed)
    llm = LLM("tiny", attention_backend="triton", kv_cache_memory="4MiB", max_model_len=2048)
    backend = llm.engine.core.worker.runner.backend
    top = backend.decode_segments(1, 2048)
    assert top == 16  # 2 KV heads, 2048 keys: sixteen segments of one 128-key tile for one long decode
    decode_splits = {segs for block_q, segs, _ in launched if block_q == 1}
    assert set(mixed) == {1} and decode_splits == {2, 4, 8, 16} and set(fused) == {1, 2, 4, 8, 16}
    for block_q in (backend.prefill_block_q, backend.wide_block_q):  # narrow and wide prompt tiles
        assert {(block_q, 1, False), (block_q, 1, True)} <= set(launched)


def test_cuda_fp8_decode_compiles_for_hopper_without_spilling():
    """fp8_decode.cu as the engine builds it for the query-head groups of every model whose facts ship,
    compiled for sm_90 by NVRTC on this GPU-less machine (its numbers are checked on the GPU by gpu_check)."""
    from benchmarks.kernels.gemv_sass import cuda_tools, machine_code
    from pagedserve.builtin.known_models import KNOWN_MODELS
    from pagedserve.model.cuda_decode import _KERNEL, _SOURCE, CudaFp8Decode

    tools, source = cuda_tools(), _SOURCE.read_text()
    groups = {f["num_attention_heads"] // f["num_key_value_heads"] for f in KNOWN_MODELS.values()}
    for group in sorted(groups):
        options = CudaFp8Decode.options(group, 16, CudaFp8Decode.WARPS, CudaFp8Decode.PREFETCH)
        sass, registers, stack = machine_code(tools, source, options, "sm_90", _KERNEL)
        assert "LDG" in sass and registers and stack == 0, (group, registers, stack)


def test_cuda_fp8_decode_serves_only_the_launches_it_covers():
    """The CUDA fp8 decode (checked against the torch reference on the GPU by benchmarks/gpu_check.py)
    takes e4m3 decodes of head dim 128, <= 8 heads a KV head and blocks a multiple of 16 on CUDA; every other
    launch, and every launch here on the CPU, runs the Triton kernel and the reason is logged."""
    from pagedserve.model.cuda_decode import CudaFp8Decode

    cpu = torch.device("cpu")
    assert "head dim 64" in CudaFp8Decode.unsupported(4, 64, 16, cpu)
    assert "16 query heads" in CudaFp8Decode.unsupported(16, 128, 16, cpu)
    assert "block size 8" in CudaFp8Decode.unsupported(4, 128, 8, cpu)
    assert CudaFp8Decode.unsupported(4, 128, 32, cpu) == "not a CUDA device"
    assert CudaFp8Decode.build(4, 8, 128, 32, cpu) is None
    be = TritonAttentionBackend(8, 2, 128)
    meta, _ = make_batch(np.random.default_rng(0), [1, 1], [5, 40], 16, 8)
    be.prepare(meta, 16)
    cache = torch.zeros((2, 8, 16, 2, 128), dtype=torch.float8_e4m3fn, device=DEV)
    q = torch.zeros((2, 8, 128), dtype=torch.bfloat16, device=DEV)
    st = meta.backend_state
    if DEV.type == "cpu":
        assert be._cuda_kernel(q.dtype, cache, st.decode, st) is None
    assert be._cuda_kernel(torch.float32, cache, st.decode, st) is None  # fp32 queries: Triton
    assert be._cuda_kernel(q.dtype, cache.view(torch.float8_e5m2), st.decode, st) is None  # e5m2: Triton


def test_prompt_graph_sizes_pad_a_long_step_by_at_most_an_eighth():
    from pagedserve.model.runner import prompt_graph_sizes

    assert prompt_graph_sizes(512)[-1] == 512 and prompt_graph_sizes(40) == [16, 32]
    assert prompt_graph_sizes(0) == []
    sizes = prompt_graph_sizes(4096)
    assert sizes[8:17] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert sizes[24:26] == [1024, 1152] and sizes[-2:] == [3840, 4096] and len(sizes) == 41
    assert prompt_graph_sizes(3000)[-1] == 3000
    for n in range(257, 4097):  # each step's graph: the smallest size that holds it
        size = min(t for t in sizes if t >= n)
        assert size - n <= n / 8, (n, size)


def test_prompt_graphs_never_exceed_the_step_budget():
    from pagedserve.config import EngineArgs
    from pagedserve.model.runner import prompt_graph_sizes

    cfg = EngineArgs(max_num_batched_tokens=3000, max_num_seqs=16, max_cudagraph_capture_size=8192).create_config()
    assert cfg.max_cudagraph_capture_size == 3000 and prompt_graph_sizes(cfg.max_cudagraph_capture_size)[-1] == 3000


def test_prompt_graphs_reach_the_step_budget_unless_told():
    """Steps with prompt tokens replay graphs up to 4096 tokens (a step launched kernel by kernel waits on the
    host), at most the step budget, whatever the model; a size given on the command line wins."""
    from pagedserve.config import EngineArgs

    def capture(model, **kw):
        return EngineArgs(model=model, load_format="dummy", **kw).create_config().max_cudagraph_capture_size

    assert capture("Qwen/Qwen3-8B", max_num_batched_tokens=8192) == 4096
    assert capture("Qwen/Qwen3-0.6B", max_num_batched_tokens=16384) == 4096
    assert capture("Qwen/Qwen3-0.6B", max_num_batched_tokens=2048) == 2048
    assert capture("Qwen/Qwen3-8B", max_num_batched_tokens=8192, max_cudagraph_capture_size=512) == 512


_COMPILE_FUSED_DECODE = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass
from pagedserve.model.triton_attention import _fused_decode

names = _fused_decode.arg_names
pointers = dict(QKV="*bf16", Pos="*i64", Cos="*fp32", Sin="*fp32", QW="*bf16", KW="*bf16", Slots="*i64",
                KV="*bf16", Out="*bf16", PartAcc="*fp32", PartML="*fp32", Counter="*i32", block_tables="*i32",
                seq_lens="*i32", scale="fp32", eps="fp32")
found = {}
for label, pdl, prefetch in (("pdl", True, 0), ("prefetch", True, 2), ("plain", False, 0)):
    const = dict(G=4, G_POW2=4, BLOCK_M=16, HEAD_DIM=128, NUM_Q=32, NUM_KV=8, TILE=128, PAGE=16, NUM_SEGMENTS=16,
                 FP16_DOTS=False, V_CVT_ASM=False, QK_NORM=True, PDL=pdl, PREFETCH_LINES=prefetch, STAGES=3)
    sig = {n: pointers.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(_fused_decode, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)).asm
    lines = [line.strip() for line in asm["ptx"].splitlines()]
    found[label] = [line.split()[0].rstrip(";") for line in lines if line.startswith(("griddepcontrol", "prefetch"))]
    # ptxas's order: global loads, L2 prefetches (CCTL.E.PF2), the wait (ACQBULK), the release (PREEXIT)
    ops = re.findall(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", get_sass(asm["cubin"]), re.M)  # control, opcode
    found[label + " sass"] = [op for op in ops if op.startswith(("LDG", "CCTL", "ACQBULK", "PREEXIT"))]
print(json.dumps(found))
"""


def test_fused_decode_compiles_for_hopper_with_its_dependent_launch():
    """The GPU-only branch the interpreter never runs: compiled for sm_90, the fused decode waits for the
    q/k/v projection and then releases the next kernel (griddepcontrol), and without PDL does neither; with
    the prefetch, each of its 128 threads pulls 4 of the first tile's 512 K/V lines (128 keys x 2 lines x K
    and V) into L2 before the wait; in the machine code as in the PTX."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    run = subprocess.run([sys.executable, "-c", _COMPILE_FUSED_DECODE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["pdl"] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
    assert found["prefetch"] == ["prefetch.global.L2"] * 4 + found["pdl"]
    assert found["plain"] == []
    # and ptxas keeps the wait after the loads of what the host wrote and after the prefetches: hoisting it (an
    # acquire, so legal) would leave them to start only once the projection has finished
    for label in ("pdl", "prefetch"):
        sass = found[label + " sass"]
        assert "ACQBULK" in sass and sass.index("PREEXIT") > sass.index("ACQBULK")
        early = sass[:sass.index("ACQBULK")]
        assert any(op.startswith("LDG") for op in early)
        assert early.count("CCTL.E.PF2") == (4 if label == "prefetch" else 0) == sass.count("CCTL.E.PF2")
    assert not {"ACQBULK", "PREEXIT"} & set(found["plain sass"])


def test_the_fused_decode_is_a_dependent_only_after_the_one_row_gemv(monkeypatch):
    """Launched early only where the q/k/v projection ran on the CUDA GEMV (which releases it): one bf16 row,
    no bias, a device with programmatic dependent launch."""
    _, tri = attention_pair("qwen3", 16, 2, 16, torch.bfloat16)  # 256 columns: a length the GEMV covers
    backend, row = tri.backend, torch.zeros((1, 16 * 16 + 2 * 2 * 16), dtype=torch.bfloat16, device=DEV)
    monkeypatch.setattr(backend, "has_pdl", True)
    assert not backend.releases_early(tri, row)  # no GEMV: cuBLAS ran the projection
    use_gemv(tri, CudaGemv(torch.device("cpu")))
    assert backend.releases_early(tri, row)
    assert not backend.releases_early(tri, torch.zeros((2, row.shape[1]), dtype=torch.bfloat16, device=DEV))
    assert not backend.releases_early(tri, row.float())
    tri.qkv_proj.bias = torch.nn.Parameter(torch.zeros(row.shape[1], dtype=torch.bfloat16))  # F.linear's
    assert not backend.releases_early(tri, row)
    tri.qkv_proj.bias = None
    monkeypatch.setattr(backend, "has_pdl", False)
    assert not backend.releases_early(tri, row)


_COMPILE_MIXED = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.model.triton_attention import _mixed_attention, _paged_attention

def shared(kernel, pointers, const, warps, stages):
    names = kernel.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages)).metadata.shared

found = {}
for kv, fp8 in (("*bf16", False), ("*fp8e4nv", True)):
    ptrs = dict(Q="*bf16", KV=kv, Out="*bf16", PartAcc="*fp32", PartML="*fp32", block_tables="*i32",
                seq_lens="*i32", query_start="*i32", tile_seq="*i32", tile_qoff="*i32", dec_seq="*i32",
                dec_qoff="*i32", pre_seq="*i32", pre_qoff="*i32", scale="fp32")
    both = shared(_mixed_attention, ptrs, dict(G=4, HEAD_DIM=128, PAGE=16, FP16_DOTS=fp8, DEC_BLOCK_M=16,
                  DEC_TILE=64, DEC_STAGES=3, DEC_V_ASM=fp8, PRE_BLOCK_Q=16, PRE_BLOCK_M=64, PRE_TILE=64,
                  PRE_STAGES=2), 4, 3)
    alone = [shared(_paged_attention, ptrs, dict(G=4, BLOCK_Q=bq, BLOCK_M=bm, HEAD_DIM=128, TILE=64, PAGE=16,
                    NUM_SEGMENTS=1, FP16_DOTS=fp8, V_CVT_ASM=fp8 and bq == 1, STAGES=st), 4, st)
             for bq, bm, st in ((1, 16, 3), (16, 64, 2))]
    found[kv] = [both, *alone]
print(json.dumps(found))
"""


def test_a_mixed_launch_compiles_for_hopper_with_the_larger_branchs_shared_memory():
    """The one-launch kernel compiled for sm_90 (bf16, and fp8 with V converted by asm, which the interpreter
    never runs): its two branches reuse one shared-memory allocation, so it holds no more than the prefill
    tile alone and as many programs fit on an SM as with two launches."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_MIXED], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for kv, (both, decode, prefill) in json.loads(run.stdout.strip().splitlines()[-1]).items():
        assert both == max(decode, prefill) > 0, (kv, both, decode, prefill)
