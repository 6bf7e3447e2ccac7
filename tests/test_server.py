"""The OpenAI-compatible server, driven by real HTTP clients (the official openai SDK among them)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import ssl
import subprocess

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.bench.metrics import info_labels
from pagedserve.cli import main
from tests.serving import metric_values, running_server, serve_process, wait_until

ENGINE_FLAGS = ("--kv-cache-memory", "16MiB", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def server():
    with running_server(*ENGINE_FLAGS, "--max-num-seqs", "16") as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_completion_chat_and_streaming_with_the_openai_sdk(client):
    c = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    assert c.object == "text_completion" and c.choices[0].finish_reason in ("length", "stop")
    assert c.usage.completion_tokens == 12 or c.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=12, temperature=0, stream=True) if chunk.choices)
    assert streamed == c.choices[0].text

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    # the role comes with the first token, not ahead of it (a client's TTFT would be the server's overhead)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:] if ch.choices)


def test_prompt_forms_and_multiple_prompts(server, client):
    tok_ids = httpx.post(f"{server[0]}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=tok_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model="tiny", prompt=["Hello world", "Paris"], max_tokens=6, temperature=0)
    assert [ch.index for ch in many.choices] == [0, 1] and many.choices[0].text == by_text.choices[0].text
    assert httpx.post(f"{server[0]}/detokenize", json={"tokens": tok_ids}).json()["prompt"] == "Hello world"


def test_32_concurrent_streams_match_the_offline_api(server):
    """Greedy streams, some with presence/frequency penalties, a repetition penalty or a logit bias, batched
    together by the server: the same text as the offline API's."""
    prompts = [f"Request number {i} says hello" for i in range(32)]
    penalties = [[{}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"repetition_penalty": 1.3},
                  {"logit_bias": {"7": 3.0, "11": -100}}][i % 4] for i in range(32)]
    llm = LLM("tiny", kv_cache_memory="16MiB", max_model_len=1024)
    # JSON's keys are strings; the offline API's, token ids
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             **{k: {int(t): b for t, b in v.items()} if k == "logit_bias" else v for k, v in pen.items()})
              for pen in penalties]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)

    async def one(p: str, pen: dict) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True, **pen})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(p, pen) for p, pen in zip(prompts, penalties)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == expected


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize("body, param, fragments", [
    ({"prompt": "Hello", "max_tokens": 1023}, "max_tokens", ["1024", "1025", "1023"]),
    ({"prompt": [5] * 1030, "max_tokens": None}, "prompt", ["1024", "1030"]),
    ({"prompt": "Hello", "temperature": -1}, "temperature", ["temperature"]),
    ({"prompt": "Hello", "top_p": 1.5}, "top_p", ["top_p"]),
    ({"prompt": "Hello", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ({"prompt": "Hello", "presence_penalty": 2.5}, "presence_penalty", ["presence_penalty"]),
    ({"prompt": "Hello", "repetition_penalty": 0}, "repetition_penalty", ["repetition_penalty"]),
    ({"prompt": "Hello", "logit_bias": {"abc": 1}}, "logit_bias", ["token ids"]),
    ({"prompt": "Hello", "logit_bias": {"5": 150}}, "logit_bias", ["[-100, 100]"]),
    ({"prompt": "Hello", "logit_bias": {"999999": 1}}, "logit_bias", ["999999"]),
    ({"prompt": [999999]}, "prompt", ["Token ids"]),
    ({"max_tokens": 3}, "prompt", ["prompt"]),
    ({"prompt": "Hello", "logprobs": 21}, "logprobs", ["21", "at most 20", "--max-logprobs"]),
    ({"prompt": "Hello", "max_tokens": "many"}, "max_tokens", ["max_tokens"]),
])
def test_bad_completion_requests_get_400(server, body, param, fragments):
    err = _error(httpx.post(f"{server[0]}/v1/completions", json=body), 400)
    assert err["param"] == param
    for f in fragments:
        assert f in err["message"], err["message"]


def test_bad_chat_and_malformed_json_get_400(server):
    url = server[0]
    err = _error(httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": []}), 400)
    _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "top_logprobs": 3}), 400)
    err = _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "logprobs": True, "top_logprobs": 21}), 400)
    assert "--max-logprobs" in err["message"]
    err = _error(httpx.post(f"{url}/v1/embeddings", json={"input": "Hello"}), 404)  # a route it does not serve
    assert err["message"].startswith("No route /v1/embeddings; this server's OpenAI routes are /v1/chat/completions")
    err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "model": "gpt-4"}), 404)
    assert err["type"] == "NotFoundError" and err["param"] == "model" and "gpt-4" in err["message"]
    with pytest.raises(openai.NotFoundError) as e:  # as OpenAI and vLLM answer an unknown model
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    assert "nope" in str(e.value)


