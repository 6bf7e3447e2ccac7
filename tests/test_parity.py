"""What a user of vLLM or of OpenAI's API expects: the command line, parallel sampling, logprobs in
OpenAI's shape, chat-template options, `bench latency`, and the planner's and diagnose's wording."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cli import build_parser, main
from pagedserve.config import EngineArgs
from pagedserve.tune.diagnose import diagnose
from pagedserve.tune.plan import make_plan
from tests.serving import metric_values, running_server

ENGINE = ("--kv-cache-memory", "16MiB", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def server():
    with running_server(*ENGINE) as (url, app):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_version_bare_commands_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")
    main([])
    out = capsys.readouterr().out
    assert "usage: pagedserve" in out and "serve" in out and "tune" in out
    main(["bench"])
    assert "sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in text and "(default: 0.9)" in text and "(default: None)" in text


@pytest.mark.parametrize("flag, fragment", [
    ("--trust-remote-code", "never runs code from a model folder"),
    ("--quantization=awq", "quantized weights do not run here"),
    ("--swap-space=4", "vLLM's --swap-space: a preempted request is recomputed"),
    ("--download-dir=/models", "give a local checkpoint folder"),
    ("--max-seq-len-to-capture=8192", "use --max-cudagraph-capture-size"),
    ("-O3", "-O3: steps replay CUDA graphs"),
])
def test_vllm_flags_that_cannot_apply_say_why(capsys, flag, fragment):
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", *ENGINE, flag])
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_a_config_file_with_a_vllm_only_flag_says_what_to_do(tmp_path, capsys):
    (tmp_path / "vllm.yaml").write_text("pipeline-parallel-size: 2\nmax-num-seqs: 8\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", "--config", str(tmp_path / "vllm.yaml")])
    assert e.value.code == 2 and "--pipeline-parallel-size: only tensor parallelism here: use --tensor-parallel-size" \
        in capsys.readouterr().err


def test_server_flags_given_to_a_benchmark_say_where_they_go(capsys):
    """vLLM's users pass engine flags where they would on `vllm serve`; the benchmarks that talk to a server say
    where those go instead of only that they are unknown."""
    cases = [(["bench", "sweep", "--model", "tiny", "--kv-cache-dtype", "fp8", "--max-num-seqs=8"],
              "--kv-cache-dtype, --max-num-seqs are server flags; `bench sweep` starts its servers with --serve-args, "
              "e.g. --serve-args '--kv-cache-dtype fp8 --max-num-seqs=8'"),
             (["bench", "serve", "--max-num-seqs", "8"],
              "--max-num-seqs is a server flag; `bench serve` is a client: give it to `pagedserve serve`"),
             (["bench", "sweep", "--bogus"], "unrecognized arguments: --bogus\n"),
             (["bench", "sweep", "--model", "tiny", "--serve-args", "--enforce-eager"],
              "expected one argument (a value that begins with - goes after an =: --serve-args='--enforce-eager')")]
    for argv, words in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_vllm_server_flags_and_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-num-seqs: 6\nmax_num_batched_tokens: 96\nserved-model-name: [from-file]\n")
    flags = (*ENGINE, "--config", str(cfg), "--max-num-seqs", "5", "--disable-log-requests", "--enable-log-requests",
             "--uvicorn-log-level", "warning", "--max-num-queued-tokens", "4000")
    with running_server(*flags) as (url, app):
        sched = app.state.engine.core.scheduler
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (5, 96)  # the command line wins over the file
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "from-file"
        assert app.state.server.admission.limits["max_num_queued_tokens"] == 4000
    cfg.write_text("max-num-sequences: 6\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", "--config", str(cfg)])
    assert e.value.code == 2
    # a file's values meet the flags' own types, as typed values do
    for line, words in (("shutdown-timeout: -1", "--shutdown-timeout: -1 is not valid here ('-1': must be a number of "
                                                 "at least 0)"),
                        ("port: eighty", "--port: 'eighty' is not valid here"),
                        ("max-num-seqs: true", "--max-num-seqs: True is not valid here"),
                        ("max-num-seqs: [16]", "--max-num-seqs: [16] is not valid here"),
                        ("enable-chunked-prefill: 'false'", "'false' is not valid here (a switch: give true or false)"),
                        ("api-key: yes", "--api-key: True is not valid here (YAML read a boolean: quote it"),
                        ("tool-call-parser: json", "--tool-call-parser: 'json' is not valid here (not one of")):
        cfg.write_text(line + "\n")
        with pytest.raises(SystemExit) as e:
            main(["serve", "tiny", "--config", str(cfg)])
        assert e.value.code == 2 and words in capsys.readouterr().err
    # YAML's own lists, numbers and mappings, as the command line's text would give them
    cfg.write_text("allowed-origins: ['http://localhost:3000']\napi-key: 12345\nserved-model-name: [a, 7]\n"
                   "enable-prefix-caching: false\nmax-model-len: 8192\n"
                   "override-generation-config: {temperature: 0.5}\n")
    ns = build_parser().parse_args(["serve", "tiny", "--config", str(cfg)])
    assert (ns.allowed_origins, ns.api_key, ns.served_model_name) == (["http://localhost:3000"], "12345", ["a", "7"])
    assert ns.max_model_len == "8192" and ns.override_generation_config == {"temperature": 0.5}
    assert ns.enable_prefix_caching is False


def test_parallel_sampling_with_the_openai_sdk(server):
    url, client = server
    prompt = "Continuous batching keeps the accelerator busy because"
    c = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=12, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1, 2] and len({ch.text for ch in c.choices}) > 1
    single = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=7,
                                       extra_body={"ignore_eos": True})
    assert c.choices[0].text == single.choices[0].text  # child 0 keeps the seed, the others seed + index
    assert c.usage.prompt_tokens == single.usage.prompt_tokens and c.usage.completion_tokens == 36
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=12, temperature=1.0, seed=7,
                                           stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(3)] == [ch.text for ch in c.choices]
    two = client.completions.create(model="tiny", prompt=["Hello", "Paris"], n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3] and two.choices[0].text == two.choices[1].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=5, temperature=0)
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message
    streamed = {}
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                max_tokens=5, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
        if chunk.usage:
            assert chunk.usage.completion_tokens == 10 and chunk.usage.prompt_tokens == chat.usage.prompt_tokens
    assert streamed == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}


def test_parallel_samples_share_the_prompt_blocks(server):
    url, client = server
    before = metric_values(url)
    prompt = list(range(3, 103))  # 100 tokens: six full blocks of 16 the children share
    r = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=4, temperature=0)
    after = metric_values(url)
    assert len({ch.text for ch in r.choices}) == 1  # greedy children agree
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 3 * 96
    offline = LLM("tiny", kv_cache_memory="16MiB").generate(
        [prompt], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=5), use_tqdm=False)[0]
    assert [c.index for c in offline.outputs] == [0, 1] and offline.outputs[0].token_ids != offline.outputs[1].token_ids


def test_cached_prompt_tokens_and_continuous_usage():
    """--enable-prompt-tokens-details: usage says how much of the prompt the prefix cache gave; and
    stream_options.continuous_usage_stats puts the usage so far on every chunk."""
    with running_server(*ENGINE, "--enable-prompt-tokens-details") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = list(range(3, 103))  # 100 tokens: six full blocks of 16
        cached = [client.completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
                  .prompt_tokens_details.cached_tokens for _ in range(2)]
        assert cached == [0, 96]
        # a cache salt (a tenant) shares blocks within itself only, not with unsalted or other-salted prompts
        salted = [client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": s})
                  .usage.prompt_tokens_details.cached_tokens for s in ("tenant-a", "tenant-b", "tenant-a")]
        assert salted == [0, 0, 96]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == 100 for c in chunks)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 96


def test_request_priority_as_vllm_schedules_it(server):
    """--scheduling-policy priority: the most urgent waiting request starts first, offline and over HTTP;
    under fcfs a priority is refused, naming the flag."""
    url, client = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    llm = LLM("tiny", kv_cache_memory="16MiB", scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(["a b", "c d", "e f"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False,
                        priority=[2, 0, 1])
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert starts[1] < starts[2] < starts[0]
    with running_server(*ENGINE, "--scheduling-policy", "priority", "--max-num-seqs", "1") as (url, _):
        def ask(prompt: str, priority: int, max_tokens: int) -> float:
            httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority})
            return time.monotonic()

        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(ask, "one seat", 0, 300)  # holds the only seat while the others queue
            time.sleep(0.2)
            later, urgent = pool.submit(ask, "later", 5, 5), pool.submit(ask, "urgent", 1, 5)
            assert first.result() < urgent.result() < later.result()


def test_logprobs_in_openai_shape(server):
    url, client = server
    c = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert not any(t.startswith("Ġ") for t in lp.tokens)  # decoded text, not byte-level BPE symbols
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert "".join(lp.tokens) == c.choices[0].text
    streamed_offsets = [o for chunk in client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=8, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) for o in chunk.choices[0].logprobs.text_offset]
    assert streamed_offsets == lp.text_offset
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert all(alt.bytes == list(alt.token.encode("utf-8")) for alt in entry.top_logprobs)


def test_chat_template_options(server):
    url, _ = server

    def prompt_tokens(**extra) -> int:
        body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}],
                "max_tokens": 1, **extra}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    default = prompt_tokens()
    plain = prompt_tokens(add_generation_prompt=False)
    cont = prompt_tokens(add_generation_prompt=False, continue_final_message=True)
    assert default > plain > cont  # the next turn's header; then the final message left open


def test_bench_latency(tmp_path):
    out = tmp_path / "new" / "lat.json"  # the folder is made
    main(["bench", "latency", "--model", "tiny", "--kv-cache-memory", "16MiB", "--input-len", "16", "--output-len",
          "8", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)])
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"} and r["mean_itl_ms"] > 0


def test_bench_latency_prefills_every_iteration_in_full():
    """Each iteration's prompts are new, so none is served from the prefix cache (a repeated prompt would
    make every iteration after the first a near-empty prefill, and its TTFT meaningless)."""
    from pagedserve.bench.latency import run_latency

    llm = LLM("tiny", kv_cache_memory="16MiB")
    run_latency(llm, input_len=64, output_len=2, batch_size=2, num_iters_warmup=1, num_iters=3)
    counters = llm.engine.core.counters
    assert counters.prefix_cache_queries >= 8 * 64 and counters.prefix_cache_hits == 0


def test_plan_wording():
    tight = make_plan(EngineArgs(model="Qwen/Qwen3-8B", gpu_memory_utilization=0.5, max_model_len=8192), gpu="RTX-4090")
    table = tight.table()
    assert "KV cache" in table and "exceed the budget by" in table and "-" not in table.split("KV cache")[2][:40]
    assert "tied embeddings" not in table  # Qwen3-8B has its own lm_head
    small = make_plan(EngineArgs(model="Qwen/Qwen3-0.6B", max_model_len=8192), gpu="H100-80GB").table()
    assert "(tied embeddings counted once)" in small
    assert "8,192 tokens a request (max_model_len) of the model's 40,960" in small  # room to raise it, or not


def test_diagnose_names_the_next_command_and_generate_says_the_tiny_model_is_random(capsys):
    healthy = [{"t": 0.0, "running": 1, "waiting": 0, "kv_usage": 0.1, "preemptions": 0},
               {"t": 10.0, "running": 1, "waiting": 0, "kv_usage": 0.1, "preemptions": 0}]
    d = diagnose(healthy, url="http://10.0.0.5:8000")
    assert "pagedserve bench sweep --base-url http://10.0.0.5:8000" in d.first_change
    main(["generate", "--kv-cache-memory", "16MiB", "--max-tokens", "4", "--prompt", "Hi"])
    assert "random weights" in capsys.readouterr().out


def test_generation_config_defaults_as_vllm_applies_them(tmp_path, tiny_path, capsys):
    """A model folder's generation_config.json sets the sampling parameters a request leaves unset (its
    eos_token_id ends sequences too); --generation-config vllm ignores it; a bad file or folder is named."""
    import shutil

    model = tmp_path / "tiny-recommended"
    shutil.copytree(tiny_path, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3, "max_new_tokens": 7,
         "eos_token_id": [2, 9], "do_sample": True}))
    llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=1024)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.max_tokens) == (0.6, 20, 0.95, 1.3, None)
    assert {2, 9} <= set(llm.engine.inputs.eos_token_ids)
    assert 1 <= len(llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids) <= 7
    plain = LLM(str(model), kv_cache_memory="16MiB", max_model_len=1024, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams() and 9 not in plain.engine.inputs.eos_token_ids

    def offline(**kw) -> str:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
        return plain.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0].text

    with running_server(*ENGINE, model=str(model)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def served(**kw) -> str:
            return client.completions.create(model=str(model), prompt="Hello world", temperature=0, max_tokens=12,
                                             extra_body={"ignore_eos": True, **kw}).choices[0].text

        assert served() == offline(repetition_penalty=1.3) != offline()  # unset: the file's penalty
        assert served(repetition_penalty=1.0) == offline()  # set: the request's
        chat = client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "Hi"}],
                                              temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 7  # max_new_tokens
    # the operator's overrides: over the file's values, or alone
    over = LLM(str(model), kv_cache_memory="16MiB", max_model_len=1024,
               override_generation_config='{"temperature": 0.2, "max_new_tokens": 3}')
    d = over.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.repetition_penalty) == (0.2, 20, 1.3)
    assert 1 <= len(over.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids) <= 3
    alone = LLM(str(model), kv_cache_memory="16MiB", max_model_len=1024, generation_config="vllm",
                override_generation_config={"top_k": 5})
    assert alone.get_default_sampling_params() == SamplingParams(top_k=5)
    for bad in ('{"temperature": -1}', "{temperature: 1}", '{"do_sample": true}'):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(model), *ENGINE, "--override-generation-config", bad])
        assert e.value.code == 2 and "--override-generation-config" in capsys.readouterr().err
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    for flags in ([], ["--generation-config", str(tmp_path / "nowhere")]):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(model), *ENGINE, *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--generation-config" in err and "generation_config.json" in err


def test_echo_and_prompt_logprobs_as_evaluation_harnesses_ask(server):
    """echo with max_tokens 0 and logprobs (how lm-evaluation-harness scores a continuation): the prompt's
    text and each prompt token's logprob, equal to the offline API's prompt_logprobs; echo ahead of a
    completion, streamed or not; max_tokens 0 without echo is a 400."""
    url, client = server
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = scored.choices[0]
    offline = LLM("tiny", kv_cache_memory="16MiB", max_model_len=1024).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2), use_tqdm=False)[0]
    ids = offline.prompt_token_ids
    assert ch.text == prompt and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t].logprob for e, t in zip(offline.prompt_logprobs[1:], ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])

    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert full.text == prompt + offline.outputs[0].text
    assert len(full.logprobs.tokens) == len(ids) + 5 and full.logprobs.text_offset == sorted(full.logprobs.text_offset)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, echo=True, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices)
    assert streamed == full.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_structured_outputs_through_the_openai_sdk(server):
    """OpenAI's response_format (json_schema) in chat, vLLM's guided_choice in completions, streamed too:
    the text parses and matches (even on the tiny model's random weights)."""
    url, client = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is it ok?"}], max_tokens=40, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(chat.choices[0].message.content)) == {"ok"} and chat.choices[0].finish_reason == "stop"
    picked = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=10, temperature=1.0, n=3, seed=2,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in picked.choices} <= {"red", "green", "blue"}
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt="Code:", max_tokens=10, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}}) if chunk.choices)
    assert len(streamed) == 4 and streamed[:2].isupper() and streamed[2:].isdigit()


