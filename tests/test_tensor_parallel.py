"""Tensor parallelism on CPU (gloo): two ranks give the same greedy tokens (and prompt logprobs) as one."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.errors import ConfigError

PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 70)), [7] * 12]
# greedy; one row scoring its prompt (the scored rows' logits are gathered over the ranks too), one penalized
GREEDY = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "qwen3_moe", "mixtral"])
def test_two_ranks_match_one(arch, checkpoints):
    kw = dict(kv_cache_memory="4MiB", max_num_batched_tokens=32, max_num_seqs=4)  # chunked prefill + decode
    single = LLM(str(checkpoints[arch]), **kw).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(checkpoints[arch]), tensor_parallel_size=2, **kw)
    try:
        sharded = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runner = llm.engine.core.worker.runner
        assert runner.num_kv_heads == 1 and runner.model.lm_head.weight.shape[0] == 384 // 2
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]
    scores = [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], PROMPTS[0][1:])] for o in (single[0], sharded[0])]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5) and len(scores[0]) == len(PROMPTS[0]) - 1


def test_tensor_parallel_size_must_divide_the_model():
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        EngineArgs(model="tiny", tensor_parallel_size=3).create_config()


def test_server_with_two_ranks_serves_and_stops():
    import httpx

    from tests.serving import running_server

    with running_server("--kv-cache-memory", "4MiB", "--tensor-parallel-size", "2") as (url, app):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        workers = list(app.state.engine.core.worker._ranks)
        assert len(workers) == 1 and workers[0].is_alive()
    workers[0].join(timeout=30)
    assert not workers[0].is_alive()  # shut down with the server
