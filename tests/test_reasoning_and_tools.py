"""Reasoning models and tool calls in the chat API, as vLLM's --reasoning-parser and tool calling give them.

The parsers are checked on scripted text cut at every position (a tag split between two deltas must
still be found); through the server, a regex (structured output) scripts what the tiny model writes,
and forced tool choices parse on its random weights because the grammar makes them."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest

from pagedserve.cli import main
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.reasoning import ReasoningSplitter, prompt_state
from pagedserve.server.tools import (HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                                    RequiredCallsParser)
from tests.serving import running_server

ENGINE = ("--kv-cache-memory", "16MiB", "--max-model-len", "1024")
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if open_think %}<think>\n{% endif %}"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # as Qwen3's template renders it
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def pieces(make, text: str, step: int) -> list:
    """Feed ``text`` ``step`` characters at a time, then finish: every piece the parser returned."""
    parser = make()
    return [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    ("qwen3", "none", "<think>\nWeigh it.\n</think>\n\nIt is 4.", "\nWeigh it.\n", "It is 4."),
    ("qwen3", "none", "It is 4, no <think> here.", "", "It is 4, no <think> here."),
    ("qwen3", "none", "I think </think> is a tag.", "", "I think </think> is a tag."),
    ("qwen3", "none", "<think>cut short by max_tok", "cut short by max_tok", ""),
    ("qwen3", "open", "Weigh it.</think>It is 4.", "Weigh it.", "It is 4."),
    ("qwen3", "closed", '{"a": "</think>"}', "", '{"a": "</think>"}'),
    ("deepseek_r1", "none", "Weigh it.\n</think>\n\nIt is 4.", "Weigh it.\n", "It is 4."),
    ("deepseek_r1", "none", "<think>Weigh it.</think>It is 4 <think>.", "Weigh it.", "It is 4 <think>."),
    ("deepseek_r1", "closed", '{"a": "</think>"}', "", '{"a": "</think>"}'),  # thinking turned off
])
def test_reasoning_is_split_from_the_answer_wherever_the_stream_cuts_it(parser, prompt, text, reasoning, content):
    for step in range(1, len(text) + 1):
        got = pieces(lambda: ReasoningSplitter(parser, prompt), text, step)
        # the joins hold no tag: none leaked, not even in part when it arrived a character at a time
        assert "".join(r for r, _ in got) == reasoning and "".join(c for _, c in got) == content, step


def test_the_prompt_says_whether_reasoning_is_under_way():
    assert prompt_state("<|im_start|>assistant\n") == "none"
    assert prompt_state("<|im_start|>assistant\n<think>\n") == "open"
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"


def joined(got: list) -> tuple[str, list[tuple[str, dict]]]:
    """The content and the calls that (content, call entries) pieces add up to, entries joined by index."""
    calls: dict[int, list] = {}
    for _, entries in got:
        for e in entries:
            assert e["index"] in calls or e["index"] == len(calls)  # numbered in order, announced first
            call = calls.setdefault(e["index"], [e["function"].get("name"), ""])
            call[1] += e["function"].get("arguments", "")
    return "".join(t for t, _ in got), [(name, json.loads(args)) for name, args in calls.values()]


def test_hermes_calls_come_out_of_the_text_and_anything_else_stays_content():
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n')
    both = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    cases = [
        ("Let me look.\n\n" + calls, "Let me look.", both),
        (calls, "", both),
        # a block that is not a call is the answer's text, tags and all; so is a lone tag
        ("See <tool_call>not json</tool_call> and </tool_call> there.\n",
         "See <tool_call>not json</tool_call> and </tool_call> there.\n", []),
        # the model stopped before closing its block: a call if what it wrote parses
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n', "", [("get_time", {"zone": "UTC"})]),
        ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
        # arguments with braces, brackets and escaped quotes inside strings end where their object ends
        ('<tool_call>{"name": "f", "arguments": {"q": "a } \\" ]", "l": [1, {"b": "}"}]}}</tool_call>', "",
         [("f", {"q": 'a } " ]', "l": [1, {"b": "}"}]})]),
        # arguments sent as a JSON string, and the name after them, are read once the block closes
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
        ('<tool_call>{"arguments": {"x": 2}, "name": "f"}</tool_call>', "", [("f", {"x": 2})]),
        # a head longer than the parser looks for (HEAD_LIMIT) is judged whole too
        ('<tool_call>{"name": "' + "n" * 600 + '", "arguments": {"x": 3}}</tool_call>', "", [("n" * 600, {"x": 3})]),
    ]
    for text, content, expected in cases:
        for step in (1, 2, 5, 13, len(text)):
            assert joined(pieces(HermesParser, text, step)) == (content, expected), (text, step)
    # streamed: the call is announced as its arguments begin, and they arrive piece by piece before the
    # block closes; cut short, the call keeps what it got
    got = pieces(HermesParser, '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>', 3)
    announced = next(i for i, (_, calls) in enumerate(got) if calls)
    assert got[announced][1][0]["function"] == {"name": "get_time", "arguments": ""}
    assert len([c for _, calls in got for c in calls]) > 4 and announced < len(got) - 4
    cut = pieces(HermesParser, '<tool_call>{"name": "get_time", "arguments": {"zone": "C', 4)
    assert "".join(c["function"].get("arguments", "") for _, calls in cut for c in calls) == '{"zone": "C'


def test_llama3_json_calls_stream_and_what_does_not_parse_stays_content():
    two = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {}}'
    cases = [
        (two, "", [("get_time", {"zone": "UTC"}), ("get_weather", {})]),
        (' {"name": "get_time", "arguments": {"zone": "CET"}}', "", [("get_time", {"zone": "CET"})]),
        ("The time is noon.\n", "The time is noon.\n", []),
        (' {"not": "a call"}', ' {"not": "a call"}', []),
        ('{"name": "get_time", "param', '{"name": "get_time", "param', []),
        # parameters with braces and quotes inside strings; a call whose name comes last is read at the end
        ('{"name": "f", "parameters": {"q": "a } \\" ]"}} ; {"parameters": {"x": 2}, "name": "g"}', "",
         [("f", {"q": 'a } " ]'}), ("g", {"x": 2})]),
        # after a streamed call, text that is no call is content
        ('{"name": "f", "parameters": {"x": 1}}\nDone.', "\nDone.", [("f", {"x": 1})]),
    ]
    for text, content, expected in cases:
        for step in (1, 3, 7, len(text)):
            assert joined(pieces(Llama3JsonParser, text, step)) == (content, expected), (text, step)
    # the second call is announced before the answer ends, its parameters arriving piece by piece
    got = pieces(Llama3JsonParser, two.replace("{}", '{"city": "Oslo", "unit": "celsius"}'), 4)
    second = next(i for i, (_, calls) in enumerate(got) if any(c["index"] == 1 for c in calls))
    assert second < len(got) - 4 and got[second][1][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len([c for _, calls in got[second:] for c in calls]) > 4
    cut = pieces(Llama3JsonParser, '{"name": "get_time", "parameters": {"zone": "C', 4)
    assert "".join(c["function"].get("arguments", "") for _, calls in cut for c in calls) == '{"zone": "C'


def test_mistral_calls_in_both_of_its_formats():
    cases = [
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": '
         '{"city": "Oslo"}}]', "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
        ('Checking.[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
         "Checking.", [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome"})]),
        ("No calls [TOOL here.", "No calls [TOOL here.", []),
        ("[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
        # a call whose name comes after its arguments is read at the end
        ('[TOOL_CALLS] [{"arguments": {"x": 1}, "name": "f"}]', "", [("f", {"x": 1})]),
    ]
    for text, content, expected in cases:
        for step in (1, 3, 7, len(text)):
            assert joined(pieces(MistralParser, text, step)) == (content, expected), (text, step)
    # both formats stream: each call announced as its arguments begin, which arrive piece by piece; a call
    # cut short keeps what it got
    for text in ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", '
                 '"arguments": {"city": "Oslo", "unit": "celsius"}}]',
                 '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", '
                 '"unit": "celsius"}'):
        got = pieces(MistralParser, text, 4)
        second = next(i for i, (_, calls) in enumerate(got) if any(c["index"] == 1 for c in calls))
        assert next(c for c in got[second][1] if c["index"] == 1)["function"] == {"name": "get_weather",
                                                                                 "arguments": ""}
        assert len([c for _, calls in got[second:] for c in calls]) > 4, text
    cut = pieces(MistralParser, "[TOOL_CALLS]get_time[ARGS]{broken", 4)
    assert "".join(c["function"].get("arguments", "") for _, calls in cut for c in calls) == "{broken"


def test_pythonic_calls_go_out_one_by_one_as_json():
    cases = [
        ('[get_time(zone="UTC"), get_weather(city=\'Oslo\', days=3, hourly=False, at=(1, 2), extra=None)]', "",
         [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 3, "hourly": False,
                                                          "at": [1, 2], "extra": None})]),
        # brackets, parentheses and quotes inside strings, triple quotes, nested literals, no arguments
        (' [f(q="a ) ] \\" (", d={"k": [1, {"x": "]"}]}, t=\'\'\'it\'s\'\'\'), g()]\n', "",
         [("f", {"q": 'a ) ] " (', "d": {"k": [1, {"x": "]"}]}, "t": "it's"}), ("g", {})]),
        ("The time is noon.", "The time is noon.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[]", "[]", []),
        # a positional argument, a value that is not a literal, a call cut short: content from there on
        ('[f(x=1), g(2)]', " g(2)]", [("f", {"x": 1})]),
        ('[f(x=open("a"))]', '[f(x=open("a"))]', []),
        ('[f(x=1), g(y="ab', ' g(y="ab', [("f", {"x": 1})]),
        ('[f(x=1)]\nDone.', "\nDone.", [("f", {"x": 1})]),
    ]
    for text, content, expected in cases:
        for step in (1, 2, 3, 7, len(text)):
            assert joined(pieces(PythonicParser, text, step)) == (content, expected), (text, step)
    # the first call goes out before the second is written
    got = pieces(PythonicParser, '[get_time(zone="UTC"), get_weather(city="Oslo")]', 3)
    first = next(i for i, (_, calls) in enumerate(got) if calls)
    assert got[first][1][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'} and first < 10


def test_required_calls_cut_short_are_returned_as_text():
    assert joined(pieces(RequiredCallsParser, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]', 4)) == \
        ("", [("get_time", {"zone": "UTC"})])
    assert joined(pieces(RequiredCallsParser, '[{"name": "get_ti', 4)) == ('[{"name": "get_ti', [])


def test_messages_with_calls_reach_the_template_with_their_arguments_as_a_mapping():
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}])
    assert message.as_dict()["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    body = {"messages": USER, "tools": [TIME]}
    assert "tools" in ChatCompletionRequest(**body).template_args(True)
    assert "tools" in ChatCompletionRequest(**body, tool_choice="none").template_args(True)
    assert "tools" not in ChatCompletionRequest(**body, tool_choice="none").template_args(True, tools_when_none=False)


@contextmanager
def parsing_server(folder, *extra: str):
    """A server with TEMPLATE, Qwen3's reasoning parser and hermes tool calls: (url, openai client, app)."""
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = (*ENGINE, "--chat-template", str(template), "--reasoning-parser", "qwen3",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra)
    with running_server(*flags) as (url, app):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with parsing_server(tmp_path_factory.mktemp("template")) as running:
        yield running


