"""OpenAI's Responses API through the official SDK: text, reasoning and function calls as output items,
whole and streamed (the SDK's own stream accumulator must rebuild the same response), conversations of
input items or of stored responses, and the 400s of what the server does not do."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving import wait_until
from tests.test_reasoning_and_tools import NO_THINKING, WEATHER, parsing_server, scripted

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER["function"]["parameters"]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with parsing_server(tmp_path_factory.mktemp("template"), "--max-stored-responses", "3") as (url, client, app):
        yield url, client, app


def items(response) -> list[tuple]:
    return [(i.type, i.content[0].text if i.type in ("message", "reasoning") else (i.name, i.arguments))
            for i in response.output]


def test_text_and_reasoning_whole_and_streamed(server):
    url, client, _ = server
    cut = client.responses.create(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=6,
                                  temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 6 and cut.output_text == cut.output[0].content[0].text
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 6, "temperature": 0}).json()
    assert cut.usage.input_tokens == chat["usage"]["prompt_tokens"]  # instructions: the system message
    assert cut.output_text == chat["choices"][0]["message"]["content"]

    ask = dict(model="tiny", input="2+2?", max_output_tokens=60, temperature=0,
               extra_body=scripted("<think>\nTwo and two.\n</think>\n\nFour."))
    whole = client.responses.create(**ask)
    assert whole.status == "completed" and items(whole) == [("reasoning", "\nTwo and two.\n"), ("message", "Four.")]
    assert whole.output_text == "Four." and whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and "response.reasoning_text.delta" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Four."
    with client.responses.stream(**ask) as stream:  # the SDK rebuilds the response from the events
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    assert items(rebuilt) == items(whole) and rebuilt.usage.output_tokens == whole.usage.output_tokens


def test_function_calls_and_a_conversation_of_items(server):
    url, client, _ = server
    named = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0.8,
                                    extra_body={"seed": 3, **NO_THINKING})
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(model="tiny", input="Weather?", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=120, temperature=0.8, extra_body={"seed": 4, **NO_THINKING}) as s:
        for _ in s:
            pass
        streamed = s.get_final_response()
    assert streamed.output and all(i.type == "function_call" and i.name == "get_weather" for i in streamed.output)
    auto = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=80,
                                   temperature=0, extra_body=scripted(
                                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                       '\n</tool_call>'))
    assert items(auto) == [("function_call", ("get_weather", '{"city": "Oslo"}'))]
    # reasoning, then a sentence, then a call: three items in that order, streamed as the SDK rebuilds them
    mixed = dict(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=120, temperature=0,
                 extra_body=scripted('<think>Need data.</think>Checking.<tool_call>{"name": "get_weather", '
                                     '"arguments": {"city": "Rome"}}</tool_call>'))
    expected = [("reasoning", "Need data."), ("message", "Checking."),
                ("function_call", ("get_weather", '{"city": "Rome"}'))]
    assert items(client.responses.create(**mixed)) == expected
    with client.responses.stream(**mixed) as s:
        for _ in s:
            pass
        assert items(s.get_final_response()) == expected
    # the call and its result go back as input items; the template renders them as the chat API would
    done = auto.output[0]
    conversation = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"type": "function_call", "call_id": done.call_id, "name": done.name,
                     "arguments": done.arguments},
                    {"type": "function_call_output", "call_id": done.call_id, "output": "Snow, -3 C"}]
    again = client.responses.create(model="tiny", input=conversation, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=3)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "max_tokens": 3, "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                                     if k != "type"}}], "tool_choice": "none",
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": done.call_id, "type": "function",
                          "function": {"name": done.name, "arguments": done.arguments}}]},
                     {"role": "tool", "tool_call_id": done.call_id, "content": "Snow, -3 C"}]}).json()
    assert again.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_stored_responses_continue_a_conversation_and_read_back(server):
    url, client, _ = server
    first = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=80,
                                    temperature=0, instructions="Be brief.", extra_body=scripted(
                                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                        '\n</tool_call>'))
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    (call,) = first.output
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "Snow, -3 C"}]
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=result, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=3, instructions="Be brief.")
    assert second.previous_response_id == first.id
    # the same prompt as the whole conversation sent as input items
    whole = client.responses.create(model="tiny", tools=TOOLS, tool_choice="none", max_output_tokens=3,
                                    instructions="Be brief.", store=False, input=[
                                        {"role": "user", "content": "Weather?"},
                                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                         "arguments": call.arguments}, *result])
    assert not whole.store and second.usage.input_tokens == whole.usage.input_tokens
    missing = httpx.get(f"{url}/v1/responses/{whole.id}", timeout=30)  # store=False: never kept
    assert missing.status_code == 404 and "stored" in missing.json()["error"]["message"]
    with client.responses.stream(model="tiny", previous_response_id=second.id, input="And tomorrow?",
                                 max_output_tokens=20, temperature=0, extra_body=scripted("Cold.")) as s:
        for _ in s:
            pass
        streamed = s.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text == "Cold."
    client.responses.delete(second.id)
    for _ in range(3):  # the store keeps the last three: the first response is pushed out
        client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    for gone in (first.id, second.id):
        r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "previous_response_id": gone}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_a_server_that_keeps_no_responses_says_how_to_keep_some(tmp_path):
    with parsing_server(tmp_path) as (url, client, _):
        kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
        assert not kept.store
        r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "previous_response_id": kept.id}, timeout=30)
        assert r.status_code == 404 and "--max-stored-responses" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "computer_call"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"n": 2}, "n"),
    ({"temperature": -1}, "temperature"),
])
def test_what_the_server_does_not_do_is_a_400(server, extra, param):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, **extra},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_gone_mid_stream_frees_its_request(server):
    url, _, app = server
    engine = app.state.engine
    pool = engine.core.pool
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/responses", json={
                "input": "Hello", "max_output_tokens": 1000, "stream": True, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            assert any("response.output_text.delta" in next(lines) for _ in range(30))
            assert engine.num_in_flight == 1
    assert wait_until(lambda: engine.num_in_flight == 0 and pool.num_free_blocks == pool.num_blocks)
