"""No input freezes or crashes the server, and no fault loses a request without a word: hostile and careless
requests, a fuzz over the request schemas, injected faults (a failing step, a failing output, a dead engine,
the shutdown deadline), a bounded soak with disconnects, and a 10x overload."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import aiohttp
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.async_engine import MAX_FAILED_STEPS, _Outputs
from tests.serving import metric_values, running_server, serve_process, wait_until

ENGINE = ("--kv-cache-memory", "16MiB", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def server():
    with running_server(*ENGINE, "--max-num-queued-reqs", "64") as (url, app):
        yield url, app


def post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = kw.pop("headers", {"content-type": "application/json"})
    return httpx.post(url + path, content=content, headers=headers, timeout=30, **kw)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status and body["message"]
    return body


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@pytest.mark.parametrize("path, body, status, fragment", [
    (CMPL, '{"prompt": "\\ud800abc", "max_tokens": 2}', 400, "not valid Unicode"),
    ("/tokenize", '{"prompt": "\\ud800abc"}', 400, "not valid Unicode"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}', 400, "not valid Unicode"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}, 400, "text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "Only text content parts"),
    (CMPL, '{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    (CMPL, '{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": 1e30}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "seed": 10**30}, 400, "seed"),
    (CMPL, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": 1}, 400, "stream"),
    (CMPL, {"prompt": [1, True, 3]}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "n": 1.5}, 400, "n"),
    (CMPL, {"prompt": ["hi"] * 65, "max_tokens": 1}, 400, "never admits more than 64"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}},
     400, "--trust-request-chat-template"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for i in range(9) %}{% endfor %}"},
     400, "--trust-request-chat-template"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "add_generation_prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format must be"),
    (CMPL, {"prompt": "hi", "guided_choice": ["a", "b"], "guided_regex": "[a-z]"}, 400, "one structured output"),
    (CMPL, {"prompt": "hi", "guided_regex": "([a-z"}, 400, "could not be compiled"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "wrong type"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "--enable-auto-tool-choice"),
    # fields that would change the question, which this server does not do: refused, not ignored
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "best_of": 1, "n": 2}, 400, "best_of must equal n"),
    (CMPL, {"prompt": "hi", "suffix": " and so on"}, 400, "suffix"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400, "send tools"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, 400, "Beam search"),
])
def test_bad_input_is_a_clear_4xx(server, path, body, status, fragment):
    assert fragment in error(post(server[0], path, body), status)["message"]


def test_content_type_routes_and_methods_answer_in_the_api_shape(server):
    url = server[0]
    msg = error(post(url, CMPL, "hello", headers={"content-type": "text/plain"}), 400)["message"]
    assert "Content-Type: application/json" in msg and "text/plain" in msg
    assert error(httpx.get(f"{url}/v1/nothing"), 404)["type"] == "NotFoundError"
    assert error(httpx.get(f"{url}{CMPL}"), 405)["type"] == "MethodNotAllowedError"


def test_unknown_fields_are_accepted_and_named_in_a_warning(server, caplog):
    r = post(server[0], CMPL, {"prompt": "hi", "max_tokens": 2, "frobnicate": 3, "user": "u1"})
    assert r.status_code == 200
    assert "ignored: ['frobnicate', 'user']" in caplog.text
    plain = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": {"type": "text"},
             "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert post(server[0], CHAT, plain).status_code == 200  # asks for nothing this server cannot do


def test_huge_bodies_are_refused_at_once_and_the_server_stays_responsive(server):
    url = server[0]
    started = time.monotonic()
    big = json.dumps({"prompt": "lorem ipsum " * 200_000})  # 2.4 MB of text: far beyond the context
    msg = error(post(url, CMPL, big), 400)["message"]
    assert "more tokens than this model's maximum context of 1024" in msg
    assert error(post(url, "/tokenize", big.replace("prompt", "prompt")), 400)
    assert time.monotonic() - started < 5  # refused without tokenizing it
    # over the body limit: 413 before the body is read, announced or streamed
    limit = server[1].state.server.settings.max_request_body_bytes
    r = httpx.post(f"{url}{CMPL}", content=b"x" * (limit + 1), headers={"content-type": "application/json"})
    assert error(r, 413)["type"] == "RequestTooLargeError"

    def chunks():
        for _ in range((limit // 2**20) + 2):
            yield b" " * 2**20

    assert error(httpx.post(f"{url}{CMPL}", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert httpx.get(f"{url}/health", timeout=2).status_code == 200


def test_tokenizing_does_not_hold_up_the_event_loop(server):
    """A long (but legal) prompt is tokenized off the loop: /health answers meanwhile."""
    url = server[0]
    results = []
    text = "word " * 900
    threads = [threading.Thread(target=lambda: results.append(post(url, "/tokenize", {"prompt": text})))
               for _ in range(6)]
    for t in threads:
        t.start()
    health = [httpx.get(f"{url}/health", timeout=5).status_code for _ in range(5)]
    for t in threads:
        t.join()
    assert health == [200] * 5 and all(r.status_code == 200 for r in results)


def test_a_request_chat_template_is_rendered_only_when_the_server_trusts_them(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    with running_server(*ENGINE, "--chat-template", str(template), "--trust-request-chat-template") as (url, _):
        toks = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hello"}]}).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": toks}).json()["prompt"]
        assert text == "[user] hello\n"  # the server's --chat-template, not the tokenizer's ChatML
        r = post(url, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                             "chat_template": "{{ messages[0]['content'] }}!"})
        assert r.status_code == 200
    with pytest.raises(SystemExit):
        from pagedserve.cli import main

        main(["serve", "tiny", "--chat-template", "{% for %}"])


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                       | st.text(max_size=20), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                                max_size=4), max_leaves=8)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
          "stream", "stream_options", "logprobs", "ignore_eos", "min_tokens", "messages", "model", "echo",
          "top_logprobs", "chat_template_kwargs", "max_completion_tokens", "add_generation_prompt",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format",
          "guided_choice", "guided_regex", "structured_outputs", "tools", "tool_choice", "input", "instructions",
          "max_output_tokens", "text", "priority", "cache_salt", "best_of", "suffix"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CMPL, CHAT, "/v1/responses", "/tokenize", "/detokenize"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=6))
def test_fuzzed_bodies_never_get_a_5xx_or_stall(server, path, body):
    url = server[0]
    if path in (CMPL, CHAT, "/v1/responses"):
        for cap in ("max_tokens", "max_output_tokens"):
            body.setdefault(cap, 2)
            if isinstance(body.get(cap), int) and body[cap] > 8:
                body[cap] = 8  # keep each accepted request short
    started = time.monotonic()
    r = post(url, path, body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert time.monotonic() - started < 20


def _stream(url: str, prompt, max_tokens: int) -> tuple[list[dict], str]:
    """(the data frames, the last line) of one streamed completion."""
    frames, last = [], ""
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}{CMPL}", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                                         "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    frames.append(json.loads(line[6:]))
                if line:
                    last = line
    return frames, last


def test_a_failing_step_fails_its_requests_alone(server):
    url, app = server
    engine = app.state.engine
    worker = engine.core.worker
    original = worker.execute
    doomed = [7, 7, 7, 7, 7, 99]

    def execute(inp, sampling):  # a step holding the doomed prompt (its token 99) raises, once
        if 99 in inp.ids and not execute.fired:
            execute.fired = True
            raise RuntimeError("injected step failure")
        return original(inp, sampling)

    execute.fired = False
    worker.execute = execute
    try:
        good = threading.Thread(target=lambda: results.append(_stream(url, [5, 6, 7], 300)))
        results: list = []
        good.start()
        time.sleep(0.3)
        frames, last = _stream(url, doomed, 50)
        good.join()
    finally:
        worker.execute = original
    assert execute.fired and last == "data: [DONE]"
    assert frames[-1]["error"]["message"] == "RuntimeError: injected step failure"
    assert frames[-1]["error"]["code"] == 500
    good_frames, good_last = results[0]
    # the other stream was in the same step only if the scheduler put it there; either way it ends cleanly
    assert good_last == "data: [DONE]"
    assert "error" in good_frames[-1] or good_frames[-1]["choices"][0]["finish_reason"] == "length"
    r = post(url, CMPL, {"prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True})  # random weights may end it
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5  # the engine lives on
    assert wait_until(lambda: engine.num_in_flight == 0 and engine.core.pool.num_free_blocks == engine.core.pool.num_blocks)
    assert metric_values(url)["vllm:request_success_total{error}"] >= 1


def test_a_failing_output_fails_that_request_alone(server):
    url, app = server
    engine = app.state.engine
    outputs = engine.outputs
    original = outputs._append_token

    def append(st, out, now):
        if st.request.prompt_token_ids == [11, 12, 13] and len(st.token_ids) == 3:
            raise ValueError("injected detokenizer failure")
        return original(st, out, now)

    outputs._append_token = append
    try:
        bad = post(url, CMPL, {"prompt": [11, 12, 13], "max_tokens": 40, "ignore_eos": True})
        frames, last = _stream(url, [11, 12, 13], 40)
        ok = post(url, CMPL, {"prompt": [21, 22], "max_tokens": 40, "ignore_eos": True})
    finally:
        outputs._append_token = original
    assert error(bad, 500)["message"] == "ValueError: injected detokenizer failure"
    assert "injected detokenizer failure" in frames[-1]["error"]["message"] and last == "data: [DONE]"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
    assert wait_until(lambda: engine.num_in_flight == 0 and not engine.core.has_unfinished)


def test_a_dead_engine_fails_everything_and_stops_the_server_with_status_1():
    with running_server(*ENGINE) as (url, app):
        engine, server = app.state.engine, app.state.uvicorn

        def broken(inp, sampling):
            raise RuntimeError("device lost")

        engine.core.worker.execute = broken
        # one failed step fails its request alone; consecutive failures mean the device is gone
        statuses = [post(url, CMPL, {"prompt": [1, 2], "max_tokens": 4}) for _ in range(MAX_FAILED_STEPS)]
        assert [r.status_code for r in statuses] == [500] * (MAX_FAILED_STEPS - 1) + [503]
        assert "device lost" in statuses[-1].json()["error"]["message"] and engine.dead is not None
        assert wait_until(lambda: server.should_exit, timeout=10) and server.exit_code == 1


def test_the_shutdown_deadline_ends_streams_with_an_error_frame_and_exit_status_1():
    # 2,000 tokens take the tiny model seconds on a CPU: far past a half-second deadline
    with serve_process(*ENGINE, "--max-model-len", "2048", "--shutdown-timeout", "0.5") as (proc, url):
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}{CMPL}", json={"prompt": "Hello", "max_tokens": 2000, "stream": True,
                                                            "ignore_eos": True}) as resp:
                it = resp.iter_lines()
                next(it)
                proc.send_signal(signal.SIGTERM)
                lines = [line for line in it if line]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == 503 and "--shutdown-timeout" in err["message"]
        assert proc.wait(timeout=60) == 1


def test_a_bounded_soak_with_disconnects_and_aborts_leaves_nothing_behind(server):
    """300 requests at concurrency 32; every tenth stream is cut mid-way by its client, every tenth
    non-streaming request times out on the client side."""
    url, app = server
    engine = app.state.engine

    async def one(session: aiohttp.ClientSession, i: int) -> str:
        body = {"prompt": [3 + i % 50] * (5 + i % 40), "max_tokens": 8 + i % 24, "ignore_eos": True}
        try:
            if i % 2:
                async with session.post(f"{url}{CMPL}", json={**body, "stream": True}) as r:
                    n = 0
                    async for line in r.content:
                        n += line.startswith(b"data: {")
                        if i % 10 == 1 and n == 3:
                            return "cut"
                    return str(r.status)
            timeout = aiohttp.ClientTimeout(total=0.05 if i % 10 == 0 else 60)
            async with session.post(f"{url}{CMPL}", json=body, timeout=timeout) as r:
                await r.read()
                return str(r.status)
        except asyncio.TimeoutError:
            return "timeout"

    async def main():
        sem = asyncio.Semaphore(32)
        async with aiohttp.ClientSession() as session:
            async def bounded(i):
                async with sem:
                    return await one(session, i)
            return await asyncio.gather(*(bounded(i) for i in range(300)))

    outcomes = asyncio.run(main())
    assert not [o for o in outcomes if o.startswith("5")], outcomes
    assert outcomes.count("200") >= 240
    pool = engine.core.pool
    assert wait_until(lambda: engine.num_in_flight == 0 and not engine.core.has_unfinished
                      and pool.num_free_blocks == pool.num_blocks, timeout=30)
    m = metric_values(url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["pagedserve:num_requests_in_flight"] == 0 and engine.queued_prompt_tokens == 0


def test_ten_times_the_capacity_is_shed_with_503_and_recovers_at_once():
    with running_server(*ENGINE, "--max-num-seqs", "8", "--max-num-queued-reqs", "8") as (url, app):
        async def main():
            async with aiohttp.ClientSession() as session:
                async def one(i):
                    t0 = time.monotonic()
                    async with session.post(f"{url}{CMPL}", json={"prompt": [5 + i % 7] * 16, "max_tokens": 32,
                                                                   "ignore_eos": True}) as r:
                        body = await r.json()
                        return r.status, r.headers.get("retry-after"), time.monotonic() - t0, body
                return await asyncio.gather(*(one(i) for i in range(80)))

        results = asyncio.run(main())
        admitted = [r for r in results if r[0] == 200]
        shed = [r for r in results if r[0] == 503]
        assert len(admitted) + len(shed) == 80 and 8 <= len(admitted) < 80
        assert all(r[1] == "1" and "max_num_queued_reqs" in r[3]["error"]["message"] for r in shed)
        assert all(r[3]["usage"]["completion_tokens"] == 32 for r in admitted)
        assert max(r[2] for r in shed) < 5  # shedding is immediate
        started = time.monotonic()
        assert post(url, CMPL, {"prompt": [1, 2, 3], "max_tokens": 4}).status_code == 200
        assert time.monotonic() - started < 5  # recovered: the next request is served at once


def test_a_requests_outputs_reach_its_stream_in_order_past_a_cancelled_reader():
    """The handoff from the engine's outputs to the task streaming them: deltas put while the reader was away come
    out joined into one, in order (a late stream catches up in one frame); an error after them comes out after
    them, alone; a reader cancelled mid-wait (its client gone) leaves nothing that breaks the next put or the next
    reader."""
    def delta(token: int, finished: bool = False) -> RequestOutput:
        c = CompletionOutput(0, f"<{token}>", [token], None, None, "stop" if finished else None)
        return RequestOutput("r", None, [7], [c], finished)

    def seen(out: RequestOutput) -> tuple[str, list[int], bool]:
        return out.outputs[0].text, out.outputs[0].token_ids, out.finished

    async def run() -> None:
        q = _Outputs()
        q.put(delta(1))
        assert seen(await q.get()) == ("<1>", [1], False)
        q.put(delta(2))
        q.put(delta(3))
        error = RuntimeError("step failed")
        q.put(error)
        assert seen(await q.get()) == ("<2><3>", [2, 3], False)
        assert await q.get() is error
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        q.put(delta(4))
        assert seen(await q.get()) == ("<4>", [4], False)
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put(delta(5))
        q.put(delta(6, finished=True))  # before the woken reader runs: both reach it, and the end with them
        assert seen(await waiting) == ("<5><6>", [5, 6], True) and not q.items

    asyncio.run(run())


def test_a_stream_interval_wakes_the_reader_every_n_tokens_and_at_the_ends():
    """``interval`` 4: the first token at once, then the reader sleeps until four more tokens wait (one output
    of two tokens counts two), and the end wakes it whatever is pending; None (a call that is not streamed): only
    the end does, and the reader gets the whole output at once."""
    def delta(tokens: list[int], finished: bool = False) -> RequestOutput:
        c = CompletionOutput(0, "".join(f"<{t}>" for t in tokens), tokens, None, None, "length" if finished else None)
        return RequestOutput("r", None, [7], [c], finished)

    async def woken(q: _Outputs) -> bool:
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        if reader.done():
            return True
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        return False

    async def run() -> None:
        q = _Outputs(4)
        q.put(delta([1]))
        assert (await q.get()).outputs[0].token_ids == [1]
        q.put(delta([2]))
        q.put(delta([3, 4]))
        assert not await woken(q)
        q.put(delta([5]))
        assert (await q.get()).outputs[0].token_ids == [2, 3, 4, 5]
        q.put(delta([6]))
        q.put(delta([7], finished=True))
        out = await q.get()
        assert out.outputs[0].token_ids == [6, 7] and out.finished and not q.items
        whole = _Outputs(None)
        for t in range(1, 9):
            whole.put(delta([t]))
            assert not await woken(whole)
        whole.put(delta([9], finished=True))
        out = await whole.get()
        assert out.outputs[0].text == "<1><2><3><4><5><6><7><8><9>" and out.finished

    asyncio.run(run())

