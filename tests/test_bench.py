"""Benchmarks: vLLM's metric definitions, arrival pacing, the concurrency cap, and end-to-end runs."""

from __future__ import annotations

import argparse
import importlib
import json
import os

import numpy as np
import openai
import pytest

from benchmarks.args import on_off, positives, run_main, server_flags
from pagedserve.bench.datasets import (NO_TOKENIZER_VOCAB, custom_dataset, describe_recorded_lengths,
                                       lengths_dataset, random_dataset, read_recorded_lengths, replayed_lengths,
                                       sharegpt_dataset)
from pagedserve.bench.metrics import RequestResult, calculate_metrics, parse_goodput, scrape
from pagedserve.bench.serve import SCRAPED, arrival_delays
from pagedserve.cli import main
from pagedserve.errors import BenchmarkError, ConfigError
from tests.serving import metric_values, running_server


def test_metrics_match_hand_computed_values():
    a = RequestResult(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05],
                      latency=0.2, start_time=0.0)
    b = RequestResult(success=True, prompt_len=20, output_tokens=2, ttft=0.3, itl=[0.1], latency=0.4, start_time=0.5)
    c = RequestResult(success=True, prompt_len=5, output_tokens=1, ttft=0.05, itl=[], latency=0.05, start_time=1.2)
    failed = RequestResult(success=False, error="HTTP 500", prompt_len=99)
    m = calculate_metrics([a, b, c, failed], duration=2.0, percentiles=[50, 99], percentile_metrics=["ttft", "itl"],
                          goodput=parse_goodput(["ttft:200", "tpot:60"]))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)
    # TTFT over successes: 100, 300, 50 ms
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99))
    # TPOT excludes the first token and requests with one token: a = 100/3 ms, b = 100 ms
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    # ITL pools every chunk gap: 20, 30, 50, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["p50_itl_ms"] == pytest.approx(40.0)
    assert m["mean_e2el_ms"] == pytest.approx((200 + 400 + 50) / 3)
    assert "p99_e2el_ms" not in m  # only the chosen percentile metrics get percentiles
    # goodput: a (ttft 100, tpot 33) and c (ttft 50, one token) are good; b (ttft 300) is not
    assert m["request_goodput"] == pytest.approx(1.0)
    # token times: a at 0.10 0.12 0.15 0.20, b at 0.8 0.9, c at 1.25 -> bins [0,1): 6, [1,2): 1
    assert m["max_output_tokens_per_s"] == 6
    # a [0, .2), b [.5, .9), c [1.2, 1.25): never two at once
    assert m["max_concurrent_requests"] == 1


def test_goodput_parsing_errors():
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="milliseconds"):
        parse_goodput(["ttft:fast"])


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_follow_rate_and_burstiness(burstiness):
    n, rate = 20000, 8.0
    offsets = arrival_delays(n, rate, burstiness, seed=3)
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert offsets[-1] == pytest.approx(n / rate)  # rescaled to end exactly at n/rate
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    # a gamma with shape k has coefficient of variation 1/sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert np.all(gaps >= 0)
    assert np.all(arrival_delays(10, float("inf"), 1.0, 0) == 0)


def test_random_dataset_lengths_and_token_ids():
    samples = random_dataset(200, input_len=100, output_len=50, range_ratio=0.2, prefix_len=7, seed=1)
    assert all(isinstance(s.prompt, list) and max(s.prompt) < NO_TOKENIZER_VOCAB for s in samples)
    ins = [s.prompt_len for s in samples]
    outs = [s.expected_output_len for s in samples]
    assert min(ins) >= 80 + 7 and max(ins) <= 120 + 7 and min(outs) >= 40 and max(outs) <= 60
    assert len(set(ins)) > 10
    assert all(s.prompt[:7] == samples[0].prompt[:7] for s in samples)  # the shared prefix
    with pytest.raises(ConfigError, match="range-ratio"):
        random_dataset(1, 10, 10, range_ratio=1.5)


def test_random_dataset_as_text_with_a_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    samples = random_dataset(20, input_len=64, output_len=8, seed=0, tokenizer=tok)
    assert all(isinstance(s.prompt, str) for s in samples)
    assert all(abs(len(tok.encode(s.prompt, add_special_tokens=False)) - s.prompt_len) <= 2 for s in samples)


