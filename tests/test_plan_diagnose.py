"""The planner (same formulas as the engine's start-up budget) and diagnose (on recorded metric series)."""

from __future__ import annotations

import json
import math

import pytest

from pagedserve import LLM
from pagedserve.cli import main
from pagedserve.builtin.known_models import KNOWN_MODELS
from pagedserve.config import EngineArgs, ModelConfig
from pagedserve.tune.diagnose import diagnose, parse_sample
from pagedserve.tune.plan import GPU_PRESETS, GRAPH_OVERHEAD_PER_SIZE, NON_TORCH_ESTIMATE, make_plan
from tests.serving import running_server

MiB = 2**20


def test_qwen3_8b_on_h200_by_hand():
    plan = make_plan(EngineArgs(model="Qwen/Qwen3-8B", gpu_memory_utilization=0.88, max_model_len=8192,
                                max_num_seqs=16, max_num_batched_tokens=4096), gpu="H200-141GB")
    b = plan.budget
    # parameters: 36 layers of (q,k,v,o + q/k norms + gate,up,down + 2 norms), embeddings, lm_head, final norm
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    params = 36 * layer + 2 * 151936 * 4096 + 4096
    assert params == 8_190_735_360
    assert b.weights == 2 * params
    assert b.bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    activation = 4096 * (2 * 4096 + 3 * 12288) * 2 + 16 * 151936 * (2 + 12)
    assert b.activation_peak == activation
    kv = int(GPU_PRESETS["H200-141GB"] * 0.88) - b.weights - activation - NON_TORCH_ESTIMATE
    assert b.kv_cache_bytes == kv and b.num_blocks == kv // (16 * 147_456)
    assert plan.concurrency["max_model_len 8192"] == pytest.approx(b.num_blocks / 512)
    # the engine logged 780,192 KV tokens for this exact configuration on the H200 (docs/lab-notes.md)
    assert abs(b.kv_tokens - 780_192) / 780_192 < 0.03
    assert not plan.failures and not plan.warnings
    # graphs: 41 prompt sizes up to 4096 tokens (48,992 tokens in all) keeping their hidden states, and 5 decode
    # batch sizes up to 16 (31 rows) their logits, in one pool that holds the largest prompt graph's activations;
    # smaller prompt graphs take fewer sizes (17, 4,192 tokens) and a smaller pool
    pool = 4096 * (2 * 4096 + 3 * 12288) * 2
    outputs = (31 * 151936 + 48_992 * 4096) * 2
    assert plan.cuda_graphs == (41 + 5) * GRAPH_OVERHEAD_PER_SIZE + outputs + pool
    # the server logged 0.10 + 0.71 GiB for these graphs on an H100 (docs/performance.md): part of a graph's output
    # lands in the pool, so the estimate is above it, the more so the more sizes; counted so, the 25 sizes of
    # quarter steps above 512 tokens come to a little above the 0.10 + 0.61 GiB logged for them
    assert 0.81 < plan.cuda_graphs / 2**30 < 0.81 * 1.4
    quarters = (25 + 5) * GRAPH_OVERHEAD_PER_SIZE + (31 * 151936 + 25_952 * 4096) * 2 + pool
    assert 0.71 < quarters / 2**30 < 0.71 * 1.2
    small = make_plan(EngineArgs(model="Qwen/Qwen3-8B", gpu_memory_utilization=0.88, max_model_len=8192,
                                 max_num_seqs=16, max_num_batched_tokens=4096, max_cudagraph_capture_size=512),
                      gpu="H200-141GB")
    assert small.cuda_graphs == (17 + 5) * GRAPH_OVERHEAD_PER_SIZE + (31 * 151936 + 4_192 * 4096) * 2 + pool // 8


def test_llama_tensor_parallel_fp8_by_hand():
    plan = make_plan(EngineArgs(model="meta-llama/Llama-3.1-8B", tensor_parallel_size=2, kv_cache_dtype="fp8",
                                max_model_len=16384), gpu="H100-80GB")
    b = plan.budget
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    params = 32 * layer + 2 * 128256 * 4096 + 4096
    assert b.weights == math.ceil(params / 2) * 2  # half of the weights on each rank
    assert b.bytes_per_token == 2 * 32 * 4 * 128 * 1  # 4 of the 8 KV heads per rank, 1 byte each
    assert b.non_torch > NON_TORCH_ESTIMATE  # communication buffers when sharded


def test_engine_block_count_equals_the_planner_on_cpu():
    for kwargs in (dict(kv_cache_memory="8MiB"), dict(num_gpu_blocks_override=300), dict(kv_cache_memory="3MiB", block_size=32)):
        plan = make_plan(EngineArgs(model="tiny", **kwargs))
        llm = LLM("tiny", **kwargs)
        assert llm.engine.core.pool.num_blocks == plan.budget.num_blocks == llm.memory_budget.num_blocks
        assert llm.memory_budget.kv_cache_bytes == plan.budget.kv_cache_bytes