def scripted(text: str) -> dict:
    """extra_body that makes the tiny model write exactly ``text``: a regex of the literal, which holds from
    the first token as the prompt turns thinking off."""
    regex = "".join("\\" + ch if ch in "\\.^$*+?()[]{}|" else "\\n" if ch == "\n" else ch for ch in text)
    return {"structured_outputs": {"regex": regex}, **NO_THINKING}


def stream_of(client, **kwargs) -> tuple[list, dict]:
    chunks = [c for c in client.chat.completions.create(model="tiny", stream=True, **kwargs) if c.choices]
    parts = {"reasoning": "", "content": "", "calls": {}}
    for c in chunks:
        d = c.choices[0].delta
        parts["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        parts["content"] += d.content or ""
        for call in d.tool_calls or []:
            slot = parts["calls"].setdefault(call.index, {"name": None, "arguments": ""})
            slot["name"] = slot["name"] or call.function.name
            slot["arguments"] += call.function.arguments or ""
    return chunks, parts


def test_reasoning_comes_apart_from_the_answer(server):
    _, client, _ = server
    text = "<think>\nTwo and two.\n</think>\n\nFour."
    args = dict(messages=USER, max_tokens=60, temperature=0, extra_body=scripted(text))
    answer = client.chat.completions.create(model="tiny", **args)
    message = answer.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("\nTwo and two.\n", "Four.")
    assert message.model_extra["reasoning"] == "\nTwo and two.\n" and answer.choices[0].finish_reason == "stop"
    chunks, parts = stream_of(client, **args)
    assert (parts["reasoning"], parts["content"]) == ("\nTwo and two.\n", "Four.")
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a template that opens the block in the prompt: the output reasons from its first token, here to its
    # last (random weights do not close the block)
    opened = dict(messages=USER, max_tokens=20, temperature=0,
                  extra_body={"chat_template_kwargs": {"open_think": True}})
    message = client.chat.completions.create(model="tiny", **opened).choices[0].message
    assert message.content is None and len(message.model_extra["reasoning_content"]) > 0
    hidden = dict(args, extra_body={**scripted(text), "include_reasoning": False})
    message = client.chat.completions.create(model="tiny", **hidden).choices[0].message
    assert "reasoning_content" not in message.model_extra and message.content == "Four."


def test_auto_tool_calls_with_the_openai_sdk(server):
    _, client, _ = server
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    args = dict(messages=USER, tools=[WEATHER, TIME], max_tokens=80, temperature=0, extra_body=scripted(call))
    answer = client.chat.completions.create(model="tiny", **args)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
    (made,) = message.tool_calls
    assert made.type == "function" and made.id.startswith("chatcmpl-tool-")
    assert (made.function.name, json.loads(made.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks, parts = stream_of(client, **args)
    assert parts["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}} and not parts["content"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call goes back into the conversation, with the tool's result, and the template renders both
    follow = USER + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": made.id, "content": "Sunny, 21 C"}]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=5,
                                           temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # without a call in what the model writes, the answer is its text
    plain = client.chat.completions.create(model="tiny", **dict(args, extra_body=scripted("No need.")))
    assert plain.choices[0].message.content == "No need." and not plain.choices[0].message.tool_calls


def test_parallel_tool_calls_false_keeps_the_first_call_only(server):
    """The model writes two calls; with parallel_tool_calls false the answer (whole or streamed) holds the first,
    as vLLM's and OpenAI's do; by default both."""
    _, client, _ = server
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    args = dict(messages=USER, tools=[WEATHER, TIME], max_tokens=400, temperature=0, extra_body=scripted(two))
    both = client.chat.completions.create(model="tiny", **args).choices[0].message.tool_calls
    assert [c.function.name for c in both] == ["get_weather", "get_time"]
    one = client.chat.completions.create(model="tiny", parallel_tool_calls=False, **args).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"] and one.finish_reason == "tool_calls"
    assert json.loads(one.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    _, parts = stream_of(client, parallel_tool_calls=False, **args)
    assert parts["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}} and not parts["content"]


def test_forced_tool_choices_parse_on_random_weights(server):
    _, client, _ = server
    named = dict(messages=USER, tools=[WEATHER, TIME], max_tokens=60, temperature=0.8, seed=3,
                 extra_body=NO_THINKING, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (made,) = client.chat.completions.create(model="tiny", **named).choices[0].message.tool_calls
    assert made.function.name == "get_weather" and set(json.loads(made.function.arguments)) == {"city"}
    _, parts = stream_of(client, **named)
    assert parts["calls"][0]["name"] == "get_weather" and set(json.loads(parts["calls"][0]["arguments"])) == {"city"}
    required = dict(messages=USER, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=1.0,
                    extra_body=NO_THINKING)
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", seed=seed, **required).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls
        for made in answer.message.tool_calls:
            assert set(json.loads(made.function.arguments)) == {"get_weather": {"city"}, "get_time": {"zone"}}[
                made.function.name]
    single = client.chat.completions.create(model="tiny", seed=5, parallel_tool_calls=False, **required)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_grammar_holds_from_the_end_of_the_reasoning(server):
    url, client, app = server
    grammars = app.state.engine.inputs.grammars
    tok = app.state.engine.tokenizer
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    thinking = grammars.grammar({"choice": ["yes", "no"]}, ids("<|im_start|>assistant\n"))
    for t in ids("<think>Maybe {</think>"):
        assert not thinking.active and not thinking.terminated  # the reasoning is free
        thinking.accept(t)
    assert thinking.active
    for t in [*ids("yes"), app.state.engine.inputs.eos_token_ids[0]]:
        assert not thinking.terminated
        thinking.accept(t)
    assert thinking.terminated  # the choice, then the end: the grammar has followed every token since </think>
    assert grammars.grammar({"choice": ["yes"]}, ids("assistant\n<think>\n\n</think>\n\n")).active
    # through the server: while the model reasons (random weights never close the block) the grammar
    # waits, so the text is free; with thinking turned off it holds from the first token
    ask = dict(messages=USER, max_tokens=12, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    free = client.chat.completions.create(model="tiny", **ask).choices[0]
    held = client.chat.completions.create(model="tiny", **dict(ask, extra_body={"guided_choice": ["yes", "no"],
                                                                                  **NO_THINKING})).choices[0]
    assert free.finish_reason == "length" and free.message.content not in ("yes", "no")
    assert held.finish_reason == "stop" and held.message.content in ("yes", "no")


def test_tools_reach_the_template_and_tokenize(server):
    url, _, _ = server
    conversation = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": conversation, "tools": [WEATHER]}).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "Tools: get_weather" in text and '"arguments": {"city": "Paris"}}</tool_call>' in text
    # rendered as a chat request would be: the generation prompt (on by default), template kwargs
    def count(**extra) -> int:
        return httpx.post(f"{url}/tokenize", json={"messages": USER, **extra}).json()["count"]
    assert count() > count(add_generation_prompt=False)
    assert count(chat_template_kwargs={"open_think": True}) > count()
    strs = httpx.post(f"{url}/tokenize", json={"prompt": "Hi there", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(isinstance(t, str) for t in strs["token_strs"])


@pytest.mark.parametrize("extra, param, fragment", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "one structured output"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ""),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "not JSON"),
])
def test_bad_tool_requests_get_400_naming_the_field(server, extra, param, fragment):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **extra}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"].startswith(param) and fragment in error["message"], r.text


def test_mistral_calls_through_a_server_that_keeps_their_special_tokens():
    """Mistral's call markers are special tokens: requests that may call tools keep special tokens in
    their text (here the tiny model's <|im_start|>, forced by a logit bias), the others do not."""
    flags = (*ENGINE, "--enable-auto-tool-choice", "--tool-call-parser", "mistral")
    with running_server(*flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        call = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        answer = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=60,
                                                temperature=0, extra_body=scripted(call)).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == \
            [("get_weather", {"city": "Oslo"})]
        forced = {"logit_bias": {"1": 100}, "max_tokens": 1}  # token 1: <|im_start|>
        with_tools = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], **forced)
        without = client.chat.completions.create(model="tiny", messages=USER, **forced)
        assert with_tools.choices[0].message.content == "<|im_start|>" and without.choices[0].message.content == ""


def test_auto_tool_choice_needs_the_server_flags(capsys):
    with running_server(*ENGINE) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]}, timeout=30)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", *ENGINE, "--enable-auto-tool-choice"])
    assert e.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err