def test_random_prompts_share_no_prefix_block(tiny_path):
    """Many more prompts than the ids they are drawn from (256 token ids; the tiny tokenizer's 512, of which
    the lone bytes of multi-byte characters decode to the same U+FFFD), yet no two share their first block
    of 16 tokens: none would be served from another's prefix cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    as_ids = [s.prompt[:16] for s in random_dataset(1000, input_len=64, output_len=8, seed=0)]
    as_text = [tok.encode(s.prompt)[:16] for s in random_dataset(300, input_len=64, output_len=8, seed=0,
                                                                    tokenizer=tok)]
    assert len({tuple(p) for p in as_ids}) == 1000 and len({tuple(p) for p in as_text}) == 300


def test_sharegpt_and_custom_files(tmp_path):
    conv = [{"conversations": [{"from": "human", "value": f"question number {i} " * 5},
                               {"from": "gpt", "value": "answer " * (10 + i)}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(conv))
    got = sharegpt_dataset(str(tmp_path / "sg.json"), 3, seed=0)
    assert len(got) == 3 and all(isinstance(s.prompt, str) for s in got)
    (tmp_path / "c.jsonl").write_text('{"prompt": "hi there", "output_len": 7}\n{"prompt": [1, 2, 3]}\n')
    got = custom_dataset(str(tmp_path / "c.jsonl"), 2, output_len=9)
    assert [s.expected_output_len for s in got] == [7, 9] and got[1].prompt_len == 3
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        custom_dataset(str(tmp_path / "bad.jsonl"), 1)


def test_recorded_lengths_keep_each_request_s_pair_and_say_what_traffic_they_hold(tmp_path):
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(0.5, size=2000))  # Poisson arrivals at 2 req/s: burstiness 1
    rec = tmp_path / "lengths.jsonl"
    rec.write_text("".join(json.dumps({"arrival": float(t), "prompt_tokens": 10 + i % 7, "output_tokens": 3 + i % 5,
                                       "finish_reason": "stop"}) + "\n" for i, t in enumerate(arrivals))
                   + json.dumps({"arrival": 0.0, "prompt_tokens": 9, "output_tokens": 0}) + "\n"  # no output
                   + json.dumps({"arrival": 1.0, "prompt_tokens": 99, "output_tokens": 3, "finish_reason": "abort"})
                   + "\n")  # stopped by its client: its length says nothing; both left out
    pairs = {(10 + i % 7, 3 + i % 5) for i in range(2000)}
    samples = lengths_dataset(str(rec), 3000, seed=1)  # more than were recorded: drawn with repeats
    assert len(samples) == 3000 and {(s.prompt_len, s.expected_output_len) for s in samples} <= pairs
    assert all(len(s.prompt) == s.prompt_len and max(s.prompt) < NO_TOKENIZER_VOCAB for s in samples)
    text = describe_recorded_lengths(read_recorded_lengths(str(rec)))
    rate = float(text.split(": ")[1].split(" req/s")[0])
    burstiness = float(text.split("burstiness ")[1].split(" ")[0])
    assert text.startswith("2,000 recorded requests") and 1.8 < rate < 2.2 and 0.8 < burstiness < 1.25
    # an unchanged file is parsed once; one the server has since appended to is read again
    assert read_recorded_lengths(str(rec)) is read_recorded_lengths(str(rec))
    with rec.open("a") as f:
        f.write(json.dumps({"arrival": 2000.0, "prompt_tokens": 11, "output_tokens": 4}) + "\n")
    assert len(read_recorded_lengths(str(rec))) == 2001
    # requests that took the same number of prompt tokens from the prefix cache share a prefix that long
    shared = tmp_path / "shared.jsonl"
    shared.write_text("".join(json.dumps({"prompt_tokens": 40, "cached_tokens": c, "output_tokens": 2}) + "\n"
                              for c in (32, 32, 16, 0, 0)))
    drawn = lengths_dataset(str(shared), 5, seed=3)  # as many as were recorded: each row once
    assert all(s.prompt_len == 40 for s in drawn)
    common = sorted(len(os.path.commonprefix([x.prompt, y.prompt])) for i, x in enumerate(drawn) for y in drawn[i + 1:])
    assert common.count(32) == 1 and max(common) == 32  # the two rows of 32 share 32 tokens; no pair more
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_tokens": 5, "output_tokens": 2}) + "\n{\"prompt\": \"hi\"}\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected a line of `serve --record-lengths`"):
        lengths_dataset(str(bad), 4)


def test_a_server_records_its_traffic_and_bench_replays_its_shape(tmp_path, capsys):
    rec = tmp_path / "traffic.jsonl"
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "512", "--record-lengths", str(rec))
    with running_server(*flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        made = [client.completions.create(model="tiny", prompt=list(range(5, 5 + n)), max_tokens=m,
                                          extra_body={"ignore_eos": True}).usage
                for n, m in ((12, 3), (40, 7), (25, 5))]
        made.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4).usage)
        recorded = tmp_path / "recorded.jsonl"  # what these four left (the replays below are recorded too)
        recorded.write_text(rec.read_text())
        lines = [json.loads(line) for line in recorded.read_text().splitlines()]
        assert [(r["prompt_tokens"], r["output_tokens"]) for r in lines] == \
            [(u.prompt_tokens, u.completion_tokens) for u in made]
        # the 25-token prompt shares its first 25 with the 40-token one: one full block came from the cache
        assert [r["cached_tokens"] for r in lines] == [0, 0, 16, 0] and all(r["finish_reason"] for r in lines)
        main(["bench", "serve", "--base-url", url, "--dataset-name", "lengths", "--dataset-path", str(recorded),
              "--num-prompts", "8", "--disable-tqdm", "--num-warmups", "0", "--result-dir", str(tmp_path),
              "--result-filename", "replay.json"])
        main(["bench", "serve", "--base-url", url, "--dataset-name", "lengths", "--dataset-path", str(recorded),
              "--replay-arrivals", "--replay-speed", "2", "--num-prompts", "4", "--disable-tqdm",
              "--num-warmups", "0", "--result-dir", str(tmp_path), "--result-filename", "timed.json"])
    timed = json.loads((tmp_path / "timed.json").read_text())
    assert timed["completed"] == 4 and timed["replay_speed"] == 2 and timed["burstiness"] is None
    assert timed["output_lens"] == [r["output_tokens"] for r in lines]  # in recorded order, each its length
    result = json.loads((tmp_path / "replay.json").read_text())
    outputs = {r["output_tokens"] for r in lines}
    assert result["completed"] == 8 and result["failed"] == 0 and len(rec.read_text().splitlines()) == 4 + 8 + 4
    assert min(outputs) * 8 <= result["total_output_tokens"] <= max(outputs) * 8  # each ran its recorded length
    samples, offsets = replayed_lengths(str(recorded), 3, speed=4.0)
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == \
        [(r["prompt_tokens"], r["output_tokens"]) for r in lines[:3]]
    assert offsets == pytest.approx([(r["arrival"] - lines[0]["arrival"]) / 4 for r in lines[:3]])
    with pytest.raises(ConfigError, match="holds 4 requests"):
        replayed_lengths(str(recorded), 5)
    with pytest.raises(SystemExit):  # an unwritable recording fails the start, naming the flag
        main(["serve", "tiny", "--record-lengths", str(tmp_path / "no" / "such" / "dir.jsonl")])
    assert "--record-lengths" in capsys.readouterr().err


def test_parse_metrics_reads_vllm_names():
    text = ('# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{model_name="m"} 3\n'
            '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert scrape(text, SCRAPED)[0] == {"preemptions": 3.0, "kv_cache_usage": 0.5}
    # one pass also gives a histogram's buckets, summed over label sets
    text += ('pagedserve:step_interval_seconds_bucket{engine="0",le="0.004"} 2\n'
             'pagedserve:step_interval_seconds_bucket{engine="1",le="0.004"} 3\n'
             'pagedserve:step_interval_seconds_bucket{engine="0",le="+Inf"} 7\n')
    values, buckets = scrape(text, SCRAPED, "pagedserve:step_interval_seconds")
    assert values == {"preemptions": 3.0, "kv_cache_usage": 0.5} and buckets == {0.004: 5.0, float("inf"): 7.0}


def test_bench_serve_end_to_end_respects_max_concurrency(tmp_path):
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-num-seqs", "16")
    with running_server(*flags) as (url, app):
        engine = app.state.engine
        peak = {"n": 0}
        original = engine.add

        def counting_add(request, text, interval):
            stream = original(request, text, interval)
            peak["n"] = max(peak["n"], engine.num_in_flight)
            return stream

        engine.add = counting_add
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--random-input-len", "32",
              "--random-output-len", "16", "--num-prompts", "24", "--max-concurrency", "3", "--disable-tqdm",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
              "--goodput", "e2el:60000", "--result-dir", str(tmp_path), "--result-filename", "r.json",
              "--num-warmups", "0"])
        engine.add = original
    result = json.loads((tmp_path / "r.json").read_text())
    assert 1 <= peak["n"] <= 3  # seen by the server, not the client
    assert result["completed"] == 24 and result["failed"] == 0 and result["max_concurrency"] == 3
    assert result["total_output_tokens"] == 24 * 16  # random prompts run with ignore_eos
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "p95_ttft_ms", "p50_itl_ms", "mean_tpot_ms", "p95_e2el_ms", "request_goodput",
                "server_preemptions", "server_peak_kv_cache_usage", "server_peak_device_memory_bytes"):
        assert key in result, key
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["server_peak_num_requests_running"] <= 3


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/responses"])
def test_bench_serve_on_the_chat_and_responses_routes_times_the_first_token(tmp_path, endpoint):
    """Through the chat and Responses APIs a client's TTFT can be no shorter than the server's own
    (arrival to first token): the first chunk it times carries the first token, not just the role (chat)
    or the response's creation (Responses)."""
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "512")
    with running_server(*flags) as (url, _):
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--endpoint", endpoint,
              "--random-input-len", "200", "--random-output-len", "8", "--num-prompts", "12",
              "--max-concurrency", "4", "--disable-tqdm", "--num-warmups", "0", "--result-dir", str(tmp_path),
              "--result-filename", "c.json"])
        server = metric_values(url)
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 8
    assert result["backend"] == {"/v1/chat/completions": "openai-chat", "/v1/responses": "openai-responses"}[endpoint]
    server_ttft = server["vllm:time_to_first_token_seconds_sum"] / server["vllm:time_to_first_token_seconds_count"]
    assert result["mean_ttft_ms"] >= 1e3 * server_ttft


