"""Every bad configuration fails with a message that names the numbers and the flag to change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs, ModelConfig
from pagedserve.errors import ConfigError
from pagedserve.memory import GiB, check_free_memory, check_host_memory, compute_budget, host_memory_available
from pagedserve.builtin.known_models import KNOWN_MODELS
from pagedserve.cli import main


def config_error(**kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        EngineArgs(**kwargs).create_config()
    return str(e.value)


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(max_num_seqs=0), ["--max-num-seqs"]),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), ["--max-num-batched-tokens", "8", "16"]),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
     ["--max-num-batched-tokens", "512", "1024", "--enable-chunked-prefill"]),
    (dict(block_size=12), ["--block-size", "12"]),
    (dict(reasoning_parser="qwen"), ["--reasoning-parser", "qwen3, deepseek_r1"]),
    (dict(gpu_memory_utilization=1.5), ["--gpu-memory-utilization"]),
    (dict(max_model_len=100_000), ["--max-model-len", "100000", "2048", "--hf-overrides"]),
    (dict(hf_overrides="{rope"), ["--hf-overrides", "is not JSON"]),
    (dict(hf_overrides="[1]"), ["--hf-overrides", "not a JSON object"]),
    (dict(hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), ["'dynamic'", "yarn"]),
    (dict(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
     ["yarn rope scaling's original_max_position_embeddings is None"]),
    (dict(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512,
                                         "beta_fast": "32"}}), ["beta_fast is '32'"]),
    (dict(hf_overrides={"rope_parameters": {"rope_theta": -1}}), ["rope_theta is -1"]),
    (dict(hf_overrides={"rope_theta": 5e5}), ["rope_theta is 500000.0 at the top", "in rope_parameters"]),
    (dict(hf_overrides={"max_position_embeddings": "64k"}), ["max_position_embeddings is '64k'"]),
    (dict(hf_overrides={"partial_rotary_factor": 0.75}), ["partial_rotary_factor is 0.75"]),
    (dict(max_model_len="lots"), ["--max-model-len", "lots"]),
    (dict(dtype="int4"), ["--dtype", "int4"]),
    (dict(kv_cache_dtype="int8"), ["--kv-cache-dtype"]),
    (dict(load_format="pickle"), ["--load-format"]),
    (dict(model="no/such-model"), ["--model", "no/such-model"]),
    (dict(model="Qwen/Qwen3-8B"), ["--load-format dummy"]),
    (dict(tensor_parallel_size=3), ["--tensor-parallel-size", "3"]),
    (dict(device="tpu"), ["--device"]),
    (dict(max_cudagraph_capture_size=-16), ["--max-cudagraph-capture-size", "-16"]),
    (dict(attention_backend="magic", load_format="dummy"), "--attention-backend"),
])
def test_bad_engine_args(kwargs, fragments):
    if isinstance(fragments, str):  # rejected when the runner is built
        with pytest.raises(ConfigError, match=fragments):
            LLM(**kwargs, kv_cache_memory="1MiB")
        return
    msg = config_error(**kwargs)
    for f in fragments:
        assert f in msg, msg


def test_hf_overrides_stretch_the_context_as_the_rope_scaling_says(capsys):
    """Qwen3's YaRN recipe given on the command line: the context limit is the trained length times the factor
    (the file's rope_theta kept beside the scaling), and the planner sizes the KV cache at it."""
    yarn = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    config = EngineArgs(model="Qwen/Qwen3-8B", hf_overrides=yarn).create_config(plan_for="cuda")
    assert config.max_model_len == 131072 and config.model.rope_theta == 1e6
    assert config.model.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    msg = config_error(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, max_model_len=4097)
    assert "(4096: max_position_embeddings times the linear factor)" in msg  # the tiny model's 2,048, twice
    main(["plan", "Qwen/Qwen3-8B", "--gpu", "H200-141GB", "--hf-overrides", yarn])
    assert "Max concurrency @ max_model_len 131072" in capsys.readouterr().out


def test_more_tensor_parallel_ranks_than_gpus_is_refused_before_any_rank_starts(monkeypatch):
    """A rank a GPU: on a machine that shows fewer, the flag is named at once (a rank started without its GPU fails
    in its own process while the others wait for it). The planner sizes any count without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    msg = config_error(model="Qwen/Qwen3-8B", load_format="dummy", device="cuda", tensor_parallel_size=2)
    assert "(--tensor-parallel-size): 2 ranks need 2 GPUs, one each, but 1 is visible (CUDA_VISIBLE_DEVICES=3)" in msg
    assert EngineArgs(model="Qwen/Qwen3-8B", tensor_parallel_size=2).create_config(plan_for="cuda").model.num_layers


def test_a_broken_checkpoint_folder_is_named_not_a_traceback(tmp_path):
    """config.json that is not JSON, not an object, or lacks a size; an index that is not JSON or has no weight
    map: each stops with the file or the key named."""
    facts = dict(KNOWN_MODELS["Qwen/Qwen3-0.6B"])
    for text, fragment in (("{", "config.json' could not be read as JSON"), ("[1]", "holds a list"),
                           (json.dumps({**facts, "hidden_size": None}), "hidden_size is None"),
                           (json.dumps({**facts, "num_hidden_layers": 0}), "num_hidden_layers is 0"),
                           (json.dumps({**facts, "vocab_size": True}), "vocab_size is True")):
        (tmp_path / "config.json").write_text(text)
        assert fragment in config_error(model=str(tmp_path), load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({**facts, "num_hidden_layers": 1, "hidden_size": 64,
                                                       "intermediate_size": 128, "vocab_size": 256}))
    for text, fragment in (("{", "model.safetensors.index.json' could not be read as JSON"),
                           ("{}", "has no weight_map")):
        (tmp_path / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ConfigError, match=fragment):
            LLM(str(tmp_path), kv_cache_memory="1MiB")


def test_unknown_llm_kwarg_is_named():
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM("tiny", max_num_seq=4)


def test_kv_cache_too_small_for_max_model_len_suggests_a_length():
    with pytest.raises(ConfigError) as e:
        LLM("tiny", num_gpu_blocks_override=10, max_model_len=1024)
    msg = str(e.value)
    assert "160 tokens" in msg and "max_model_len=1,024" in msg and "--max-model-len to at most 160" in msg


def test_max_model_len_auto_fits_the_context_to_the_cache(capsys):
    """auto (or -1): the model's context where one request of it fits, else what the cache holds, which every part
    of the engine then holds requests to; the planner says so. It needs chunked prefill (the step's budget)."""
    assert LLM("tiny", max_model_len=-1).engine.config.max_model_len == 2048  # 1 GiB holds the whole context
    llm = LLM("tiny", max_model_len="auto", num_gpu_blocks_override=10)
    engine = llm.engine
    assert engine.config.max_model_len == engine.core.scheduler.max_model_len == 160
    assert engine.core.worker.runner.config.max_model_len == 160
    out = llm.generate([list(range(3, 150))], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 160  # the rest of the fitted context
    with pytest.raises(ValueError, match="maximum context length is 160 tokens"):
        llm.generate([list(range(3, 150))], SamplingParams(max_tokens=14), use_tqdm=False)
    assert "--enable-chunked-prefill, or give a length" in config_error(max_model_len="auto",
                                                                       enable_chunked_prefill=False)
    yarn = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    main(["plan", "Qwen/Qwen3-8B", "--gpu-memory", "24", "--max-model-len", "auto", "--hf-overrides", yarn])
    out = capsys.readouterr().out
    tokens = int(out.split(" tokens (gpu_memory_utilization)")[0].rsplit("= ", 1)[1].replace(",", ""))
    assert tokens < 131072 and f"Max concurrency @ max_model_len {tokens}  1.00" in out
    assert f"--max-model-len auto: the KV cache holds {tokens:,} tokens, fewer than the model's context of 131,072" in out


def test_kv_cache_without_a_block_asks_for_memory_not_a_shorter_length():
    with pytest.raises(ConfigError) as e:
        LLM("tiny", kv_cache_memory="1KiB")
    msg = str(e.value)
    assert "holds 0 tokens" in msg and "--max-model-len" not in msg and "Give the cache more memory" in msg


QWEN3_8B = ModelConfig.from_hf_dict(KNOWN_MODELS["Qwen/Qwen3-8B"])


def test_weights_do_not_fit():
    with pytest.raises(ConfigError) as e:
        compute_budget(model=QWEN3_8B, kv_dtype=torch.bfloat16, block_size=16, max_model_len=8192,
                       weights=16 * GiB, activation_peak=GiB, device_total=24 * GiB, utilization=0.5).check()
    msg = str(e.value)
    assert "16.00 GiB" in msg and "12.00 GiB" in msg and "--gpu-memory-utilization" in msg and "0.67" in msg


def test_weights_that_cannot_fit_fail_before_they_load(monkeypatch):
    """Checked at start-up before the load, from the config's own parameter count: on a GPU against the budget
    (the planner's message) or, with the cache sized in bytes, what is free; on the CPU against the machine's
    available memory. A model that fits goes on to load."""
    qwen = EngineArgs(model="Qwen/Qwen3-8B", load_format="dummy", gpu_memory_utilization=0.9)
    gpu = qwen.create_config(plan_for="cuda")  # bf16: 15.26 GiB of weights
    with pytest.raises(ConfigError) as e:
        check_free_memory(free=15 * GiB, total=16 * GiB, config=gpu)
    assert "budget is only 14.40 GiB" in str(e.value) and "--tensor-parallel-size" in str(e.value)
    assert "need a utilization above 0.95" in str(e.value)
    with pytest.raises(ConfigError, match="They are larger than the whole device: use a smaller --dtype"):
        check_free_memory(free=12 * GiB, total=12 * GiB, config=gpu)
    check_free_memory(free=40 * GiB, total=40 * GiB, config=gpu)
    sized = dataclasses.replace(qwen, kv_cache_memory="1GiB").create_config(plan_for="cuda")
    with pytest.raises(ConfigError, match="the device has 15.00 GiB free"):
        check_free_memory(free=15 * GiB, total=80 * GiB, config=sized)
    cpu = qwen.create_config(plan_for="cpu")  # float32 on the CPU: 30.51 GiB
    with pytest.raises(ConfigError) as e:
        check_host_memory(cpu, 20 * GiB)
    assert "30.51 GiB (float32)" in str(e.value) and "--dtype bfloat16 halves them" in str(e.value)
    check_host_memory(cpu, 40 * GiB)
    check_host_memory(cpu, None)  # unknown: the load finds out
    assert (host_memory_available() or 0) > 0
    monkeypatch.setattr("pagedserve.model.worker.host_memory_available", lambda: 100 * 2**10)  # the tiny: 0.53 MiB
    with pytest.raises(ConfigError, match="this machine has 0.10 MiB of memory available"):
        LLM("tiny", kv_cache_memory="1MiB")


def test_no_room_left_for_kv_cache():
    with pytest.raises(ConfigError) as e:
        compute_budget(model=QWEN3_8B, kv_dtype=torch.bfloat16, block_size=16, max_model_len=8192,
                       weights=16 * GiB, activation_peak=4 * GiB, device_total=24 * GiB, utilization=0.8).check()
    assert "--max-num-batched-tokens" in str(e.value) and "No memory left for the KV cache" in str(e.value)


def test_budget_arithmetic():
    b = compute_budget(model=QWEN3_8B, kv_dtype=torch.bfloat16, block_size=16, max_model_len=8192,
                       weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB, device_total=100 * GiB,
                       utilization=0.9).check()
    per_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads, head_dim 128, bf16
    assert b.bytes_per_token == per_token == 147456
    assert b.kv_cache_bytes == int(100 * GiB * 0.9) - 19 * GiB
    assert b.num_blocks == b.kv_cache_bytes // (16 * per_token)
    assert b.max_concurrency() == pytest.approx(b.num_blocks / 512)
    assert any("KV cache size:" in line for line in b.report_lines())


@pytest.mark.parametrize("command", [["bench", "latency", "--model", "tiny"], ["calibrate", "tiny"]])
def test_an_output_file_that_cannot_be_written_fails_before_the_work(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flag = "--output" if command[0] == "calibrate" else "--output-json"
    for bad, why in ((blocker / "x.json", "cannot be created"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit):
            main([*command, flag, str(bad)])
        err = capsys.readouterr().err
        assert f"{flag} {bad}" in err and why in err and "Traceback" not in err
    if Path("/proc/self").is_dir():  # a folder that exists and takes no new file, whatever the user's rights
        with pytest.raises(SystemExit):
            main([*command, flag, "/proc/pagedserve.json"])
        err = capsys.readouterr().err
        assert f"{flag} /proc/pagedserve.json: the folder /proc is not writable" in err and "Traceback" not in err


def test_a_result_folder_that_cannot_be_made_fails_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for command in (["bench", "serve", "--base-url", "http://127.0.0.1:9"], ["bench", "sweep", "--model", "tiny"]):
        with pytest.raises(SystemExit):
            main([*command, "--result-dir", str(blocker / "out")])
        err = capsys.readouterr().err
        assert f"--result-dir {blocker / 'out'}" in err and "cannot be created" in err and "Traceback" not in err


def test_a_count_below_one_is_refused_before_any_work(capsys):
    """The benchmarks take their counts and lengths as argparse types: 0, a negative or a fraction stops the command
    naming the flag, before a model loads or a server is asked (a prefix or a warm-up may be 0, not negative)."""
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
    throughput = ["bench", "throughput", "--model", "tiny"]
    latency = ["bench", "latency", "--model", "tiny"]
    lengths = ("--num-prompts", "--random-input-len", "--random-output-len")
    cases = [(c, f) for c in (serve, throughput) for f in lengths]
    cases += [(throughput, "--input-len"), (serve, "--custom-output-len"), (serve, "--sharegpt-output-len"),
              (serve, "--max-concurrency")]
    cases += [(latency, f) for f in ("--input-len", "--output-len", "--batch-size", "--num-iters")]
    for command, flag in cases:
        for bad in ("0", "-1", "1.5"):
            with pytest.raises(SystemExit) as e:
                main([*command, flag, bad])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"'{bad}': must be a whole number of at least 1" in err and flag in err
    for command, flag in ((serve, "--random-prefix-len"), (latency, "--num-iters-warmup")):
        with pytest.raises(SystemExit) as e:
            main([*command, flag, "-1"])
        assert e.value.code == 2 and f"argument {flag}: '-1': must be a whole number of at least 0" in \
            capsys.readouterr().err


def assert_refused_by_parser(capsys, cases) -> None:
    """Each (command, flag, value, rule) stops at parsing, exit status 2, with argparse's line naming the flag."""
    for command, flag, bad, rule in cases:
        with pytest.raises(SystemExit) as e:
            main([*command, flag, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: '{bad}': must be {rule}" in err and "Traceback" not in err


def test_plan_and_the_simulator_refuse_a_length_or_gpu_size_that_means_nothing(capsys):
    """plan's typical lengths and the --gpu-memory of plan and of a simulated sweep are argparse types: a negative
    length no longer divides by zero, and 0 GiB is refused instead of meaning "no size given"."""
    plan = ["plan", "Qwen/Qwen3-8B", "--gpu", "H100-80GB"]
    sweep = ["bench", "sweep", "--model", "tiny", "--simulate", "h200-qwen3-0.6b-bf16"]
    whole = "a whole number of at least 1"
    cases = [(plan, "--input-len", "-5", whole), (plan, "--output-len", "0", whole)]
    cases += [(c, "--gpu-memory", bad, "a number above 0") for c in (plan, sweep) for bad in ("0", "-5", "nan", "x")]
    assert_refused_by_parser(capsys, cases)


def test_generate_diagnose_and_serve_settings_are_checked_as_they_are_parsed(capsys):
    """A token count of 0 no longer means "the default", a negative temperature or shutdown wait no longer reaches a
    model load, and an interval of 0 no longer makes diagnose scrape in a busy loop; every count is refused by the
    parser, so a --config file's value meets the same rule, and a sweep no longer starts its server first."""
    generate, diagnose = ["generate", "tiny"], ["diagnose", "--url", "http://127.0.0.1:9"]
    serve, bench = ["serve", "tiny"], ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
    sweep, quality = ["bench", "sweep", "--model", "tiny"], ["bench", "quality", "tiny"]
    whole, above, zero = "a whole number of at least 1", "a number above 0", "a number of at least 0"
    cases = [(generate, "--max-tokens", "0", whole), (generate, "--temperature", "-0.5", zero),
             (serve, "--shutdown-timeout", "-1", zero), (bench, "--replay-speed", "-2", above),
             (bench, "--num-warmups", "-1", "a whole number of at least 0"),
             (serve, "--stream-interval", "0", whole), (serve, "--max-num-queued-reqs", "0", whole),
             (serve, "--max-num-queued-tokens", "-5", whole),
             (serve, "--max-stored-responses", "-1", "a whole number of at least 0"),
             (sweep, "--repeats", "0", whole), (sweep, "--prompts-per-rung", "0", whole),
             (quality, "--num-prompts", "0", whole), (quality, "--max-tokens", "0", whole),
             (sweep, "--server-start-timeout", "-1", above), (sweep, "--server-start-timeout", "nan", above)]
    cases += [(c, "--random-range-ratio", bad, "a number in [0, 1)") for c in (sweep, bench) for bad in ("1.5", "nan")]
    cases += [(c, "--port", bad, "a TCP port, 1 to 65535") for c in (serve, bench, sweep) for bad in ("0", "99999")]
    cases += [(diagnose, "--interval", bad, above) for bad in ("0", "-5", "nan")]
    cases += [(diagnose, "--window", bad, zero) for bad in ("-5", "nan")]
    assert_refused_by_parser(capsys, cases)


def test_bench_serve_refuses_a_rate_or_burstiness_that_is_not_a_number_above_zero(capsys):
    """nan passes a `<= 0` check; refused before any request is sent, as 0 and a negative are (inf is a rate:
    every request at once, not a burstiness)."""
    for flag, bad in (("--request-rate", "nan"), ("--request-rate", "0")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "tiny", flag, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--request-rate must be above 0" in err and "Warm-up" not in err
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "tiny"]
    for command in (serve, ["bench", "sweep", "--model", "tiny", "--request-rates", "1,2"]):
        for bad in ("nan", "inf", "-1"):  # the ladder's burstiness too, which took nan and ran
            with pytest.raises(SystemExit) as e:
                main([*command, "--burstiness", bad])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"argument --burstiness: '{bad}': must be a number above 0" in err, err


def test_a_dataset_file_that_is_missing_stops_a_benchmark_before_any_server_or_model(tmp_path, capsys):
    """Checked up front, as a recording is: a sweep no longer starts its server, nor `bench throughput` its model,
    to find that the file is not there."""
    commands = (["bench", "sweep", "--model", "tiny"], ["bench", "throughput", "--model", "tiny"],
                ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "tiny"])
    for command in commands:
        for flags, words in ((["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path."),
                             (["--dataset-name", "custom", "--dataset-path", str(tmp_path / "none.jsonl")],
                              f"--dataset-path '{tmp_path / 'none.jsonl'}' is not a file.")):
            with pytest.raises(SystemExit) as e:
                main([*command, *flags])
            out, err = capsys.readouterr()
            assert e.value.code == 2 and words in err and "Starting" not in out and "Traceback" not in err, err


def test_knee_settings_refuse_a_failure_rate_that_would_place_or_hide_every_knee(capsys):
    """A negative --knee-max-failure-rate put the knee at the first rung; nan (every comparison false) or 1 never
    let failures place one: refused before the server starts."""
    for bad in ("-0.1", "nan", "1"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "sweep", "--model", "tiny", "--knee-max-failure-rate", bad])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and "--knee-max-failure-rate in [0, 1)" in err and "Starting" not in out, err


def test_serve_refuses_an_address_or_a_recording_it_cannot_use_before_loading_the_model(capsys, monkeypatch):
    import socket

    from pagedserve.server.async_engine import AsyncEngine

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started before the flags were checked")

    monkeypatch.setattr(AsyncEngine, "__init__", no_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, why in ((["--port", str(port)], "cannot listen there"), (["--host", "no-such-host.invalid"],
                                                                             "no such address"),
                           (["--record-lengths", "/proc/no-such-folder/traffic.jsonl"], "cannot append to it")):
            with pytest.raises(SystemExit):
                main(["serve", "tiny", *flags])
            err = capsys.readouterr().err
            assert why in err and "Traceback" not in err


@pytest.mark.parametrize("kwargs, words", [
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization (--gpu-memory-utilization): '0.9' is not a number"),
    (dict(enable_prefix_caching="no"), "'no' is not true or false"),  # a truthy string must not mean on
    (dict(max_num_seqs=4.5), "4.5 is not an integer (or None)"),
    (dict(seed="x"), "seed (--seed): 'x' is not an integer"),
    (dict(tokenizer=3), "3 is not a string (or None)"),
])
def test_llm_arguments_of_the_wrong_type_are_named(kwargs, words):
    with pytest.raises(ConfigError) as e:
        LLM("tiny", **kwargs)
    assert words in str(e.value)


def test_a_model_folder_may_be_a_path(tiny_path):
    assert LLM(tiny_path, kv_cache_memory="16MiB").engine.config.source.name == str(tiny_path)


def test_a_sliding_window_holds_where_the_architecture_applies_it():
    """Mistral, Mixtral and Phi-3 apply config.json's sliding_window as given; Qwen2 only with use_sliding_window
    (its files carry a window they do not use). Where it holds, it is the context limit."""
    phi = {**KNOWN_MODELS["microsoft/phi-4"], "sliding_window": 2047}
    assert ModelConfig.from_hf_dict(phi).context_limit()[0] == 2047
    qwen = KNOWN_MODELS["Qwen/Qwen2.5-7B-Instruct"]
    assert qwen["sliding_window"] == 131072 and ModelConfig.from_hf_dict(qwen).sliding_window is None
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True, "sliding_window": 4096}).sliding_window == 4096