def test_plan_failures_and_warnings():
    too_big = make_plan(EngineArgs(model="Qwen/Qwen3-8B", gpu_memory_utilization=0.5), gpu="RTX-4090")
    assert too_big.failures and "--gpu-memory-utilization" in too_big.failures[0]
    assert "weights" in too_big.failures[0].lower()
    no_len = make_plan(EngineArgs(model="meta-llama/Llama-3.1-8B", max_model_len=131072), gpu="RTX-4090")
    fits = no_len.budget.kv_tokens
    assert 0 < fits < 131072
    assert no_len.failures and f"Lower --max-model-len to at most {fits:,}" in no_len.failures[0]
    assert no_len.failures[0].endswith("or halve its size per token with --kv-cache-dtype fp8.")
    fp8 = make_plan(EngineArgs(model="meta-llama/Llama-3.1-8B", max_model_len=131072, kv_cache_dtype="fp8",
                               gpu_memory_utilization=0.9), gpu="RTX-4090")
    assert fp8.failures and fp8.failures[0].endswith("more memory (--gpu-memory-utilization / --kv-cache-memory).")
    greedy_util = make_plan(EngineArgs(model="Qwen/Qwen3-0.6B", gpu_memory_utilization=0.995), gpu="H100-80GB")
    assert any("headroom" in w for w in greedy_util.warnings)
    crowded = make_plan(EngineArgs(model="Qwen/Qwen3-8B", max_model_len=32768, max_num_seqs=128), gpu="A100-80GB",
                        input_len=30000, output_len=2000)
    [warning] = [w for w in crowded.warnings if "--max-num-seqs 128 can never all run" in w]
    # at the lengths given, a lower --max-model-len changes nothing; an fp8 cache would hold twice as many
    assert warning.endswith("or use --kv-cache-dtype fp8.") and "--max-model-len" not in warning
    at_cap = make_plan(EngineArgs(model="Qwen/Qwen3-32B", kv_cache_dtype="fp8"), gpu="H100-80GB")
    [warning] = [w for w in at_cap.warnings if "can never all run at 40960 tokens" in w]
    assert warning.endswith("; set --max-num-seqs 1 or lower --max-model-len.")  # the cache is fp8 already