def test_bench_serve_sends_the_sampling_and_extra_body_asked_for(tmp_path, capsys):
    """--temperature/--top-p/--top-k/--min-p and --extra-body reach every request (a field the server refuses fails
    them all, with its message); values the server would refuse, or fields the benchmark sets, stop it first."""
    from pagedserve.bench.datasets import SampleRequest
    from pagedserve.bench.serve import BenchConfig, request_body

    cfg = BenchConfig("http://x", "/v1/chat/completions", "m", sampling={"temperature": 0.7, "top_k": 5, "seed": 1})
    body = request_body(cfg, SampleRequest("hi", 3, 4))
    assert body["temperature"] == 0.7 and body["top_k"] == 5 and body["seed"] == 1 and body["max_tokens"] == 4
    common = ["--model", "tiny", "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "4",
              "--disable-tqdm", "--num-warmups", "0", "--result-dir", str(tmp_path)]
    with running_server("--kv-cache-memory", "16MiB", "--max-model-len", "512") as (url, _):
        main(["bench", "serve", "--base-url", url, *common, "--result-filename", "ok.json", "--temperature", "0.9",
              "--top-k", "5", "--min-p", "0.1", "--extra-body", '{"allowed_token_ids": [30, 31]}'])
        main(["bench", "serve", "--base-url", url, *common, "--result-filename", "refused.json",
              "--extra-body", '{"bad_words": [""]}'])
    ok, refused = (json.loads((tmp_path / f).read_text()) for f in ("ok.json", "refused.json"))
    assert ok["completed"] == 4 and refused["failed"] == 4 and "bad_words" in refused["errors"][0]
    for flags, words in ((["--top-p", "1.5"], "--top-p: top_p must be in (0, 1]"),
                         (["--extra-body", '{"max_tokens": 9}'], "--extra-body: max_tokens is set by the benchmark"),
                         (["--extra-body", "{x"], "--extra-body: '{x' is not JSON")):
        with pytest.raises(SystemExit):
            main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *common, *flags])
        assert words in capsys.readouterr().err


