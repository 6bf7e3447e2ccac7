"""The degradation path: the switching rule on synthetic signals, the profiles file's validation, a real
server switching to protect under a flood of long prompts and back, the admin calls, `tune` end to end,
and the fp8 quality check."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import yaml

from pagedserve.cli import main
from pagedserve.config import EngineArgs
from pagedserve.errors import ConfigError
from pagedserve.tune.derive import derive
from pagedserve.tune.profiles import ProfileController, ProfilesFile, check_against_engine, load_profiles
from tests.serving import metric_values, running_server, wait_until

ENGINE = ("--kv-cache-memory", "16MiB", "--max-model-len", "1024", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "512")


def spec(**triggers) -> ProfilesFile:
    return ProfilesFile.model_validate({
        "profiles": {"normal": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
                     "protect": {"max_num_seqs": 2, "max_num_batched_tokens": 256, "max_input_tokens": 100}},
        "triggers": triggers or {"kv_cache_usage": {"above": 0.9, "for_s": 10}},
        "recovery": {"min_dwell_s": 60, "hold_s": 20}})


def feed(ctrl: ProfileController, series: list[tuple[float, dict]]) -> list:
    return [sw for t, v in series if (sw := ctrl.update(t, v)) is not None]


def test_a_trigger_fires_only_after_its_time_above_the_level():
    ctrl = ProfileController(spec())
    switches = feed(ctrl, [(t, {"kv_cache_usage": 0.95}) for t in range(0, 10)])
    assert switches == [] and ctrl.active == "normal"  # 9 s above: not yet
    sw = ctrl.update(10, {"kv_cache_usage": 0.95})
    assert sw.to_profile == "protect" and sw.from_profile == "normal" and not sw.manual
    assert sw.reason == "kv_cache_usage 0.95 > 0.9 for 10 s" and sw.values == {"kv_cache_usage": 0.95}


def test_a_spike_shorter_than_the_trigger_time_does_nothing():
    ctrl = ProfileController(spec())
    series = [(t, {"kv_cache_usage": 0.99 if t % 8 < 5 else 0.5}) for t in range(200)]
    assert feed(ctrl, series) == [] and ctrl.active == "normal"


def test_recovery_waits_for_the_dwell_and_the_hold_and_does_not_flap():
    ctrl = ProfileController(spec())
    feed(ctrl, [(t, {"kv_cache_usage": 0.95}) for t in range(11)])
    assert ctrl.active == "protect" and ctrl.since == 10
    # between the clear level (0.72) and the fire level: neither fires nor clears, for a long time
    assert feed(ctrl, [(t, {"kv_cache_usage": 0.8}) for t in range(11, 300)]) == []
    assert ctrl.active == "protect"
    # clear from t=300: the hold (20 s) ends at 320, long after the dwell (60 s)
    switches = feed(ctrl, [(t, {"kv_cache_usage": 0.5}) for t in range(300, 330)])
    assert [(s.at, s.to_profile) for s in switches] == [(320, "normal")]
    assert "for 20 s, after 310 s in protect" in switches[0].reason


def test_recovery_is_held_back_by_the_minimum_dwell():
    ctrl = ProfileController(spec())
    feed(ctrl, [(t, {"kv_cache_usage": 0.95}) for t in range(11)])
    assert feed(ctrl, [(t, {"kv_cache_usage": 0.1}) for t in range(11, 41)]) == []
    assert ctrl.earliest_recovery(40) == 30  # the dwell (60 s from t=10) binds, not the hold (done at 31)
    switches = feed(ctrl, [(t, {"kv_cache_usage": 0.1}) for t in range(41, 100)])
    assert [s.at for s in switches] == [70]


def test_missing_data_never_fires_nor_blocks_recovery_and_several_triggers_name_themselves():
    ctrl = ProfileController(spec(itl_p95_ms={"above": 50, "for_s": 0}, queue_depth={"above": 4, "for_s": 0}))
    assert ctrl.update(0, {"itl_p95_ms": None, "queue_depth": 0}) is None
    sw = ctrl.update(1, {"itl_p95_ms": 80.0, "queue_depth": 9.0})
    assert sw.reason == "itl_p95_ms 80 > 50; queue_depth 9 > 4"
    switches = feed(ctrl, [(t, {"itl_p95_ms": None, "queue_depth": 0.0}) for t in range(2, 100)])
    assert [s.to_profile for s in switches] == ["normal"]


def test_recovery_judges_the_cause_and_holds_the_other_signals_to_their_level():
    # protect's smaller batches raise TTFT for the same traffic: once the long prompts are gone, a TTFT
    # above its clear level but below its fire level must not keep the server in protect
    ctrl = ProfileController(spec(long_prompts_per_min={"above": 4, "for_s": 0}, long_prompt_tokens=100,
                                  ttft_p95_ms={"above": 1000, "for_s": 10}))
    sw = ctrl.update(0, {"long_prompts_per_min": 9.0, "ttft_p95_ms": 300.0})
    assert sw.to_profile == "protect"
    # the burst counts for a while; TTFT under protect sits at 900 ms (clear level 800, fire level 1000)
    assert feed(ctrl, [(t, {"long_prompts_per_min": 9.0, "ttft_p95_ms": 900.0}) for t in range(1, 100)]) == []
    switches = feed(ctrl, [(t, {"long_prompts_per_min": 0.0, "ttft_p95_ms": 900.0}) for t in range(100, 130)])
    assert [(s.at, s.to_profile) for s in switches] == [(120, "normal")]
    assert switches[0].reason.startswith("long_prompts_per_min at or below the clear level")
    # a signal that is not the cause but above its own level still blocks the return
    ctrl = ProfileController(spec(long_prompts_per_min={"above": 4, "for_s": 0}, long_prompt_tokens=100,
                                  ttft_p95_ms={"above": 1000, "for_s": 10}))
    ctrl.update(0, {"long_prompts_per_min": 9.0})
    assert feed(ctrl, [(t, {"long_prompts_per_min": 0.0, "ttft_p95_ms": 1500.0}) for t in range(1, 200)]) == []
    assert ctrl.active == "protect"


def test_a_manual_switch_pins_until_auto():
    ctrl = ProfileController(spec())
    sw = ctrl.pin("protect", 5)
    assert sw.manual and ctrl.active == "protect" and ctrl.pinned
    assert feed(ctrl, [(t, {"kv_cache_usage": 0.0}) for t in range(6, 500)]) == []  # pinned: no recovery
    ctrl.pin(None, 500)
    assert [s.to_profile for s in feed(ctrl, [(t, {"kv_cache_usage": 0.0}) for t in range(501, 600)])] == ["normal"]
    ctrl.pin("normal", 600)
    assert feed(ctrl, [(t, {"kv_cache_usage": 1.0}) for t in range(601, 700)]) == [] and ctrl.active == "normal"
    with pytest.raises(ConfigError, match="choose one of normal, protect"):
        ctrl.pin("panic", 700)


def _write(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


GOOD = {"profiles": {"normal": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
                     "protect": {"max_num_seqs": 2, "max_num_batched_tokens": 256}}}


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["profiles"].pop("protect"), "needs both normal and protect (missing: protect)"),
    (lambda d: d["profiles"]["normal"].update(max_num_seq=4), "profiles.normal.max_num_seq: Extra inputs"),
    (lambda d: d["profiles"]["protect"].update(max_num_seqs=-1), "profiles.protect.max_num_seqs: Input should be greater than 0 (got -1)"),
    (lambda d: d["profiles"].update(panic={"max_num_seqs": 1, "max_num_batched_tokens": 1}), "profiles.panic"),
    (lambda d: d.update(triggers={"kv_cache_usage": {"above": 0.9, "for": 3}}), "triggers.kv_cache_usage.for"),
    (lambda d: d.update(triggers={"long_prompts_per_min": {"above": 3}}), "needs triggers.long_prompt_tokens"),
    (lambda d: d["profiles"]["protect"].update(restart={"block_size": 32}), "profiles.protect.restart.block_size"),
    (lambda d: d.update(d.pop("profiles")), "profiles: Field required (a top-level 'profiles:' mapping holds"),
])
def test_profiles_file_errors_name_the_key(tmp_path, change, fragment):
    data = json.loads(json.dumps(GOOD))
    change(data)
    with pytest.raises(ConfigError) as e:
        load_profiles(_write(tmp_path, data))
    assert fragment in str(e.value) and "p.yaml" in str(e.value)


def test_profiles_file_must_be_yaml_and_fit_the_engine(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_profiles(_write(tmp_path, "profiles: [unclosed"))
    with pytest.raises(ConfigError, match="not a file"):
        load_profiles(tmp_path / "missing.yaml")
    config = EngineArgs(model="tiny", kv_cache_memory="16MiB", max_model_len=1024, max_num_seqs=4,
                        max_num_batched_tokens=512).create_config()
    with pytest.raises(ConfigError, match=r"profiles.normal: max_num_seqs \(--max-num-seqs\): 8 is above the 4 the "
                                          r"engine started with.*restart with --max-num-seqs 8"):
        check_against_engine(load_profiles(_write(tmp_path, GOOD)), config)
    data = json.loads(json.dumps(GOOD))
    data["profiles"]["normal"]["max_num_seqs"] = 4
    data["profiles"]["protect"]["max_input_tokens"] = 1024
    with pytest.raises(ConfigError, match="profiles.protect.max_input_tokens .1024. must be below max_model_len"):
        check_against_engine(load_profiles(_write(tmp_path, data)), config)
    data["profiles"]["protect"].update(max_input_tokens=100, max_priority=0)
    with pytest.raises(ConfigError, match="profiles.protect.max_priority .*--scheduling-policy priority"):
        check_against_engine(load_profiles(_write(tmp_path, data)), config)


def test_protect_sheds_the_sheddable_class_under_priority_scheduling(tmp_path):
    """max_priority: while protect holds, requests less urgent than it get 503 with Retry-After; the default
    priority (0) and more urgent ones still enter; normal admits every priority."""
    data = {**json.loads(json.dumps(FLOOD)), "triggers": {}}
    data["profiles"]["protect"]["max_priority"] = 0
    with running_server(*ENGINE, "--scheduling-policy", "priority", "--profiles", str(_write(tmp_path, data))) \
            as (url, _):
        def ask(priority: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"prompt": "Hi", "max_tokens": 2, "priority": priority})

        assert ask(3).status_code == 200  # normal
        httpx.post(f"{url}/admin/profile", json={"profile": "protect"})
        shed = ask(1)
        assert shed.status_code == 503 and "Retry-After" in shed.headers
        assert "priority 1" in shed.json()["error"]["message"] and "max_priority" in shed.json()["error"]["message"]
        assert ask(0).status_code == 200 and ask(-2).status_code == 200
        assert metric_values(url)["pagedserve:rejected_requests_total"] == 1
        assert 'limit="max_priority"' in httpx.get(f"{url}/metrics").text


def test_serve_refuses_a_bad_profiles_file_before_loading_the_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", "--max-num-seqs", "4", "--profiles", str(_write(tmp_path, GOOD))])
    assert e.value.code == 2 and "--profiles: profiles.normal" in capsys.readouterr().err


def test_runtime_limits_are_checked_against_the_start_up_budget():
    from pagedserve import LLM

    core = LLM("tiny", kv_cache_memory="16MiB", max_num_seqs=8, max_num_batched_tokens=512).engine.core
    core.set_limits(4, 256)
    assert (core.scheduler.max_num_seqs, core.scheduler.max_num_batched_tokens) == (4, 256)
    with pytest.raises(ConfigError, match="above the 512 the engine started with"):
        core.set_limits(max_num_batched_tokens=1024)
    with pytest.raises(ConfigError, match="must be at least"):
        core.set_limits(8, 4)
    assert (core.scheduler.max_num_seqs, core.scheduler.max_num_batched_tokens) == (4, 256)


FLOOD = {
    "window_s": 2, "rate_window_s": 2, "tick_s": 0.2,
    "profiles": {"normal": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_input_tokens": 400},
                 "protect": {"max_num_seqs": 2, "max_num_batched_tokens": 256, "max_input_tokens": 100,
                             "max_num_queued_reqs": 64, "restart": {"kv_cache_dtype": "fp8"}}},
    "triggers": {"long_prompts_per_min": {"above": 60}, "long_prompt_tokens": 100},
    "recovery": {"min_dwell_s": 1, "hold_s": 1},
}


def _complete(url: str, prompt: list[int], max_tokens: int = 24, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "ignore_eos": True, "temperature": 0}, timeout=120, **kw)


def test_a_flood_of_long_prompts_switches_to_protect_and_back(tmp_path):
    path = _write(tmp_path, FLOOD)
    with running_server(*ENGINE, "--profiles", str(path)) as (url, app):
        status = httpx.get(f"{url}/admin/profile").json()
        assert status["active"] == "normal" and status["mode"] == "auto" and status["last_switch"] is None
        sched = app.state.engine.core.scheduler
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (8, 512)
        # a prompt over every profile's cap can never be served: 400, not 503
        err = _complete(url, [5] * 450)
        assert err.status_code == 400 and "never admits more than 400" in err.json()["error"]["message"]
        # the flood: 12 long prompts at once (over long_prompt_tokens=100: 6 in 2 s is 180 a minute)
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda i=i: results.append(_complete(url, [7 + i] * 200, 64)))
                   for i in range(12)]
        for t in threads:
            t.start()
        assert wait_until(lambda: httpx.get(f"{url}/admin/profile").json()["active"] == "protect", timeout=20)
        status = httpx.get(f"{url}/admin/profile").json()
        assert status["last_switch"]["to"] == "protect" and "long_prompts_per_min" in status["last_switch"]["reason"]
        assert status["limits"]["max_num_seqs"] == 2 and status["limits"]["max_input_tokens"] == 100
        assert status["restart_settings"] == {"kv_cache_dtype": "fp8"}
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2, 256)
        m = metric_values(url)  # what dashboards and diagnose see
        assert (m["pagedserve:max_num_seqs"], m["pagedserve:max_num_batched_tokens"]) == (2, 256)
        # over protect's cap but within normal's: 503 with Retry-After, naming the limit and the profile
        shed = _complete(url, [9] * 150)
        assert shed.status_code == 503 and int(shed.headers["retry-after"]) >= 1
        msg = shed.json()["error"]["message"]
        assert "max_input_tokens" in msg and "'protect'" in msg and "retry later" in msg
        assert _complete(url, [3] * 50, 4).status_code == 200  # short prompts still served
        for t in threads:
            t.join(timeout=120)
        # every request accepted completed in full; the flood's later arrivals were shed with Retry-After
        accepted = [r for r in results if r.status_code == 200]
        assert len(results) == 12 and accepted
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in accepted)
        assert all(r.status_code == 503 and r.headers["retry-after"] for r in results if r.status_code != 200)
        m = metric_values(url)
        assert m["pagedserve:profile_active"] in (0, 1) and m["pagedserve:long_prompts_total"] >= 13
        assert m["pagedserve:rejected_requests_total"] >= 1
        # the flood is over: back to normal after the dwell and the hold
        assert wait_until(lambda: httpx.get(f"{url}/admin/profile").json()["active"] == "normal", timeout=30)
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (8, 512)
        text = httpx.get(f"{url}/metrics").text
        assert 'pagedserve:profile_active{engine="0",model_name="tiny",profile="normal"} 1.0' in text
        assert 'pagedserve:profile_switches_total{engine="0",model_name="tiny",profile="protect"} 1.0' in text
        assert 'pagedserve:max_num_seqs{engine="0",model_name="tiny"} 8.0' in text  # normal's limits in force
        assert wait_until(lambda: app.state.engine.num_in_flight == 0)


def test_manual_switch_and_pin_behind_the_api_key(tmp_path):
    path = _write(tmp_path, {**FLOOD, "triggers": {}})
    with running_server(*ENGINE, "--profiles", str(path), "--api-key", "k") as (url, app):
        key = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/admin/profile").status_code == 401
        assert httpx.post(f"{url}/admin/profile", json={"profile": "protect"}).status_code == 401
        r = httpx.post(f"{url}/admin/profile", json={"profile": "protect"}, headers=key)
        assert r.status_code == 200 and r.json()["active"] == "protect" and r.json()["mode"] == "pinned"
        assert r.json()["last_switch"]["manual"] is True
        assert app.state.engine.core.scheduler.max_num_seqs == 2
        time.sleep(3)  # past the dwell and the hold: pinned, so it stays
        assert httpx.get(f"{url}/admin/profile", headers=key).json()["active"] == "protect"
        bad = httpx.post(f"{url}/admin/profile", json={"profile": "panic"}, headers=key)
        assert bad.status_code == 400 and "choose one of normal, protect, or auto" in bad.json()["error"]["message"]
        r = httpx.post(f"{url}/admin/profile", json={"profile": "auto"}, headers=key)
        assert r.json()["mode"] == "auto"
        assert wait_until(lambda: httpx.get(f"{url}/admin/profile", headers=key).json()["active"] == "normal", 20)
    with running_server(*ENGINE) as (url, _):
        r = httpx.get(f"{url}/admin/profile")
        assert r.status_code == 404 and "--profiles" in r.json()["error"]["message"]


def test_tune_writes_profiles_serve_accepts_and_a_runbook_with_the_measured_thresholds(tmp_path):
    main(["tune", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "512", "--concurrency", "1,2,4,8", "--prompts-per-rung", "8",
          "--random-input-len", "48", "--random-output-len", "12", "--slo", "ttft_p95=5000",
          "--result-dir", str(tmp_path), "--disable-tqdm"])
    for name in ("profiles.yaml", "RUNBOOK.md", "alerts.yaml", "plan.txt", "report.html", "sweep.json"):
        assert (tmp_path / name).is_file(), name
    doc = json.loads((tmp_path / "sweep.json").read_text())
    lad = doc["ladders"][0]
    knee, rungs = lad["knee"], lad["rungs"]
    rec = rungs[knee["recommendation"]]
    spec = load_profiles(tmp_path / "profiles.yaml")
    normal, protect = spec.profiles["normal"], spec.profiles["protect"]
    assert normal.max_num_seqs == rec["load"] and normal.max_num_batched_tokens == 512
    assert protect.max_num_seqs < normal.max_num_seqs or normal.max_num_seqs == 1
    assert protect.max_input_tokens == max(r["max_input_len"] for r in rungs)
    assert spec.triggers.ttft_p95_ms.above == 5000  # the SLO
    itl_expected = (rungs[knee["knee"]]["p95_itl_ms"] if knee["knee"] is not None else 2 * rec["p95_itl_ms"])
    assert spec.triggers.itl_p95_ms.above == round(itl_expected, 1)
    runbook = (tmp_path / "RUNBOOK.md").read_text()
    assert f"| {spec.triggers.itl_p95_ms.above:g} |" in runbook and "| 5000 |" in runbook
    assert f"--max-num-seqs {protect.max_num_seqs}" in runbook and "## The three failure situations" in runbook
    assert "--dataset-name lengths --dataset-path traffic.jsonl" in runbook  # re-tune on recorded traffic
    assert "--stream-interval 4" in runbook  # the host-bound case names its remedy
    assert protect.max_priority is None  # fcfs: no priorities to shed by; under the priority policy, 1 and up
    by_priority = EngineArgs(model="tiny", kv_cache_memory="16MiB", max_model_len=512, max_num_seqs=8,
                             max_num_batched_tokens=512, scheduling_policy="priority").create_config(serving=True)
    assert derive(doc, by_priority, model="tiny").spec.profiles["protect"].max_priority == 0
    alerts = yaml.safe_load((tmp_path / "alerts.yaml").read_text())
    exprs = {r["alert"]: r["expr"] for r in alerts["groups"][0]["rules"]}
    assert exprs["PagedserveTTFTHigh"].endswith("> 5") and "PagedserveProtectHeld" in exprs
    # serve accepts the profiles with the engine flags tune measured
    with running_server("--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "512", "--profiles", str(tmp_path / "profiles.yaml")) as (url, _):
        status = httpx.get(f"{url}/admin/profile").json()
        assert status["active"] == "normal" and status["limits"]["max_num_seqs"] == normal.max_num_seqs


def test_bench_quality_compares_caches_and_gives_a_verdict(tmp_path, capsys):
    from pagedserve.bench.quality import compare
    from pagedserve.outputs import Logprob

    def seq(ids, lps):
        return ids, [{t: Logprob(lp, 1)} for t, lp in zip(ids, lps)]

    figures = compare([seq([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0])], [seq([1, 2, 9, 9], [-1.1, -1.0, -1.3, -2.0])], 1)
    assert figures["agreement"] == 0.5 and figures["mean_first_divergence"] == 2 and figures["exact_match"] == 0
    assert figures["mean_abs_logprob_diff"] == pytest.approx(0.1 / 2)  # positions 0 and 1 share their context
    out = tmp_path / "q.json"
    with pytest.raises(SystemExit) as e:  # random weights: near-ties everywhere, fp8 flips them
        main(["bench", "quality", "tiny", "--kv-cache-memory", "16MiB", "--num-prompts", "4", "--max-tokens", "16",
              "--min-agreement", "1.0", "--output-json", str(out)])
    assert e.value.code == 1
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "fp8" and result["num_prompts"] == 4 and not result["passed"]
    assert 0 < abs(result["perplexity"] / result["reference_perplexity"] - 1) < 0.02  # fp8 moves it, a little
    assert "Verdict: FAIL" in capsys.readouterr().out
    main(["bench", "quality", "tiny", "--kv-cache-memory", "16MiB", "--num-prompts", "4", "--max-tokens", "16",
          "--kv-cache-dtype", "float32", "--reference-kv-cache-dtype", "auto", "--output-json", str(out)])
    same = json.loads(out.read_text())  # auto is float32 on the CPU: the same cache agrees exactly
    assert same["passed"] and same["agreement"] == 1.0 and same["mean_abs_logprob_diff"] == 0.0
    assert same["perplexity"] == same["reference_perplexity"] > 1.0
    for flag, bad in (("--min-agreement", "1.5"), ("--max-logprob-diff", "-0.1"), ("--max-perplexity-increase", "nan")):
        with pytest.raises(SystemExit) as e:  # a threshold no run can meet (or miss) is refused before a model loads
            main(["bench", "quality", "tiny", flag, bad])
        assert e.value.code == 2 and "--min-agreement must be in [0, 1]" in capsys.readouterr().err
