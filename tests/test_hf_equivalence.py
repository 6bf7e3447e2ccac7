"""Greedy tokens must equal Hugging Face transformers' on identical weights, for every architecture,
alone and in batches of mixed lengths, and whatever the scheduling knobs."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError

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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"])
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


def test_yarn_from_the_file_or_hf_overrides_matches_transformers(checkpoints, references, tmp_path):
    """Qwen3's weights with YaRN (positions past the 64 it was "trained" at, where its ramp and attention factor
    act): in config.json, or laid over the unscaled file with --hf-overrides, greedy tokens equal transformers'
    on the file that has it. The context limit becomes the trained length times the factor."""
    import json
    import shutil

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    scaled = tmp_path / "qwen3-yarn"
    shutil.copytree(checkpoints["qwen3"], scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], **yarn}
    config["max_position_embeddings"] = 256
    (scaled / "config.json").write_text(json.dumps(config))
    ids, unscaled = references["qwen3"]
    assert max(map(len, ids)) > 64
    expected = hf_greedy(scaled, ids, MAX_TOKENS)
    assert expected != unscaled  # the scaling changes what the model says
    overridden = LLM(str(checkpoints["qwen3"]), kv_cache_memory="16MiB",
                     hf_overrides={"rope_scaling": yarn, "max_position_embeddings": 256})
    for llm in (LLM(str(scaled), kv_cache_memory="16MiB"), overridden):
        assert llm.engine.config.max_model_len == 256
        outs = llm.generate(ids, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_sliding_window_model_runs_up_to_its_window(checkpoints, references, tmp_path):
    """Mistral's weights with a sliding window: up to the window's length every key is in it, so the engine's
    whole-context attention is the model's; the context limit is the window, and a longer --max-model-len is
    refused with the reason."""
    import json
    import shutil

    ids, _ = references["mistral"]
    window = max(map(len, ids)) + MAX_TOKENS
    windowed = tmp_path / "mistral-window"
    shutil.copytree(checkpoints["mistral"], windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    llm = LLM(str(windowed), kv_cache_memory="16MiB")
    assert llm.engine.config.max_model_len == window
    outs = llm.generate(ids, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(windowed, ids, MAX_TOKENS)
    with pytest.raises(ConfigError, match=f"larger than the model's maximum context length \\({window}: "
                                          f"sliding_window in config.json"):
        LLM(str(windowed), kv_cache_memory="16MiB", max_model_len=window + 1)


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


class _OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor: over generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids[:, self.prompt_len:]):
            for t in ids.tolist():
                counts[row, t] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_penalties_match_transformers(checkpoints, references):
    """Greedy decoding under each penalty, penalized and plain rows in one batch, against transformers: its
    own repetition penalty, and presence/frequency written out as a logits processor."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    ids, plain = references["qwen3"]
    path = checkpoints["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    settings = [dict(repetition_penalty=1.6), dict(presence_penalty=1.5, frequency_penalty=0.7),
                dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=2.0)]
    want, params, prompts = [], [], []
    for i, prompt in enumerate(ids):
        s = settings[i % len(settings)] if i < len(ids) - 1 else {}  # the last row stays plain
        x = torch.tensor([prompt])
        processors = LogitsProcessorList([_OpenAIPenalties(len(prompt), s.get("presence_penalty", 0.0),
                                                           s.get("frequency_penalty", 0.0))])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                               repetition_penalty=s.get("repetition_penalty", 1.0), logits_processor=processors)
        want.append(y[0, len(prompt):].tolist())
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **s))
        prompts.append(prompt)
    assert want[-1] == plain[-1] and all(w != p for w, p in zip(want[:-1], plain))  # the penalties bite
    llm = LLM(str(path), kv_cache_memory="16MiB", max_num_batched_tokens=40)  # chunks beside decodes
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prompt_logprobs_match_transformers(checkpoints, references):
    """prompt_logprobs: every prompt token's log-probability (the first has none), rank and the top-N,
    equal to transformers' on identical weights, with prompts chunked over steps and beside decodes, again
    with the prompts in the prefix cache (a scored prompt takes nothing from it), and under preemption."""
    from transformers import AutoModelForCausalLM

    ids, _ = references["llama"]
    path = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    want = []  # per prompt: each scored token's logprob and rank, and the top 3 ids
    with torch.no_grad():
        for prompt in ids:
            lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
            chosen = lp.gather(1, torch.tensor(prompt[1:])[:, None])
            want.append((chosen[:, 0], ((lp > chosen).sum(1) + 1).tolist(), lp.topk(3, -1).indices.tolist()))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=3)
    longest = max(len(i) for i in ids) + MAX_TOKENS
    blocks = -(-longest // 16) + 1  # room for the longest request, far from room for all at once
    for llm in (LLM(str(path), kv_cache_memory="16MiB", max_num_batched_tokens=24),
                LLM(str(path), num_gpu_blocks_override=blocks, max_model_len=blocks * 16)):
        for _ in range(2):  # the second time, every prompt is in the prefix cache
            outs = llm.generate(ids * 3, params, use_tqdm=False)
            for out, prompt, (chosen, ranks, tops) in zip(outs, ids * 3, want * 3):
                got = out.prompt_logprobs
                assert len(got) == len(prompt) and got[0] is None
                values = torch.tensor([e[t].logprob for e, t in zip(got[1:], prompt[1:])])
                assert torch.allclose(values, chosen, atol=1e-4)
                assert [e[t].rank for e, t in zip(got[1:], prompt[1:])] == ranks
                assert [[t for t, v in sorted(e.items(), key=lambda kv: kv[1].rank) if v.rank <= 3] for e in got[1:]] == tops
    assert llm.engine.core.counters.num_preemptions > 0