def test_logprobs_in_both_apis(server, client):
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy: the sampled token ranks first
    # streamed, each chunk carries its own tokens' logprobs; together they are the whole answer's
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)  # a prefix-cache hit may round differently
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-4)
    # tokens named by id (return_tokens_as_token_ids): the same tokens, the prompt's echoed ones too
    ids = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2, echo=True,
                                    extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    prompt_ids = httpx.post(f"{server[0]}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    named = [int(t.removeprefix("token_id:")) for t in ids.tokens]
    assert named[:len(prompt_ids)] == prompt_ids and len(named) == len(prompt_ids) + 4
    texts = [httpx.post(f"{server[0]}/detokenize", json={"tokens": [t]}).json()["prompt"]
             for t in named[len(prompt_ids):]]
    assert texts == lp.tokens
    assert all(k.startswith("token_id:") for top in ids.top_logprobs[1:] for k in top)
    by_id = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    named = by_id.choices[0].logprobs.content
    assert [t.logprob for t in named] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(t.token.startswith("token_id:") and t.top_logprobs[0].token.startswith("token_id:") for t in named)


def test_token_ids_beside_the_text_when_asked(server, client):
    prompt_ids = httpx.post(f"{server[0]}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    ask = dict(model="tiny", prompt="Hello", max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**ask).choices[0]
    assert whole.prompt_token_ids == prompt_ids and len(whole.token_ids) == 5
    text = httpx.post(f"{server[0]}/detokenize", json={"tokens": whole.token_ids}).json()["prompt"]
    assert text == whole.text
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **ask) if ch.choices]
    assert chunks[0].prompt_token_ids == prompt_ids and all(not hasattr(c, "prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
    rendered = httpx.post(f"{server[0]}/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat.prompt_token_ids == rendered and len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                   stream=True, extra_body={"return_token_ids": True}))
    assert streamed[0].prompt_token_ids == rendered
    assert [t for ch in streamed if ch.choices for t in ch.choices[0].token_ids] == chat.choices[0].token_ids
    assert not hasattr(client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0], "token_ids")


def test_a_stream_interval_sends_several_tokens_a_frame():
    """--stream-interval 4: the first token in a frame of its own, then frames of at least four tokens (the last
    may hold fewer), the same tokens and text as a call that is not streamed."""
    with running_server("--stream-interval", "4") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        ask = dict(model="tiny", prompt="Hello", max_tokens=18, temperature=0,
                   extra_body={"return_token_ids": True, "ignore_eos": True})
        whole = client.completions.create(**ask).choices[0]
        frames = [ch.choices[0] for ch in client.completions.create(stream=True, **ask) if ch.choices]
        sizes = [len(f.token_ids) for f in frames]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 18 and len(frames) <= 6, sizes
        assert [t for f in frames for t in f.token_ids] == whole.token_ids
        assert "".join(f.text for f in frames) == whole.text


def test_stop_strings_are_never_streamed(client):
    full = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:11]
    want = full[:full.find(stop)]
    pieces = [ch.choices[0] for ch in client.completions.create(model="tiny", prompt="Hello world", max_tokens=24,
                                                                  temperature=0, stop=[stop], stream=True,
                                                                  extra_body={"ignore_eos": True}) if ch.choices]
    assert "".join(p.text for p in pieces) == want and pieces[-1].finish_reason == "stop"


def test_models_health_version(server, client):
    url = server[0]
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    assert client.models.retrieve("tiny").id == "tiny"  # OpenAI's retrieve
    missing = httpx.get(f"{url}/v1/models/Qwen/Qwen3-8B")
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    both = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    assert both.status_code == 400 and "one of them" in both.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]


def test_disconnect_mid_stream_frees_blocks(server):
    url, app = server
    engine = app.state.engine
    pool = engine.core.pool
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions",
                         json={"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "stream": True,
                               "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert engine.num_in_flight == 1 and pool.num_free_blocks < pool.num_blocks
    assert wait_until(lambda: engine.num_in_flight == 0 and pool.num_free_blocks == pool.num_blocks)
    assert wait_until(lambda: not engine.core.has_unfinished)


def test_disconnect_during_non_streaming_request_aborts_it(server):
    url, app = server
    engine = app.state.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True},
                   timeout=0.5)
    assert wait_until(lambda: engine.num_in_flight == 0 and engine.core.pool.num_free_blocks == engine.core.pool.num_blocks)


