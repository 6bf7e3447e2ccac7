"""Greedy tokens must equal Hugging Face transformers' on identical weights, for every architecture,
alone and in batches of mixed lengths, and whatever the scheduling knobs."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "Hello world!",
    "The scheduler limits each step by the number of sequences and by the number of batched tokens.",
    "Paris",
    "Continuous batching keeps the accelerator busy by admitting new requests whenever others finish. " * 3,
]
MAX_TOKENS = 24


def hf_greedy(path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def references(checkpoints):
    """Per architecture: (prompt token ids, HF greedy continuations)."""
    from transformers import AutoTokenizer

    refs = {}
    for arch, path in checkpoints.items():
        tok = AutoTokenizer.from_pretrained(path)
        ids = [tok.encode(p) for p in PROMPTS]
        refs[arch] = (ids, hf_greedy(path, ids, MAX_TOKENS))
    return refs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch, checkpoints, references):
    ids, expected = references[arch]
    llm = LLM(str(checkpoints[arch]), kv_cache_memory="16MiB")
    # one at a time
    for prompt, want in zip(ids, expected):
        got = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
    # all together, mixed lengths, in input order
    outs = llm.generate(ids, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == ids


@pytest.mark.parametrize("knobs", [
    dict(max_num_batched_tokens=16, max_num_seqs=2),   # chunked prefill of every prompt, tiny batches
    dict(max_num_batched_tokens=40, max_num_seqs=16),  # prefill chunks mixed with decodes
    dict(block_size=1),
    dict(block_size=64),
    dict(max_num_seqs=1),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
])
def test_scheduling_knobs_do_not_change_outputs(knobs, checkpoints, references):
    ids, expected = references["qwen3"]
    llm = LLM(str(checkpoints["qwen3"]), kv_cache_memory="16MiB", **knobs)
    outs = llm.generate(ids, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_preemption_does_not_change_outputs(checkpoints, references):
    ids, expected = references["llama"]
    longest = max(len(i) for i in ids) + MAX_TOKENS
    blocks = -(-longest // 16) + 1  # room for the longest request, far from room for all at once
    llm = LLM(str(checkpoints["llama"]), num_gpu_blocks_override=blocks, max_model_len=blocks * 16)
    outs = llm.generate(ids * 3, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected * 3
    assert llm.engine.core.counters.num_preemptions > 0
    assert llm.engine.core.pool.num_free_blocks == blocks


def test_fp8_kv_cache_runs_and_stays_close(checkpoints, references):
    """fp8 storage changes numerics, so only ask that most greedy tokens agree."""
    ids, expected = references["qwen2"]
    llm = LLM(str(checkpoints["qwen2"]), kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    outs = llm.generate(ids, greedy(), use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    assert sum(a == b[0] for a, b in zip(firsts, expected)) >= len(ids) - 1


def test_prefix_cache_hits_do_not_change_outputs(checkpoints, references):
    ids, expected = references["qwen2"]
    shared = ids[3]  # the long prompt; variants share its first 64+ tokens
    variants = [shared[:70] + [7, 8, 9], shared[:66] + [5], shared]
    off = LLM(str(checkpoints["qwen2"]), kv_cache_memory="16MiB", enable_prefix_caching=False)
    on = LLM(str(checkpoints["qwen2"]), kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in off.generate(variants, greedy(), use_tqdm=False)]
    on.generate([shared], greedy(), use_tqdm=False)  # fills the cache
    got = [o.outputs[0].token_ids for o in on.generate(variants, greedy(), use_tqdm=False)]
    assert got == want and want[2] == expected[3]
    counters = on.engine.core.counters
    assert counters.prefix_cache_hits >= 3 * 64 and counters.prefix_cache_queries > counters.prefix_cache_hits