def test_bench_serve_warms_up_on_a_prompt_it_does_not_measure(tmp_path, capsys):
    """The warm-up request leaves nothing in the prefix cache that a measured prompt could hit, so the first
    measured request's TTFT is a full prefill's; as a text prompt it is about as long as the first one (the
    context here has room for little more)."""
    with running_server("--kv-cache-memory", "16MiB", "--max-model-len", "112") as (url, _):
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--random-input-len", "96",
              "--random-output-len", "4", "--num-prompts", "3", "--max-concurrency", "1", "--disable-tqdm",
              "--num-warmups", "1", "--result-dir", str(tmp_path), "--result-filename", "w.json"])
        server = metric_values(url)
        assert "use another --seed" not in capsys.readouterr().err
        # a shared prefix is what the cache is for: the report says how much of the prompts it served
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--random-prefix-len", "64",
              "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "3", "--max-concurrency", "1",
              "--disable-tqdm", "--seed", "1", "--result-dir", str(tmp_path), "--result-filename", "p.json"])
        # the first run again (same seed): served from the cache, which the report points out
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--random-input-len", "96",
              "--random-output-len", "4", "--num-prompts", "3", "--max-concurrency", "1", "--disable-tqdm",
              "--num-warmups", "0", "--result-dir", str(tmp_path), "--result-filename", "again.json"])
    assert "use another --seed" in capsys.readouterr().err
    assert json.loads((tmp_path / "again.json").read_text())["server_prefix_cache_hit_rate"] > 0.5
    cold, shared = (json.loads((tmp_path / f).read_text()) for f in ("w.json", "p.json"))
    assert cold["completed"] == 3 and cold["server_prefix_cache_hit_rate"] == 0
    assert server["vllm:prefix_cache_queries_total"] >= 4 * 90 and server["vllm:prefix_cache_hits_total"] == 0
    assert shared["completed"] == 3 and 0.3 < shared["server_prefix_cache_hit_rate"] < 0.7