def test_metrics_counters_move(server, client):
    url = server[0]
    before = metric_values(url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "pagedserve:device_memory_used_bytes", "pagedserve:device_memory_peak_bytes"):
        assert name in before, name
    assert before["pagedserve:max_num_seqs"] == 16 and before["pagedserve:max_num_batched_tokens"] > 0
    # the cache config as vLLM labels it: the --kv-cache-dtype as given, which diagnose reads
    labels = info_labels(httpx.get(f"{url}/metrics").text, "vllm:cache_config_info")
    assert labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"
    assert int(labels["num_gpu_blocks"]) == server[1].state.engine.core.pool.num_blocks
    c = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metric_values(url)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == c.usage.prompt_tokens
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 6
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:request_success_total{length}"] == before.get("vllm:request_success_total{length}", 0) + 1
    assert after["pagedserve:device_memory_peak_bytes"] > 0

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    # vLLM's per-request and per-step histograms
    assert moved("vllm:request_generation_tokens_sum") == 7 and moved("vllm:request_generation_tokens_count") == 1
    assert moved("vllm:request_prompt_tokens_sum") == c.usage.prompt_tokens
    assert moved("vllm:request_params_max_tokens_sum") == 7 and moved("vllm:request_params_n_sum") == 1
    for name in ("time_per_output_token", "prefill_time", "decode_time", "inference_time"):
        assert moved(f"vllm:request_{name}_seconds_count") == 1, name
    assert moved("vllm:request_inference_time_seconds_sum") >= moved("vllm:request_decode_time_seconds_sum") > 0
    assert moved("vllm:iteration_tokens_total_count") >= 7 and moved("vllm:iteration_tokens_total_sum") >= 7
    # the steps' results followed one another at least 6 times (7 tokens, one step each)
    assert moved("pagedserve:step_interval_seconds_count") >= 6 and moved("pagedserve:step_interval_seconds_sum") > 0
    before = after
    client.completions.create(model="tiny", prompt="Hello world", n=2, max_tokens=3, temperature=1.0)
    after = metric_values(url)
    assert moved("vllm:request_params_n_sum") == 2 and moved("vllm:request_params_n_count") == 1
    assert moved("vllm:request_params_max_tokens_count") == 2 and moved("vllm:request_generation_tokens_count") == 2


def test_api_key_browser_origins_request_ids_and_docs(capsys):
    """The key guards every route but the probes; a browser's preflight needs none (CORS answers it for the
    allowed origins only); answers carry X-Request-Id; the docs pages can be turned off."""
    flags = ("--api-key", "s3cret", "--allowed-origins", '["http://ui.example"]', "--enable-request-id-headers",
             "--disable-fastapi-docs")
    with running_server(*ENGINE_FLAGS, *flags) as (url, _):
        _error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}), 401)
        _error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # only /v1 paths need the key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list().data[0].id == "tiny"
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        key = {"Authorization": "Bearer s3cret"}
        listed = httpx.get(f"{url}/v1/models", headers={**key, "Origin": "http://ui.example", "X-Request-Id": "r-42"})
        assert listed.headers["access-control-allow-origin"] == "http://ui.example"
        assert listed.headers["x-request-id"] == "r-42"
        assert len(httpx.get(f"{url}/health").headers["x-request-id"]) == 32  # a new one
        assert httpx.get(f"{url}/openapi.json", headers=key).status_code == 404
        assert httpx.get(f"{url}/docs", headers=key).status_code == 404
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", *ENGINE_FLAGS, "--allowed-origins", "http://ui.example"])
    assert e.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


def test_behind_a_proxy_prefix_and_sagemaker_routes(capsys):
    """--root-path: a proxy strips the prefix, the server's routes and key rules hold as without it and the
    schema names its URLs with the prefix. SageMaker's /ping answers as /health (no key), and /invocations
    serves a chat or a completion request by its body, with the key and the ingress limits of both."""
    key = {"Authorization": "Bearer s3cret"}
    with running_server(*ENGINE_FLAGS, "--root-path", "/llm", "--api-key", "s3cret") as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200  # still a public probe under the prefix
        _error(httpx.get(f"{url}/v1/models"), 401)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        assert httpx.get(f"{url}/openapi.json", headers=key).json()["servers"] == [{"url": "/llm"}]
        assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
        _error(httpx.post(f"{url}/invocations", json={"prompt": "Hi"}), 401)
        done = httpx.post(f"{url}/invocations", headers=key,
                          json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).json()
        assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == 3
        chat = httpx.post(f"{url}/invocations", headers=key,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert "exactly one" in _error(httpx.post(f"{url}/invocations", headers=key, json={"max_tokens": 2}),
                                       400)["message"]
        bad = httpx.post(f"{url}/invocations", headers={**key, "Content-Type": "application/json"}, content=b"{")
        assert "not valid JSON" in _error(bad, 400)["message"]
        assert _error(httpx.post(f"{url}/invocations", headers=key, json={"prompt": "Hi", "max_tokens": "many"}),
                      400)["param"] == "max_tokens"
    with running_server(*ENGINE_FLAGS, "--max-num-queued-reqs", "1") as (url, app):
        app.state.server.admission.check_room = _always_full
        assert "full" in _error(httpx.post(f"{url}/invocations", json={"prompt": "Hi"}), 503)["message"]
    for flags, named in ((["--root-path", "llm/"], "--root-path"), (["--served-model-name", "a", " "],
                                                                   "--served-model-name ['a', ' ']: a name is empty")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "tiny", *ENGINE_FLAGS, *flags])
        assert e.value.code == 2 and named in capsys.readouterr().err