def test_the_shipped_model_facts_give_the_checkpoints_parameter_counts():
    """Each built-in name's config.json facts give its checkpoint's parameter count (the published totals; Qwen3's
    model cards round to a tenth of a billion), so the planner sizes the real model: Llama-3.1-70B does not fit
    one H200 in 16 bits and does on two."""
    exact = {"meta-llama/Llama-3.2-1B": 1_235_814_400, "meta-llama/Llama-3.2-3B": 3_212_749_824,
             "meta-llama/Llama-3.1-8B": 8_030_261_248, "meta-llama/Llama-3.1-70B": 70_553_706_496,
             "mistralai/Mistral-7B-v0.3": 7_248_023_552, "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
             "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704}
    cards = {"Qwen/Qwen3-0.6B": 0.6, "Qwen/Qwen3-1.7B": 1.7, "Qwen/Qwen3-4B": 4.0, "Qwen/Qwen3-8B": 8.2,
             "Qwen/Qwen3-14B": 14.8, "Qwen/Qwen3-32B": 32.8, "Qwen/Qwen3-30B-A3B": 30.5, "microsoft/phi-4": 14.7}
    assert set(exact) | set(cards) == set(KNOWN_MODELS)
    for name, facts in KNOWN_MODELS.items():
        params = ModelConfig.from_hf_dict(facts).num_params()
        assert params == exact[name] if name in exact else round(params / 1e9, 1) == cards[name], (name, params)
    active = {name: ModelConfig.from_hf_dict(KNOWN_MODELS[name]).active_params() for name in
              ("Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-8B")}
    # the model cards' active parameters: Qwen3-30B-A3B's "3.3B", Mixtral's "12.9B"
    assert 3.3e9 <= active["Qwen/Qwen3-30B-A3B"] < 3.4e9 and round(active["mistralai/Mixtral-8x7B-v0.1"] / 1e8) == 129
    assert active["Qwen/Qwen3-8B"] == ModelConfig.from_hf_dict(KNOWN_MODELS["Qwen/Qwen3-8B"]).num_params()
    one = make_plan(EngineArgs(model="meta-llama/Llama-3.1-70B"), gpu="H200-141GB")
    assert one.failures and "--tensor-parallel-size" in one.failures[0]
    two = make_plan(EngineArgs(model="meta-llama/Llama-3.1-70B", tensor_parallel_size=2, max_model_len=32768),
                    gpu="H200-141GB")
    assert not two.failures and two.budget.weights == 70_553_706_496  # half of the 2-byte weights a GPU


def test_plan_cli_json_and_exit_code(capsys):
    main(["plan", "Qwen/Qwen3-0.6B", "--gpu", "H200-141GB", "--json", "--input-len", "512", "--output-len", "128"])
    out = json.loads(capsys.readouterr().out)
    assert out["starts"] and out["budget"]["kv_tokens"] > 0 and "512 in + 128 out" in out["concurrency"]
    with pytest.raises(SystemExit) as e:
        main(["plan", "Qwen/Qwen3-8B", "--gpu", "RTX-4090"])
    assert e.value.code == 1
    assert "FAILS AT START-UP" in capsys.readouterr().out


def test_plan_at_the_lengths_of_recorded_traffic(tmp_path, capsys):
    """--lengths-from: the concurrency at the recorded requests' p50, p95 and largest context (prompt +
    output), and the --max-num-seqs warning judged at the p95 instead of max_model_len."""
    rec = tmp_path / "traffic.jsonl"
    totals = [1000] * 90 + [6000] * 10  # p50 1000 tokens, p95 and largest 6000
    rec.write_text("".join(json.dumps({"prompt_tokens": t - 100, "output_tokens": 100}) + "\n" for t in totals))
    main(["plan", "Qwen/Qwen3-8B", "--gpu", "H100-80GB", "--max-model-len", "16384", "--max-num-seqs", "256",
          "--lengths-from", str(rec), "--json"])
    out = json.loads(capsys.readouterr().out)
    kv = out["budget"]["kv_tokens"]
    assert out["concurrency"]["recorded p50, 1000 tokens"] == pytest.approx(kv / 1000, rel=0.02)
    assert out["concurrency"]["recorded p95, 6000 tokens"] == pytest.approx(kv / 6000, rel=0.02)
    assert any("at 6000 tokens per request" in w for w in out["warnings"])
    with pytest.raises(SystemExit):
        main(["plan", "Qwen/Qwen3-8B", "--gpu", "H100-80GB", "--lengths-from", str(tmp_path / "missing.jsonl")])
    assert "--lengths-from" in capsys.readouterr().err


# ------------------------------------------------------------------ diagnose on recorded series


def metrics_text(running, waiting, kv, preemptions, ttft_sum, ttft_count, itl_sum, itl_count, *more) -> str:
    """A scrape in vLLM's exposition format (labels included), as recorded from a server; ``more``: the
    prefill-time and tokens-a-step histograms' (sum, count) pairs."""
    lab = '{engine="0",model_name="m"}'
    extra = []
    for name, (total, n) in zip(("vllm:request_prefill_time_seconds", "vllm:iteration_tokens_total"),
                                zip(more[::2], more[1::2])):
        extra += [f"# TYPE {name} histogram", f'{name}_bucket{{engine="0",le="+Inf",model_name="m"}} {n}',
                  f"{name}_count{lab} {n}", f"{name}_sum{lab} {total}"]
    return "\n".join([*extra,
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{lab} {running}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{lab} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{lab} {kv}",
        "# TYPE vllm:num_preemptions counter", f"vllm:num_preemptions_total{lab} {preemptions}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {ttft_count}',
        f"vllm:time_to_first_token_seconds_count{lab} {ttft_count}",
        f"vllm:time_to_first_token_seconds_sum{lab} {ttft_sum}",
        "# TYPE vllm:inter_token_latency_seconds histogram",
        f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {itl_count}',
        f"vllm:inter_token_latency_seconds_count{lab} {itl_count}",
        f"vllm:inter_token_latency_seconds_sum{lab} {itl_sum}", ""])


def series(rows):
    return [parse_sample(metrics_text(*row), t=float(i)) for i, row in enumerate(rows)]


def test_diagnose_start_up_failure():
    d = diagnose([])
    assert d.situation == 1 and "pagedserve plan" in d.first_change


def test_diagnose_kv_pressure_from_preemptions():
    rows = [(16, 4, 0.97, 10 + i * 3, 10 + i, 100 + 10 * i, 5 + i, 500 + 100 * i) for i in range(6)]
    d = diagnose(series(rows), max_num_seqs=16)
    assert d.situation == 2 and "--max-num-seqs" in d.first_change and "preemptions in the window: 15" in d.text()
    assert "--kv-cache-dtype fp8 doubles the cache" in d.first_change
    # a server whose cache is fp8 already (vLLM's cache config info says so) is not told to make it fp8
    info = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="fp8",enable_prefix_caching="True"} 1.0\n')
    fp8 = [parse_sample(info + metrics_text(*row), t=float(i)) for i, row in enumerate(rows)]
    d = diagnose(fp8, max_num_seqs=16)
    assert d.situation == 2 and "--max-num-seqs" in d.first_change and "fp8" not in d.first_change