def test_vllm_token_constraints_and_prompt_truncation_over_http(server):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through the SDK's extra_body, in both
    routes; bad values are 400s that name the field."""
    url, client = server
    allowed = [30, 31, 32]
    held = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=5,
                                     extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                                 "return_token_ids": True})
    assert set(held.choices[0].token_ids) <= set(allowed) and len(held.choices[0].token_ids) == 8
    long_text = "a long document " * 4000  # more characters than the 1,024-token context could hold
    cut = client.completions.create(model="tiny", prompt=long_text, max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_text}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 64, "bad_words": ["a"]})
    assert chat.usage.prompt_tokens == 64
    for extra, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                         ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"), ({"bad_words": [""]}, "bad_words")):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_logprobs_over_http_as_vllm_returns_them(server):
    """prompt_logprobs N: each prompt token's logprob and rank and the top N, as the offline engine computes them
    (a completion's in its choice, a chat's at the top); refused in a stream, where vLLM refuses them too."""
    url, client = server
    prompt = [5, 17, 42, 99, 3, 64]
    got = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                    "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    want = LLM("tiny", kv_cache_memory="16MiB", max_model_len=1024).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for position, token, entry in zip(got[1:], prompt[1:], want[1:]):
        assert position[str(token)]["rank"] == entry[token].rank
        assert position[str(token)]["logprob"] == pytest.approx(entry[token].logprob, abs=1e-4)
        assert sum(v["rank"] <= 2 for v in position.values()) == 2
        assert all("decoded_token" in v for v in position.values())
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "stream": True,
                                                  "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