def _always_full(n: int) -> None:
    from pagedserve.server.errors import unavailable

    raise unavailable("The server is full.")


def test_https_with_a_key_and_certificate(tmp_path, capsys):
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test's certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with running_server(*ENGINE_FLAGS, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)) as (url, _):
        secure = url.replace("http://", "https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            client = openai.OpenAI(base_url=f"{secure}/v1", api_key="unused", max_retries=0, http_client=http)
            assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)  # plain HTTP is not served
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", *ENGINE_FLAGS, "--ssl-certfile", str(cert)])
    assert e.value.code == 2 and "--ssl-keyfile" in capsys.readouterr().err


def test_queue_limit_gives_503_with_retry_after():
    flags = ("--kv-cache-memory", "16MiB", "--max-num-queued-reqs", "2", "--served-model-name", "small")
    with running_server(*flags) as (url, app):
        engine = app.state.engine
        # long enough (2000 steps) that both are still running when the third request arrives
        body = {"model": "small", "prompt": "Hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as r1, \
                    http.stream("POST", f"{url}/v1/completions", json=body) as r2:
                assert r1.status_code == r2.status_code == 200
                assert engine.num_in_flight == 2
                r3 = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
                err = _error(r3, 503)
                assert r3.headers["retry-after"] == "1" and "--max-num-queued-reqs" in err["message"]
        assert wait_until(lambda: engine.num_in_flight == 0)
        ok = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # accepted again once the queue drained
        assert metric_values(url)["pagedserve:rejected_requests_total"] == 1


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    with serve_process(*ENGINE_FLAGS, "--shutdown-timeout", "30") as (proc, url):
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions",
                             json={"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True,
                                   "temperature": 0}) as resp:
                lines = resp.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finals = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)


def test_seed_documents_serve_command_parses_and_resolves():
    """The seed document's command (with --load-format dummy) resolves to the config it asks for; starting
    it needs an 8B model's memory, which the GPU benchmarks do (docs/lab-notes.md)."""
    from pagedserve.args import engine_args_from
    from pagedserve.cli import build_parser

    ns = build_parser().parse_args(
        ["serve", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.88", "--max-model-len", "8192", "--max-num-seqs",
         "16", "--max-num-batched-tokens", "4096", "--enable-chunked-prefill", "--load-format", "dummy"])
    cfg = engine_args_from(ns).create_config(serving=True)
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (8192, 16, 4096)
    assert cfg.max_mixed_prefill_tokens == 256 and engine_args_from(ns).create_config().max_mixed_prefill_tokens == 0
    assert cfg.enable_chunked_prefill and cfg.args.gpu_memory_utilization == 0.88
    assert cfg.model.num_layers == 36 and cfg.model.qk_norm


def test_scheduler_limits_change_at_runtime(server):
    """What degradation profiles will use: new step limits apply between two steps; bad ones are refused."""
    import asyncio as aio

    from pagedserve.errors import ConfigError

    url, app = server
    engine = app.state.engine
    sched = engine.core.scheduler
    before = (sched.max_num_seqs, sched.max_num_batched_tokens)

    def call(**limits):
        return aio.run_coroutine_threadsafe(engine.set_limits(**limits), engine._loop).result(timeout=10)

    try:
        call(max_num_seqs=2, max_num_batched_tokens=64)
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2, 64)
        with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
            call(max_num_seqs=8, max_num_batched_tokens=4)
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2, 64)  # unchanged by the refusal
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a b c", "d e f", "g h i"], "max_tokens": 4,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3  # served, two at a time
    finally:
        call(max_num_seqs=before[0], max_num_batched_tokens=before[1])
