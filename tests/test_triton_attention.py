"""The Triton paged-attention kernels against the torch reference backend, on mixed batches of decodes
and prefill chunks with cached context (GQA, several block sizes, split-KV decode). On CPU they run
under TRITON_INTERPRET=1 (set in conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from pagedserve.model.triton_attention import TritonAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(rng, query_lens, context_lens, block_size, num_blocks):
    """Block tables from a shuffled pool, slots for the new tokens, metadata as the runner builds it."""
    free = list(rng.permutation(num_blocks))
    tables, slots = [], []
    for q, c in zip(query_lens, context_lens):
        n_blocks = -(-(q + c) // block_size)
        table = [int(free.pop()) for _ in range(n_blocks)]
        tables.append(table)
        pos = np.arange(c, c + q)
        slots.append(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = np.asarray(query_lens) + np.asarray(context_lens)
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(DEV),
        query_start_loc=torch.from_numpy(starts).to(DEV),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(DEV),
        block_tables=torch.from_numpy(bt).to(DEV),
        max_query_len=int(max(query_lens)), max_seq_len=int(seq_lens.max()),
        query_lens_cpu=np.asarray(query_lens))


@pytest.mark.parametrize("block_size, heads, kv_heads, sms", [(16, 4, 2, 132), (8, 8, 2, 100000), (32, 2, 2, 132)])
def test_triton_matches_reference_on_mixed_batches(block_size, heads, kv_heads, sms):
    rng = np.random.default_rng(block_size + heads)
    torch.manual_seed(block_size)
    head_dim = 16
    query_lens = [1, 1, 37, 1, 5]       # decodes, a prefill chunk, a short chunk
    context_lens = [70, 3, 20, 130, 0]  # keys already in the cache before this step
    num_blocks = 64
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), device=DEV)
    meta_ref = make_batch(rng, query_lens, context_lens, block_size, num_blocks)
    meta_tri = AttentionMetadata(**{**meta_ref.__dict__, "backend_state": None})
    T = sum(query_lens)
    q = torch.randn((T, heads, head_dim), device=DEV)
    k = torch.randn((T, kv_heads, head_dim), device=DEV)
    v = torch.randn((T, kv_heads, head_dim), device=DEV)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend(heads, kv_heads, head_dim, num_sms=sms)
    ref.prepare(meta_ref, block_size)
    tri.prepare(meta_tri, block_size)
    if sms > 1000:
        assert meta_tri.backend_state.decode.num_segments > 1  # the split-KV path is exercised
    want = ref.forward(q, k, v, ref_cache, meta_ref, head_dim ** -0.5)
    got = tri.forward(q, k, v, tri_cache, meta_tri, head_dim ** -0.5)
    assert torch.equal(ref_cache, tri_cache)  # the same K/V writes
    err = (got - want).norm() / want.norm()
    assert err < 1e-4, float(err)


def test_engine_with_triton_backend_matches_torch_backend():
    from pagedserve import LLM, SamplingParams

    prompts = ["Hello world", "The scheduler limits each step by the number of sequences", "Paris"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(kv_cache_memory="4MiB", max_num_batched_tokens=16, max_num_seqs=4)  # chunks mixed with decodes
    ref = LLM("tiny", attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    tri = LLM("tiny", attention_backend="triton", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