def test_bench_serve_does_not_blame_the_seed_for_a_recompute_served_from_the_cache(tmp_path, capsys):
    """A server short of KV blocks preempts; a preempted request's recompute finds its own blocks in the
    prefix cache, so fresh random prompts show hits that no earlier run caused."""
    with running_server("--kv-cache-memory", "256KiB", "--max-model-len", "160") as (url, _):
        main(["bench", "serve", "--base-url", url, "--model", "tiny", "--random-input-len", "64",
              "--random-output-len", "64", "--num-prompts", "16", "--max-concurrency", "8", "--disable-tqdm",
              "--num-warmups", "0", "--result-dir", str(tmp_path), "--result-filename", "p.json"])
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["completed"] == 16 and result["server_preemptions"] > 0 and result["server_prefix_cache_hit_rate"] > 0
    assert "use another --seed" not in capsys.readouterr().err


def test_bench_serve_counts_failures(tmp_path):
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "64")
    with running_server(*flags) as (url, _):
        # prompts of 60 tokens + 16 output tokens exceed max_model_len: every request fails with a 400
        main(["bench", "serve", "--base-url", url, "--random-input-len", "60", "--random-output-len", "16",
              "--num-prompts", "4", "--disable-tqdm", "--num-warmups", "0", "--result-dir", str(tmp_path),
              "--result-filename", "f.json"])
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["failed"] == 4 and result["completed"] == 0
    assert all("HTTP 400" in e for e in result["errors"])


def test_bench_throughput_end_to_end(tmp_path):
    out = tmp_path / "t.json"
    main(["bench", "throughput", "--model", "tiny", "--kv-cache-memory", "16MiB", "--num-prompts", "12",
          "--random-input-len", "40", "--random-output-len", "10", "--random-range-ratio", "0.5",
          "--output-json", str(out), "--disable-tqdm"])
    result = json.loads(out.read_text())
    assert result["num_requests"] == 12 and result["requests_per_second"] > 0
    assert result["total_num_tokens"] == result["total_prompt_tokens"] + result["total_output_tokens"]
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])


def test_bench_throughput_takes_vllm_s_input_and_output_len(tmp_path):
    out = tmp_path / "t.json"
    main(["bench", "throughput", "--model", "tiny", "--kv-cache-memory", "16MiB", "--num-prompts", "4",
          "--input-len", "24", "--output-len", "6", "--output-json", str(out), "--disable-tqdm"])
    result = json.loads(out.read_text())
    assert result["total_prompt_tokens"] == 4 * 24 and result["total_output_tokens"] == 4 * 6


def test_offline_benchmarks_name_the_length_flags_when_requests_outgrow_the_context(capsys):
    """A request longer than --max-model-len stops the offline benchmarks before any work, naming their own length
    flags (a request's error would tell a benchmark's user to shorten max_tokens, which no flag of theirs sets)."""
    engine = ["--model", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "64"]
    runs = [(["bench", "throughput", *engine, "--num-prompts", "3", "--input-len", "60", "--output-len", "8"],
             "3 of the 3 requests need more than --max-model-len 64 tokens (the longest: 60 in the prompt + 8 out)"),
            (["bench", "latency", *engine, "--input-len", "60", "--output-len", "8"],
             "--input-len 60 + --output-len 8 = 68 tokens, more than --max-model-len 64")]
    for argv, words in runs:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "raise --max-model-len" in err