def test_diagnose_queueing_at_the_sequence_cap():
    # TTFT climbs (queueing), running pinned at 16, KV at 20 %, no preemption
    rows = [(16, 3 * i, 0.2, 0, sum(0.1 * (1 + k) for k in range(i + 1)), i + 1, 0.03 * 50 * i, 50 * i)
            for i in range(8)]
    d = diagnose(series(rows), max_num_seqs=16)
    assert d.situation == 3 and "raise --max-num-seqs" in d.first_change
    # a pagedserve server reports its limits in force: no flags needed to place the queue at the cap
    samples = series(rows)
    for s in samples:
        s.update(parse_sample('pagedserve:max_num_seqs{engine="0"} 16\n'
                              'pagedserve:max_num_batched_tokens{engine="0"} 4096\n', s["t"]))
    d = diagnose(samples)
    assert d.situation == 3 and "raise --max-num-seqs" in d.first_change
    assert "limits in force at the last scrape (the server's /metrics): --max-num-seqs 16, " \
           "--max-num-batched-tokens 4096" in d.text()
    d = diagnose(samples, max_num_seqs=64)  # a flag given wins: below its cap the token budget is the bound
    assert "token budget" in d.title


def test_diagnose_token_budget_bound():
    # 1.9 s of each 2 s TTFT in prefill; steps of 4,000 tokens on average
    rows = [(6, 5, 0.3, 0, 2.0 * (i + 1), i + 1, 0.02 * 40 * i, 40 * i, 1.9 * (i + 1), i + 1, 4000.0 * 10 * i, 10 * i)
            for i in range(6)]
    d = diagnose(series(rows), max_num_seqs=64, max_num_batched_tokens=4096)
    assert d.situation == 3 and "--max-num-batched-tokens" in d.first_change and "token budget" in d.title
    assert "mean prefill time 1900.0 ms" in d.text()
    assert "mean tokens a step 4000 (98 % of --max-num-batched-tokens 4096)" in d.text()
    assert "- mean tokens a step 4000\n" in diagnose(series(rows), max_num_seqs=64).text()  # no budget given


def test_diagnose_itl_rising_without_queue():
    itl_sum, rows = 0.0, []
    for i in range(8):
        itl_sum += 100 * (0.02 if i < 4 else 0.2)
        rows.append((8, 0, 0.4, 0, 0.5 * (i + 1), i + 1, itl_sum, 100 * (i + 1)))
    d = diagnose(series(rows), max_num_seqs=64)
    assert d.situation == 3 and "CPU scheduling" in d.title and "--max-mixed-prefill-tokens" in d.first_change
    # the same on a GPU server whose engine waited on the GPU 2 % of the time: the host is named, not prompts
    samples = series(rows)
    for s in samples:
        s.update(parse_sample(f'pagedserve:device_wait_seconds_total{{engine="0"}} {0.02 * s["t"]}\n', s["t"]))
    d = diagnose(samples, max_num_seqs=64)
    assert "GPU idles between steps" in d.title and "--max-num-seqs" in d.first_change
    assert "--stream-interval 4" in d.first_change  # fewer frames: the host work a token that is cheapest to cut
    assert "waited on the GPU 2 % of the window" in d.text()


def test_diagnose_healthy():
    rows = [(4, 0, 0.1, 2, 0.05 * (i + 1), i + 1, 0.02 * 30 * (i + 1), 30 * (i + 1)) for i in range(5)]
    d = diagnose(series(rows), max_num_seqs=64, url="http://h:8000")
    assert d.situation is None and "--base-url http://h:8000 --concurrency" in d.first_change
    assert "--replay-speeds 1,2,4,8" in d.first_change  # or today's recorded traffic, sped up


def test_diagnose_cli_against_a_running_server(capsys):
    with running_server("--kv-cache-memory", "4MiB") as (url, _):
        main(["diagnose", "--url", url, "--window", "1", "--interval", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["situation"] is None and out["evidence"]
    assert any(e.startswith("limits in force") and "--max-num-seqs" in e for e in out["evidence"])
    with pytest.raises(SystemExit):
        main(["diagnose", "--url", url, "--max-num-batched-tokens", "0"])
    assert "argument --max-num-batched-tokens: '0': must be a whole number of at least 1" in capsys.readouterr().err
    main(["diagnose", "--url", "http://127.0.0.1:9", "--window", "0", "--json"])
    down = json.loads(capsys.readouterr().out)
    assert down["situation"] == 1 and "listens at http://127.0.0.1:9" in down["first_change"]
    assert "http://127.0.0.1:9/metrics (last try: ConnectError" in down["evidence"][0]
