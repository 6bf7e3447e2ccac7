"""The staged load test: knee detection on synthetic ladders, exact server-side peaks, and `bench sweep`
end to end against real servers (ours, and an OpenAI-compatible one without /metrics)."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.bench.knee import KneeSettings, find_knee, gain_per_doubling, kneedle, parse_slo
from pagedserve.bench.sweep import SweepPlan, aggregate
from pagedserve.cli import main
from pagedserve.errors import ConfigError
from tests.serving import free_port, metric_values, running_server, wait_until

LOADS = [1, 2, 4, 8, 16, 32]


def ladder(throughput, ttft=None, itl=None, e2el=None, **series) -> list[dict]:
    """Rungs as ``bench serve`` reports them (only the fields the knee reads)."""
    n = len(throughput)
    rungs = []
    for i in range(n):
        r = {"completed": 100, "failed": 0, "output_throughput": throughput[i],
             "p95_ttft_ms": (ttft or [100.0] * n)[i], "p95_itl_ms": (itl or [5.0] * n)[i],
             "p95_e2el_ms": (e2el or [1000.0] * n)[i], "server_preemptions": 0, "server_peak_kv_cache_usage": 0.1}
        for key, values in series.items():
            r[key] = values[i]
        rungs.append(r)
    return rungs


def test_knee_where_throughput_stops_growing():
    res = find_knee(ladder([100, 195, 380, 700, 1000, 1040]), LOADS, KneeSettings())
    assert res.knee == 5 and res.knee_load == 32
    assert [s.name for s in res.signals if s.enabled] == ["throughput"]
    assert "+4.0 % per doubling" in res.reason and "below 10 %" in res.reason
    assert res.recommendation == 4 and res.recommended_load == 16  # the rung left of the knee
    assert "concurrency 16" in res.recommendation_reason and "1,000 output tok/s" in res.recommendation_reason


def test_no_knee_suggests_the_next_ladder():
    res = find_knee(ladder([100, 200, 400, 800, 1600, 3200]), LOADS, KneeSettings())
    assert res.knee is None and res.recommendation == 5
    assert res.next_loads == [32, 64, 128, 256]
    assert "No knee up to concurrency 32" in res.reason and "--concurrency 32,64,128,256" in res.reason
    assert "grew 100 % per doubling" in res.reason


def test_noise_below_the_threshold_does_not_place_a_knee_early():
    # a dip of a few percent in the middle is still a gain per doubling far above 10 %
    res = find_knee(ladder([100, 190, 410, 760, 1420, 1480]), LOADS, KneeSettings())
    assert res.knee == 5


def test_a_flat_step_that_later_rungs_climb_out_of_is_not_a_knee():
    # two cores serving a tiny model: 1 -> 2 flat, then +83 % at 4; the throughput stops for good only at 16
    res = find_knee(ladder([438, 435, 797, 995, 950, 607]), LOADS, KneeSettings())
    assert [s.rung for s in res.signals if s.name == "throughput"] == [4, 5]
    assert res.knee == 4 and res.recommendation == 3
    assert "995 -> 950 tok/s" in res.reason
    # a step that never recovers still places it: 1,000 -> 1,040 -> 1,090 is +4 % and then +4.4 % per doubling
    assert find_knee(ladder([250, 500, 1000, 1040, 1090, 1100]), LOADS, KneeSettings()).knee == 3


def test_knee_from_preemption_from_kv_usage_and_from_failures():
    pre = find_knee(ladder([100, 200, 400, 800, 1600, 3200], server_preemptions=[0, 0, 0, 5, 50, 90]), LOADS,
                    KneeSettings())
    assert pre.knee == 3 and pre.recommendation == 2 and "5 preemptions" in pre.reason
    kv = find_knee(ladder([100, 200, 400, 800, 1600, 3200],
                          server_peak_kv_cache_usage=[0.1, 0.2, 0.4, 0.8, 0.95, 1.0]), LOADS, KneeSettings())
    assert kv.knee == 4 and "95.0 %" in kv.reason
    fail = find_knee(ladder([100, 200, 400, 800, 1600, 3200], failed=[0, 0, 0, 0, 3, 9]), LOADS, KneeSettings())
    assert fail.knee == 4 and "3 of 103 requests failed" in fail.reason
    lenient = find_knee(ladder([100, 200, 400, 800, 1600, 3200], failed=[0, 0, 0, 0, 3, 9]), LOADS,
                        KneeSettings(max_failure_rate=0.05))
    assert lenient.knee == 5


def test_knee_from_latency_against_the_lowest_rung_unless_an_slo_says_otherwise():
    rungs = ladder([100, 200, 400, 800, 1600, 3200], itl=[5, 5, 5.5, 6, 16, 30])
    res = find_knee(rungs, LOADS, KneeSettings())
    assert res.knee == 4 and "p95 ITL 16.0 ms at concurrency 16 is 3.2x the 5.0 ms at concurrency 1" in res.reason
    # with an ITL SLO the user has said what is acceptable: the factor no longer applies to ITL
    slo = KneeSettings(slo=parse_slo(["itl_p95=20"]))
    res = find_knee(rungs, LOADS, slo)
    assert res.knee == 5 and "itl_p95 30.0 ms > 20 ms" in res.reason
    assert res.recommendation == 4


def test_knee_from_a_broken_slo_and_the_recommendation_meets_every_slo():
    rungs = ladder([100, 200, 400, 800, 1600, 3200], ttft=[50, 60, 80, 150, 300, 900])
    res = find_knee(rungs, LOADS, KneeSettings(latency_factor=100, slo={"ttft_p95": 200.0}))
    assert res.knee == 4 and res.recommendation == 3


def test_a_knee_at_the_lowest_rung_recommends_nothing():
    res = find_knee(ladder([100, 200, 400], ttft=[900, 950, 1000]), [1, 2, 4], KneeSettings(slo={"ttft_p95": 500.0}))
    assert res.knee == 0 and res.recommendation is None
    assert "Nothing to recommend" in res.recommendation_reason


def test_kneedle_is_reported_but_places_the_knee_only_when_enabled():
    rungs = ladder([100, 400, 800, 900, 950, 980])
    res = find_knee(rungs, LOADS, KneeSettings(min_gain=0.0))
    assert res.kneedle == 2 and res.knee is None
    assert any(s.name == "kneedle" and not s.enabled for s in res.signals)
    res = find_knee(rungs, LOADS, KneeSettings(min_gain=0.0, signals=("kneedle",)))
    assert res.knee == 2
    assert kneedle([1, 2, 4, 8], [1, 2, 3, 4]) is None  # a straight line over log2(load) has no bend


def test_a_host_bound_knee_says_so():
    """The engine waited on the GPU less and less: at the knee the GPU idles between steps, and the reason
    names the host; the host signal alone places no knee."""
    rungs = ladder([100, 195, 380, 700, 1000, 1040], server_device_wait_share=[0.9, 0.85, 0.7, 0.4, 0.12, 0.03])
    res = find_knee(rungs, LOADS, KneeSettings())
    assert res.knee == 5 and "waited on the GPU 3 % of the time" in res.reason and "(the engine" in res.reason
    assert "--stream-interval 4" in res.reason  # the reason says what to change
    assert [s.rung for s in res.signals if s.name == "host"] == [5] and not res.signals[-1].enabled
    flat = ladder([100, 200, 400, 800, 1600, 3200], server_device_wait_share=[0.05] * 6)
    assert find_knee(flat, LOADS, KneeSettings()).knee is None


def test_gain_per_doubling_scales_uneven_ladders():
    assert gain_per_doubling(100, 200, 1, 2) == pytest.approx(1.0)
    assert gain_per_doubling(100, 400, 1, 4) == pytest.approx(1.0)  # x4 over two doublings: x2 per doubling
    assert gain_per_doubling(100, 150, 4, 6) == pytest.approx(1.5 ** (1 / 0.5849625) - 1)


def test_settings_and_plan_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--slo 'latency=5'"):
        parse_slo(["latency=5"])
    with pytest.raises(ConfigError, match="positive"):
        parse_slo(["ttft_p95=-1"])
    assert parse_slo(["ttft_median=100", "e2el_p99=5000"]) == {"ttft_p50": 100.0, "e2el_p99": 5000.0}
    with pytest.raises(ConfigError, match="--knee-signals"):
        KneeSettings(signals=("vibes",))
    with pytest.raises(ConfigError, match="lowest first"):
        SweepPlan("concurrency", [4, 2])
    with pytest.raises(ConfigError, match="whole numbers"):
        SweepPlan("concurrency", [1, 2.5])
    plan = SweepPlan("concurrency", [1, 8, 64])
    assert [plan.prompts(x) for x in plan.loads] == [16, 32, 256]
    assert [SweepPlan("rate", [0.5, 8]).prompts(x) for x in (0.5, 8)] == [16, 80]


def test_the_share_of_a_run_the_engine_waited_on_the_gpu_comes_from_its_counter():
    from pagedserve.bench.serve import MetricsScraper, SCRAPED
    from pagedserve.bench.metrics import scrape

    scraper = MetricsScraper("http://unused", 1.0, {})
    for t, waited in ((10.0, 2.0), (12.0, 2.5), (14.0, 3.0)):
        text = f'pagedserve:device_wait_seconds_total{{engine="0",model_name="m"}} {waited}\n'
        scraper.samples.append({"t": t, **scrape(text, SCRAPED)[0]})
    assert scraper.summary()["server_device_wait_share"] == pytest.approx(0.25)  # 1 s of 4
    scraper.samples = [{"t": 1.0}, {"t": 2.0}]  # a CPU server, or vLLM: no counter, no figure
    assert scraper.summary()["server_device_wait_share"] is None


def test_the_engine_step_intervals_of_a_run_come_from_its_histogram():
    from pagedserve.bench.metrics import histogram_quantile, scrape
    from pagedserve.bench.serve import MetricsScraper

    def text(counts: list[int]) -> str:  # cumulative counts at 4, 8, 16 ms and past them
        bounds = ("0.004", "0.008", "0.016", "+Inf")
        return "".join(f'pagedserve:step_interval_seconds_bucket{{engine="0",le="{b}",model_name="m"}} {n}\n'
                       for b, n in zip(bounds, counts))

    name = "pagedserve:step_interval_seconds"
    before, after = scrape(text([5, 5, 5, 5]), {}, name)[1], scrape(text([5, 85, 105, 105]), {}, name)[1]
    # the run's 100 intervals: 80 in (4, 8] ms, 20 in (8, 16] ms
    assert histogram_quantile(before, after, 0.5) == pytest.approx(0.004 + 0.004 * 50 / 80)
    assert histogram_quantile(before, after, 0.99) == pytest.approx(0.008 + 0.008 * 19 / 20)
    assert histogram_quantile(after, after, 0.5) is None  # nothing counted between the two
    scraper = MetricsScraper("http://unused", 1.0, {})
    scraper.samples = [{"t": 1.0, "step_intervals": before}, {"t": 2.0, "step_intervals": after}]
    summary = scraper.summary()
    assert summary["server_step_interval_p50_ms"] == pytest.approx(6.5)
    assert summary["server_step_interval_p99_ms"] == pytest.approx(15.6)


def test_a_server_with_exact_peaks_is_polled_rarely():
    """Each /metrics render holds the server's event loop; a server that keeps exact peaks needs no
    frequent poll, one without (vLLM) gets the frequent one its sampled peaks need."""
    from pagedserve.bench.serve import MetricsScraper

    async def polls(exact: bool) -> int:
        scraper = MetricsScraper("http://unused", 0.02, {})
        scraper.exact_peaks, count = exact, []

        async def scrape():
            count.append(1)

        scraper.scrape = scrape
        stop = asyncio.Event()
        task = asyncio.create_task(scraper.run(stop))
        await asyncio.sleep(0.3)
        stop.set()
        await task
        return len(count)

    assert asyncio.run(polls(True)) == 1  # the next would come EXACT_PEAKS_INTERVAL later
    assert asyncio.run(polls(False)) >= 5
    assert MetricsScraper.EXACT_PEAKS_INTERVAL >= 1.0


def test_repeats_aggregate_counts_peaks_and_medians():
    reps = [{"completed": 10, "failed": 1, "output_throughput": 100.0, "server_peak_kv_cache_usage": 0.2,
             "server_preemptions": 0, "server_peaks_exact": True},
            {"completed": 10, "failed": 0, "output_throughput": 140.0, "server_peak_kv_cache_usage": 0.5,
             "server_preemptions": 2, "server_peaks_exact": True},
            {"completed": 10, "failed": 0, "output_throughput": 120.0, "server_peak_kv_cache_usage": None,
             "server_preemptions": 1, "server_peaks_exact": True}]
    out = aggregate(reps)
    assert out["completed"] == 30 and out["failed"] == 1 and out["server_preemptions"] == 3
    assert out["output_throughput"] == 120.0
    assert out["server_peak_kv_cache_usage"] == 0.2  # a repeat without the value: the first one's, not a guess
    assert out["server_peaks_exact"] is True


def test_server_peaks_are_exact_and_reset_by_the_admin_call():
    """With more requests in flight than --max-num-seqs, the scraped peak running equals max_num_seqs and
    requests are seen waiting: peaks kept by the server per step, not sampled by a poll."""
    from pagedserve.bench.serve import BenchConfig, run_benchmark
    from pagedserve.bench.datasets import random_dataset

    with running_server("--kv-cache-memory", "16MiB", "--max-model-len", "2048", "--max-num-seqs", "4") as (url, app):
        cfg = BenchConfig(base_url=url, endpoint="/v1/completions", model="tiny", max_concurrency=12,
                          ignore_eos=True, num_warmups=0, show_progress=False, scrape_interval=30.0)
        samples = random_dataset(24, input_len=32, output_len=24, seed=3)
        result = asyncio.run(run_benchmark(cfg, samples, [95], ["ttft"], {}))
        assert result["completed"] == 24 and result["server_peaks_exact"] is True
        assert result["server_peak_num_requests_running"] == 4
        assert result["server_peak_num_requests_waiting"] >= 1
        assert 0 < result["server_peak_kv_cache_usage"] <= 1
        assert result["server_peak_device_memory_bytes"] > 0 and result["server_preemptions"] == 0
        assert result["server_metrics_scrape_failures"] == 0
        # a new window starts from the idle server's values
        ended = httpx.post(f"{url}/admin/reset_peaks").json()["ended"]
        assert ended["num_running"] == 4
        m = metric_values(url)
        assert m["pagedserve:num_requests_running_peak"] == 0 and m["pagedserve:kv_cache_usage_peak_perc"] == 0
        assert m["pagedserve:peaks_reset_timestamp_seconds"] == pytest.approx(time.time(), abs=30)
        # the prefix cache resets when idle, and refuses while a request holds blocks
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2000,
                                                                     "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()  # held: a dropped iterator closes the stream, which aborts the request
                next(lines)
                busy = httpx.post(f"{url}/reset_prefix_cache")
                assert busy.status_code == 409 and "hold KV blocks" in busy.json()["error"]["message"]
        engine = app.state.engine
        assert wait_until(lambda: engine.num_in_flight == 0)


def test_admin_routes_need_the_api_key():
    with running_server("--kv-cache-memory", "16MiB", "--api-key", "k3y") as (url, _):
        assert httpx.post(f"{url}/admin/reset_peaks").status_code == 401
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401
        assert httpx.post(f"{url}/admin/reset_peaks", headers={"Authorization": "Bearer k3y"}).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200  # scrapers carry no key


def _fake_openai_server(metrics_status: int | None):
    """A minimal OpenAI-compatible streaming server: fixed tokens, optionally a /metrics that fails."""
    import uvicorn

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}) + "\n\n"
            usage = {"prompt_tokens": 8, "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    if metrics_status is not None:
        @app.get("/metrics")
        async def metrics():
            return Response("boom", status_code=metrics_status)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    return server, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("metrics_status", [None, 500])
def test_sweep_against_a_server_without_metrics_reports_na(tmp_path, metrics_status):
    server, url = _fake_openai_server(metrics_status)
    try:
        main(["bench", "sweep", "--base-url", url, "--concurrency", "1,2", "--prompts-per-rung", "4",
              "--random-input-len", "8", "--random-output-len", "4", "--result-dir", str(tmp_path), "--disable-tqdm"])
    finally:
        server.should_exit = True
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["model_id"] == "fake" and doc["target"] == {"base_url": url}
    rung = doc["ladders"][0]["rungs"][1]
    assert rung["completed"] == 4 and rung["prefix_cache"] == "unsupported"
    for key in ("server_preemptions", "server_peak_kv_cache_usage", "server_peak_num_requests_running",
                "server_peak_device_memory_bytes"):
        assert rung[key] is None, key
    assert rung["server_metrics_scrapes"] == 0 and rung["server_metrics_scrape_failures"] >= 2
    md = (tmp_path / "summary.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert row.count("n/a") >= 4 and "| 0 |" not in row
    csv_row = (tmp_path / "sweep.csv").read_text().splitlines()[2].split(",")
    assert csv_row[0] == "server" and "" in csv_row  # empty, not 0, where nothing was read


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_sweep_end_to_end_on_the_tiny_model_writes_every_artefact(tmp_path):
    main(["bench", "sweep", "--model", "tiny", "--serve-args", "--kv-cache-memory 16MiB --max-model-len 512 "
          "--max-num-seqs 4", "--concurrency", "1,2,4,8", "--prompts-per-rung", "8", "--random-input-len", "32",
          "--random-output-len", "16", "--slo", "e2el_p95=60000", "--result-dir", str(tmp_path), "--disable-tqdm"])
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["loads"] == [1, 2, 4, 8] and doc["slo"] == {"e2el_p95": 60000.0}
    assert doc["target"]["command"][:3] == ["pagedserve", "serve", "tiny"]
    lad = doc["ladders"][0]
    assert lad["server_exit_code"] == 0 and (tmp_path / lad["server_log"]).is_file()
    rungs = lad["rungs"]
    assert [r["load"] for r in rungs] == [1, 2, 4, 8] and all(r["completed"] == 8 for r in rungs)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "p50_ttft_ms", "p95_ttft_ms",
                "p99_ttft_ms", "p95_tpot_ms", "p95_itl_ms", "p95_e2el_ms", "mean_e2el_ms", "request_goodput"):
        assert all(r[key] is not None for r in rungs), key
    # the server's own peaks: four requests in flight at most, since --max-num-seqs 4
    assert [r["server_peak_num_requests_running"] for r in rungs] == [1, 2, 4, 4]
    assert rungs[3]["server_peak_num_requests_waiting"] >= 1 and all(r["server_peaks_exact"] for r in rungs)
    assert all(r["prefix_cache"] == "reset" and r["server_prefix_cache_hit_rate"] == 0 for r in rungs)
    knee = lad["knee"]
    assert doc["recommendation"]["concurrency"] == knee["recommended_load"] is not None
    assert knee["recommended_load"] < (knee["knee_load"] or float("inf"))
    files = {p.name for p in tmp_path.iterdir()}
    assert {"sweep.json", "sweep.csv", "summary.md", "throughput.png", "latency.png", "memory.png",
            "report.html", "server.log"} <= files
    for name in ("throughput.png", "latency.png", "memory.png"):
        w, h = _png_size(tmp_path / name)
        assert w > 800 and h > 300
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "Recommendation" in html
    assert knee["reason"].split(":")[0] in html and f">{rungs[2]['output_throughput']:,.0f}<" in html
    md = (tmp_path / "summary.md").read_text()
    assert "**recommended**" in md and md.count("\n| ") >= 5
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 5


def test_a_replay_ladder_speeds_up_recorded_traffic(tmp_path):
    """--replay-speeds: each rung sends the recording's requests at its arrival times divided by the speed;
    the knee and recommendation are read in multiples of the recorded traffic."""
    rec = tmp_path / "traffic.jsonl"
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "512", "--record-lengths", str(rec))
    with running_server(*flags) as (url, _):
        for n in range(10):
            httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": list(range(5, 25 + 3 * n)),
                                                                  "max_tokens": 4 + n, "ignore_eos": True})
            time.sleep(0.02)
        recorded = tmp_path / "recorded.jsonl"  # the sweep's own requests are recorded too: replay a copy
        recorded.write_text(rec.read_text())
        main(["bench", "sweep", "--base-url", url, "--dataset-name", "lengths", "--dataset-path", str(recorded),
              "--replay-speeds", "1,4", "--disable-tqdm", "--result-dir", str(tmp_path / "sweep")])
    doc = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    slow, fast = doc["ladders"][0]["rungs"]
    assert doc["mode"] == "replay" and doc["unit"] == "replay speed" and doc["loads"] == [1, 4]
    assert slow["completed"] == fast["completed"] == 10 and slow["total_output_tokens"] == sum(range(4, 14))
    assert fast["request_rate"] == pytest.approx(4 * slow["request_rate"])  # the same requests, 4x as fast
    assert "replay speed" in (tmp_path / "sweep" / "summary.md").read_text()


def test_sweep_command_line_errors(tmp_path, capsys):
    def err(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            main(["bench", "sweep", *argv, "--result-dir", str(tmp_path)])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "not several" in err("--model", "tiny", "--concurrency", "1,2", "--request-rates", "1,2")
    assert "--dataset-name lengths" in err("--model", "tiny", "--replay-speeds", "1,2")
    with pytest.raises(SystemExit):  # tune needs a concurrency ladder, and says so before starting a server
        main(["tune", "tiny", "--request-rates", "1,2", "--result-dir", str(tmp_path / "t")])
    assert "use --concurrency, not --request-rates" in capsys.readouterr().err
    assert "--grid" in err("--base-url", "http://127.0.0.1:9", "--grid", "max_num_seqs=1,2")
    assert "--base-url" in err()
    assert "--slo" in err("--model", "tiny", "--slo", "speed=fast")
    assert "--grid 'max_num_seqs'" in err("--model", "tiny", "--grid", "max_num_seqs")
    assert "list each value once" in err("--model", "tiny", "--grid", "max_num_seqs=4,8,4")
    assert "--port" in err("--model", "tiny", "--serve-args", "--port 9000")
    assert "--concurrency" in err("--model", "tiny", "--concurrency", "1,x")
    assert "not a valid `pagedserve serve` command line" in err("--model", "tiny", "--serve-args", "--max-num-sequences 4")
    assert "--grid max_num_seqs=x: `pagedserve serve tiny --max-num-seqs x` is not a valid" in \
        err("--model", "tiny", "--grid", "max_num_seqs=4,x")
    assert "--grid nope=1: `pagedserve serve tiny --nope 1`" in err("--model", "tiny", "--grid", "nope=1,2")


def test_a_rung_served_from_the_prefix_cache_says_so():
    from pagedserve.bench.report import table_rows
    from pagedserve.bench.sweep import progress_line

    rung = {"load": 4, "completed": 16, "failed": 0, "duration": 2.0, "request_throughput": 8.0,
            "output_throughput": 900.0, "total_token_throughput": 1800.0, "p95_ttft_ms": 50.0, "p95_itl_ms": 5.0,
            "p95_e2el_ms": 800.0}
    cached = {**rung, "server_prefix_cache_hit_rate": 0.25}
    lad = {"rungs": [rung, cached], "knee": {"knee": None, "recommendation": 0, "signals": []}}
    notes = [row[-1] for row in table_rows({}, lad)]
    assert notes == ["**recommended**", "prefix cache 25 %"]
    assert "prefix cache" not in progress_line(0, 2, "concurrency", 4, rung)
    assert progress_line(1, 2, "concurrency", 4, cached).endswith("| prefix cache 25 % of prompt tokens")