def test_offline_floors_price_each_term_by_hand():
    """The throughput benchmark's floors at a GPU's peaks: weights read or tokens computed a step, whichever is
    longer; the decodes' contexts (a request of 2 in / 3 out decodes over 3 and 4 tokens); the prompts' attention.
    Off a GPU the peaks are an H200's."""
    import torch

    from benchmarks.engine.length_curve import gpu_peaks
    from benchmarks.engine.offline_throughput import floors
    from pagedserve.config import EngineArgs
    from pagedserve.memory import kv_bytes_per_token, weight_bytes

    PEAK_FLOPS, PEAK_BYTES = 989e12, 3.35e12  # an H100's, which the floors take from the planner's presets
    m = EngineArgs(model="Qwen/Qwen3-8B", load_format="dummy").create_config(plan_for="cuda").model
    heavy = int(weight_bytes(m, torch.bfloat16) / PEAK_BYTES * PEAK_FLOPS / (2 * m.num_params())) + 100
    f = floors(m, torch.bfloat16, torch.float8_e4m3fn, [2], [3], [(0.0, 2, 0), (0.0, 0, 1), (0.0, heavy, 0)],
               (PEAK_FLOPS, PEAK_BYTES, "H100-80GB"))
    assert f["floor_projection_seconds"] == pytest.approx(
        2 * weight_bytes(m, torch.bfloat16) / PEAK_BYTES + 2 * m.num_params() * heavy / PEAK_FLOPS)
    assert f["floor_decode_kv_seconds"] == pytest.approx(7 * kv_bytes_per_token(m, torch.float8_e4m3fn) / PEAK_BYTES)
    assert f["floor_prompt_attention_seconds"] == pytest.approx(2 * m.num_layers * m.num_heads * m.head_dim * 4
                                                                / PEAK_FLOPS)
    terms = [v for k, v in f.items() if k not in ("floor_seconds", "floor_peaks", "floor_overlapped_seconds")]
    assert f["floor_seconds"] == pytest.approx(sum(terms))
    # overlapped: three weight reads and the K/V against every token's FLOPs and the prompt's attention
    reads = 3 * weight_bytes(m, torch.bfloat16) / PEAK_BYTES + f["floor_decode_kv_seconds"]
    computes = 2 * m.num_params() * (3 + heavy) / PEAK_FLOPS + f["floor_prompt_attention_seconds"]
    assert f["floor_overlapped_seconds"] == pytest.approx(max(reads, computes))
    assert reads > computes  # three weight reads outweigh one step just past the ridge
    assert f["floor_overlapped_seconds"] < f["floor_seconds"]
    assert f["floor_peaks"] == [PEAK_FLOPS, PEAK_BYTES, "H100-80GB"]
    if not torch.cuda.is_available():
        assert gpu_peaks() == (989e12, 4.8e12, "H200-141GB (assumed)")


def test_latency_on_off_settings_refuse_anything_else():
    assert on_off("on,off,on") == [True, False, True] and on_off("off") == [False]
    for bad in ("of", "on,", "yes", "on,Off"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of on and off"):
            on_off(bad)


def test_overlap_benchmark_sizes_refuse_anything_but_positive_integers():
    assert positives("256,512,1024") == [256, 512, 1024] and positives("7") == [7]
    for bad in ("0", "256,", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a whole number of at least 1"):
            positives(bad)


def test_server_flags_are_split_like_a_shell_and_checked_before_a_server_starts(capsys):
    """One string of server flags, split like a shell: kept as given when `pagedserve serve` takes them; a typo,
    or a flag the launcher sets itself, stops the command (argparse's exit 2, the flag named)."""
    p = argparse.ArgumentParser(prog="bench")
    assert server_flags(p, "tiny", "--max-num-seqs 4 --served-model-name 'a b'") == \
        ["--max-num-seqs", "4", "--served-model-name", "a b"]
    for bad, named in (("--port 9", "--port is chosen by the launcher"), ("--max-num-seqz 4", "--max-num-seqz 4")):
        with pytest.raises(SystemExit) as e:
            server_flags(p, "tiny", bad)
        assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("module", ["benchmarks.engine.online_serve", "benchmarks.serving.soak"])
def test_benchmarks_that_start_a_server_check_its_flags_before_starting_it(module, capsys, monkeypatch):
    """The benchmarks' own entry points go through that check (online_serve still takes its older flag name)."""
    flag = "--server-flags" if module.endswith("online_serve") else "--serve-args"
    monkeypatch.setattr("sys.argv", [module, "--model", "tiny", flag, "--port 9"])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main()
    assert e.value.code == 2 and "--port is chosen by the launcher" in capsys.readouterr().err


def test_a_benchmark_refused_by_the_engine_ends_with_its_message_not_a_traceback(capsys, monkeypatch):
    """A benchmark whose flags the engine refuses (a cache dtype its calibration was not measured with) ends as
    `pagedserve`'s commands do: the message on stderr and exit status 2; a load test that could not run, status 1."""
    monkeypatch.setattr("sys.argv", ["paced_online.py", "--serve-args", "--kv-cache-dtype fp8"])
    with pytest.raises(SystemExit) as e:
        run_main(importlib.import_module("benchmarks.serving.paced_online").main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("paced_online.py: error: --simulate h200-qwen3-8b-bf16 was measured")
    assert "h200-qwen3-8b-fp8" in err and "Traceback" not in err
    monkeypatch.setattr("sys.argv", ["paced_online.py", "--serve-args", "--max-num-seqz 4"])  # checked once, there
    with pytest.raises(SystemExit) as e:
        run_main(importlib.import_module("benchmarks.serving.paced_online").main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "paced_online.py: error:" in err and "--max-num-seqz 4" in err

    def server_gone() -> None:
        raise BenchmarkError("the server went away")
    with pytest.raises(SystemExit) as e:
        run_main(server_gone)
    assert e.value.code == 1 and "paced_online.py: error: the server went away" in capsys.readouterr().err


def test_overlap_benchmark_holds_the_gemms_to_fewer_sms_only_inside_its_carveout():
    """The carved arms' target is set while their prompts' GEMMs are issued (a graph keeps what was read at
    capture) and put back after, also when the arm raises."""
    import torch

    from benchmarks.kernels.overlap import carved, sm_carveout

    assert torch._C._get_sm_carveout_experimental() is None
    with sm_carveout(16):
        assert torch._C._get_sm_carveout_experimental() == 16
        with pytest.raises(RuntimeError), sm_carveout(32):
            assert torch._C._get_sm_carveout_experimental() == 32
            raise RuntimeError
        assert torch._C._get_sm_carveout_experimental() == 16
    assert torch._C._get_sm_carveout_experimental() is None
    assert carved(16) == "two streams, prompts' GEMMs on all but 16 SMs"
    assert carved(16, split=True) == "two streams, prompts' GEMMs on all but 16 SMs, decodes' on those"


def test_overlap_benchmark_splits_a_mixed_step_into_batches_that_compute_the_same_rows():
    """The overlap benchmark's decodes and prompts, run apart, give the rows of the one mixed batch: its
    arms differ only in how the same work is launched."""
    import torch

    from benchmarks.kernels.overlap import MixedStep
    from pagedserve.config import EngineArgs

    args = EngineArgs(model="tiny", load_format="dummy", device="cpu", dtype="float32", block_size=8)
    step = MixedStep(args, layers=2, decodes=3, context=5, prompt_tokens=7)
    assert [b.meta.query_lens_cpu.tolist() for b in step.batches.values()] == [[1, 1, 1, 7], [1, 1, 1], [7]]
    decodes = step.batches["decodes"].meta
    assert decodes.query_start_loc.tolist() == [0, 1, 2, 3] and decodes.max_query_len == 1
    assert (decodes.seq_lens >= 6).all() and (decodes.seq_lens <= 10).all()
    prompts = step.batches["prompts"]
    assert prompts.positions.tolist() == list(range(7)) and prompts.meta.query_start_loc.tolist() == [0, 7]
    arms = step.arms(carveouts=(16,))
    assert list(arms) == ["decodes", "prompts", "one batch", "in series"]  # the two-stream arms need CUDA streams
    one = arms["one batch"]()
    assert one.shape == (10, 64) and torch.isfinite(one).all()
    torch.testing.assert_close(arms["in series"](), one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arms["decodes"](), one[:3], rtol=1e-5, atol=1e-5)
