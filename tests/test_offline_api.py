"""The offline API: prompt forms, order, sampling parameters, stop conditions, logprobs, chat."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError, InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", kv_cache_memory="8MiB", max_model_len=256)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = ["Hello world", "The scheduler", "Paris is"]
    by_text = llm.generate(text, params, use_tqdm=False)
    by_ids = llm.generate([tok.encode(t) for t in text], params, use_tqdm=False)
    single = llm.generate(text[1], params, use_tqdm=False)
    as_dict = llm.generate({"prompt_token_ids": tok.encode(text[2])}, params, use_tqdm=False)
    assert [o.prompt for o in by_text] == text
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert single[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    assert as_dict[0].outputs[0].token_ids == by_text[2].outputs[0].token_ids
    salted = llm.generate([{"prompt": text[0], "cache_salt": "tenant-a"}], params, use_tqdm=False)[0]
    assert salted.prompt == text[0] and salted.outputs[0].token_ids == by_text[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]}, params, use_tqdm=False)
    assert llm.generate([tuple(tok.encode(text[2]))], params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_text[2].outputs[0].token_ids
    for bad in (None, 3.5, {"prompt_token_ids": None}):
        with pytest.raises(InvalidRequestError, match="text, a list of token ids or a prompt dict"):
            llm.generate([bad], params, use_tqdm=False)
    for o in by_text:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Tell me a story"], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["Tell me a story", "Other", "Numbers: 1 2 3"],
                         [p, SamplingParams(temperature=1.0, max_tokens=16), SamplingParams(temperature=0.7, max_tokens=9)],
                         use_tqdm=False)
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(["Hello"], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False)
    minp1 = llm.generate(["Hello"], SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids == minp1[0].outputs[0].token_ids


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    ids, text = base.outputs[0].token_ids, base.outputs[0].text
    stop_id = ids[5]
    first = ids.index(stop_id)
    o = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == ids[:first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
    tok = llm.get_tokenizer()
    assert o.text == tok.decode(ids[:first], skip_special_tokens=True)  # the stop token's text is left out ...
    o = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=[stop_id], include_stop_str_in_output=True),
                     use_tqdm=False)[0].outputs[0]
    assert o.text == tok.decode(ids[:first + 1], skip_special_tokens=True)  # ... unless asked for
    eos = tok.eos_token_id  # so is the end-of-sequence token's, also when special tokens are kept
    for keep, want in ((False, ""), (True, tok.eos_token)):
        o = llm.generate(["Hello world"], SamplingParams(max_tokens=5, skip_special_tokens=False,
                                                         logit_bias={eos: 100}, include_stop_str_in_output=keep),
                         use_tqdm=False)[0].outputs[0]
        assert o.token_ids == [eos] and o.text == want and o.finish_reason == "stop"
    stop_str = text[6:9]
    cut = text.find(stop_str)
    o = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_str]),
                     use_tqdm=False)[0].outputs[0]
    assert o.text == text[:cut] and o.finish_reason == "stop" and o.stop_reason == stop_str
    o = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop_str,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert o.text == text[:cut + len(stop_str)]
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_blocks


def test_requests_stopping_mid_batch_leave_the_others_unchanged(llm):
    """A request stopped by a token has already been given the next step (one runs ahead on the device):
    that step's token is dropped, and the rows of the others (tokens, logprobs) stay theirs."""
    prompts = ["Hello world", "The scheduler", "Paris is"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    stop_id = alone[1].token_ids[2]
    stopping = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True, stop_token_ids=[stop_id])
    together = [o.outputs[0] for o in llm.generate(prompts, [params, stopping, params], use_tqdm=False)]
    cut = alone[1].token_ids.index(stop_id) + 1
    assert together[1].token_ids == alone[1].token_ids[:cut] and together[1].finish_reason == "stop"
    for got, want in zip([together[0], together[2]], [alone[0], alone[2]]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_blocks


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.inputs.eos_token_ids[0]
    base = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert base.outputs[0].finish_reason == "length" and len(base.outputs[0].token_ids) == 30
    # make EOS the greedy choice by feeding a prompt whose continuation we know, via logits of eos itself:
    # simpler and exact: check_stop on a request whose sampled token is EOS
    from pagedserve.engine.request import Request
    r = Request("x", [1, 2], SamplingParams(max_tokens=5), (eos,), 5)
    r.append_token(eos)
    assert r.check_stop(100) and r.status.finish_reason == "stop"
    r = Request("y", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True), (eos,), 5)
    r.append_token(eos)
    assert not r.check_stop(100)


def test_logprobs(llm):
    o = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 6
    total = 0.0
    for tid, entry in zip(o.token_ids, o.logprobs):
        assert tid in entry and entry[tid].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3  # the sampled token is also the top-1
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[tid].logprob
    assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-6)


def test_max_logprobs_caps_what_a_request_may_ask(llm):
    """vLLM's --max-logprobs (default 20; -1: the vocabulary): above it a request is refused by name."""
    with pytest.raises(InvalidRequestError, match="21 logprobs a token.*at most 20.*--max-logprobs") as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    assert e.value.param == "logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, prompt_logprobs=21), use_tqdm=False)
    wide = LLM("tiny", kv_cache_memory="8MiB", max_model_len=256, max_logprobs=-1)
    vocab = wide.engine.config.model.vocab_size
    assert wide.engine.config.max_logprobs == vocab
    o = wide.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2, logprobs=vocab, prompt_logprobs=40),
                      use_tqdm=False)[0]
    assert [len(e) for e in o.outputs[0].logprobs] == [vocab, vocab]  # the sampled token is among them
    assert all(len(e) in (40, 41) for e in o.prompt_logprobs[1:])
    with pytest.raises(ConfigError, match=r"\(--max-logprobs\): -2 must be >= 0"):
        LLM("tiny", kv_cache_memory="8MiB", max_model_len=256, max_logprobs=-2)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    assert out.prompt_token_ids == expected
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt_token_ids == tok.encode("[get_weather]What is the capital of France?", add_special_tokens=False)
    # a turn without content renders empty; a message that is no dict with a role is refused by name
    empty = llm.chat([{"role": "user"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert empty.prompt_token_ids == tok.encode("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n",
                                                add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="Message 1 is not a dict"):
        llm.chat([msgs[0], "hello"], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n"), (dict(stop=[""]), "stop"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    # of the wrong type, as a Python caller may pass them
    (dict(temperature="hot"), "temperature"), (dict(max_tokens="5"), "max_tokens"), (dict(stop=5), "stop"),
    (dict(logprobs=True), "logprobs"), (dict(ignore_eos="yes"), "ignore_eos"), (dict(top_k=2.5), "top_k"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(n=2.0), "n"), (dict(seed="7"), "seed"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
])
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_sampling_params_take_integers_of_any_integral_type(llm):
    """Every integer field and token id takes numpy's integers (a caller's array element, say); bools and
    negative ids are still refused."""
    import numpy as np

    prompt = llm.get_tokenizer().encode("Hello world")
    p = SamplingParams(n=np.int64(2), seed=np.int32(7), max_tokens=np.int64(5), ignore_eos=True,
                       stop_token_ids=list(np.array([10**5])), logit_bias={np.int64(9): 0.5})
    again = SamplingParams(n=2, seed=7, max_tokens=5, ignore_eos=True, stop_token_ids=[10**5], logit_bias={9: 0.5})
    assert p.stop_token_ids == [10**5] and type(p.stop_token_ids[0]) is int and list(p.logit_bias) == [9]
    (out,), (ref,) = (llm.generate([q], s, use_tqdm=False) for q, s in ((list(np.array(prompt)), p), (prompt, again)))
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 5 for o in out.outputs)
    for bad in ({"stop_token_ids": [True]}, {"stop_token_ids": [-1]}, {"logit_bias": {np.int64(-2): 1.0}}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError, match="Token ids"):
        llm.generate([[1, True]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_logit_bias_steers_sampling_and_leaves_logprobs_raw(llm):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = llm.generate(["Hello world"], plain, use_tqdm=False)[0].outputs[0].token_ids[0]
    forced, banned = 7, {first: -100.0}
    outs = llm.generate(["Hello world"] * 3, [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}, logprobs=0),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}),
        SamplingParams(temperature=0, max_tokens=1, logit_bias=banned)], use_tqdm=False)
    greedy, sampled, avoided = (o.outputs[0] for o in outs)
    assert greedy.token_ids == sampled.token_ids == [forced] * 6
    assert all(lp[forced].logprob < -1.0 for lp in greedy.logprobs)  # the model's, not the biased ones
    assert avoided.token_ids[0] != first
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(["Hello"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_allowed_token_ids_hold_samples_alone_and_with_a_grammar(llm):
    """allowed_token_ids: every sample among them, greedy or not, beside unconstrained rows; with a grammar, the
    tokens both allow (here only the spelling of one of three choices can be written)."""
    tok = llm.get_tokenizer()
    allowed = [20, 21, 22, 23]
    outs = llm.generate(["Hello world"] * 3, [
        SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed, n=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    held = [o.token_ids for out in outs[:2] for o in out.outputs]
    assert all(set(ids) <= set(allowed) and len(ids) == 12 for ids in held)
    assert not set(outs[2].outputs[0].token_ids) <= set(allowed)  # the row beside them is free
    red = tok.encode("red", add_special_tokens=False) + [tok.eos_token_id]
    choice = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs={"choice": ["red", "green", "blue"]},
                            allowed_token_ids=red)
    assert {o.outputs[0].text for o in llm.generate(["Pick:"] * 4, [choice] * 4, use_tqdm=False)} == {"red"}
    with pytest.raises(InvalidRequestError, match="allowed_token_ids names token"):
        llm.generate(["Hello"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_bad_words_are_never_completed(llm):
    """A one-token bad word never appears; of a two-token one, the second never follows the first. Greedy
    decoding that wrote both before writes neither after (a word is the text of tokens that encode back to
    them)."""
    tok = llm.get_tokenizer()
    greedy = dict(temperature=0, max_tokens=32, ignore_eos=True)
    plain = llm.generate(["Hello world"], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids

    def spelled(ids):  # the word these tokens spell, if it encodes back to them
        word = tok.decode(ids)
        return word if word == word.lstrip() and tok.encode(word, add_special_tokens=False) == list(ids) else None

    one = next(t for t in plain if spelled([t]))
    a, b = next((a, b) for a, b in zip(plain, plain[1:]) if spelled([a, b]))
    outs = llm.generate(["Hello world"] * 2, [SamplingParams(**greedy, bad_words=[spelled([one])]),
                                              SamplingParams(**greedy, bad_words=[spelled([a, b])])], use_tqdm=False)
    without_one, without_pair = (o.outputs[0].token_ids for o in outs)
    assert one not in without_one and without_one != plain
    assert (a, b) not in set(zip(without_pair, without_pair[1:])) and without_pair != plain


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    """truncate_prompt_tokens N: the prompt's last N tokens, as if only they were sent (so a text longer than the
    context is no error); more than the context is refused; -1 keeps up to the context."""
    ids = list(range(3, 300))
    params = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([ids], SamplingParams(**params, truncate_prompt_tokens=50), use_tqdm=False)[0]
    alone = llm.generate([ids[-50:]], SamplingParams(**params), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-50:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = "the quick brown fox " * 2000  # far more characters than 256 tokens could hold
    out = llm.generate([text], SamplingParams(**params, truncate_prompt_tokens=20), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 20 and out.prompt == text
    short = llm.generate([ids[:10]], SamplingParams(**params, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[:10]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens 300 is more than this model's maximum"):
        llm.generate([ids], SamplingParams(**params, truncate_prompt_tokens=300), use_tqdm=False)


def test_generate_names_what_is_wrong_with_its_arguments(llm):
    """Arguments of the wrong kind are named as such, not met later as an error from inside the engine."""
    with pytest.raises(TypeError, match="prompts: give a string, token ids, a prompt dict or a list of them, not "
                                        "NoneType"):
        llm.generate(None, use_tqdm=False)
    for bad in ("greedy", [SamplingParams(), {"max_tokens": 3}]):
        with pytest.raises(TypeError, match="sampling_params: give a SamplingParams or a list of them"):
            llm.generate(["a", "b"] if isinstance(bad, list) else ["a"], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(max_tokens=1)] * 2, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_too_long_prompt_is_rejected_with_both_numbers(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5] * 250], SamplingParams(max_tokens=10), use_tqdm=False)
    assert "256" in str(e.value) and "250" in str(e.value) and "10" in str(e.value)
    with pytest.raises(InvalidRequestError):
        llm.generate([[999999]], SamplingParams(max_tokens=1), use_tqdm=False)
    # a bad prompt after good ones: the call fails and the good ones do not linger in the engine
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [7, 8], [5] * 300], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_blocks


def test_token_id_only_mode_for_known_model_with_dummy_weights():
    llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", kv_cache_memory="64MiB", max_model_len=128,
              dtype="float32")
    assert llm.get_tokenizer() is None
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)


def test_out_of_memory_in_a_step_names_the_flags(monkeypatch):
    from pagedserve.engine.core import DeviceOOMError

    llm = LLM("tiny", kv_cache_memory="2MiB")

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(llm.engine.core.worker, "execute", oom)
    with pytest.raises(DeviceOOMError) as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    msg = str(e.value)
    assert "--max-num-batched-tokens" in msg and "--gpu-memory-utilization" in msg and "Tried to allocate" in msg
    assert not llm.engine.has_unfinished_requests()  # the failed call leaves nothing behind


def test_step_outputs_are_cumulative_delta_or_final_only(llm):
    from pagedserve.outputs import RequestOutputKind, combine

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Hello world")
    engine.add_request("cumulative", prompt, params)
    engine.add_request("delta", prompt, params, RequestOutputKind.DELTA)
    engine.add_request("final", prompt, params, RequestOutputKind.FINAL_ONLY)
    seen: dict[str, list] = {"cumulative": [], "delta": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [len(o.outputs[0].token_ids) for o in seen["cumulative"]] == [1, 2, 3, 4, 5]
    assert [len(o.outputs[0].token_ids) for o in seen["delta"]] == [1, 1, 1, 1, 1]
    assert len(seen["final"]) == 1
    full, joined = seen["final"][0].outputs[0], combine(seen["delta"]).outputs[0]
    assert (joined.text, joined.token_ids, joined.finish_reason) == (full.text, full.token_ids, full.finish_reason)
    assert [e.keys() for e in joined.logprobs] == [e.keys() for e in full.logprobs]


def test_delta_outputs_hold_back_a_forming_stop_string(llm):
    """A stream never sends text that a stop string then cuts off."""
    from pagedserve.outputs import RequestOutputKind

    base = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = base[8:11]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    llm.engine.add_request("s", "Hello world", params, RequestOutputKind.DELTA)
    pieces = []
    while llm.engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in llm.engine.step()]
    assert "".join(pieces) == base[:base.find(stop)]


def test_step_stats_count_a_finished_request_out_of_running(llm):
    """With one step in flight, the step that returns a request's last token must not still count it
    as running (the metrics' num_requests_running reads these stats)."""
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Hello world")
    engine.add_request("short", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    running_when_finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                running_when_finished[out.request_id] = engine.core.last_stats.num_running
    assert running_when_finished == {"short": 1, "long": 0}


def test_engine_start_freezes_its_heap_and_a_dropped_engine_frees_its_tensors():
    import gc
    import weakref

    llm = LLM("tiny", kv_cache_memory="2MiB", max_model_len=64)
    # start-up's objects are frozen: a full collection walks only what came after, and seldom
    assert gc.get_freeze_count() > 10 * len(gc.get_objects())
    assert gc.get_threshold()[0] >= 7000
    runner = llm.engine.core.worker.runner
    refs = [weakref.ref(runner), weakref.ref(runner.kv_caches[0]), weakref.ref(next(runner.model.parameters()))]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    del llm, out, runner
    gc.collect()
    assert all(r() is None for r in refs)  # frozen, yet freed: nothing but cycles waits for the exit


def test_a_running_requests_tokens_are_not_walked_by_the_garbage_collector(llm):
    """The token ids the engine keeps a request (all of them in the core, the output's in the output
    processor) are arrays, whose elements the collector never visits (a list's it visits one by one: with
    hundreds of long requests alive, each full collection stalled the loop). The caller gets lists."""
    import gc

    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Hello world")
    engine.add_request("walked", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        outputs = engine.step()
    request, state = engine.core.scheduler.requests["walked"], engine.outputs.states["walked"]
    assert len(request.all_token_ids) > len(prompt) and len(state.token_ids) > 0
    for ids in (request.all_token_ids, state.token_ids):
        assert gc.get_referents(ids) in ([], [type(ids)])  # at most its type, never the tokens
    assert type(outputs[0].outputs[0].token_ids) is list
    assert list(request.all_token_ids[len(prompt):len(prompt) + len(state.token_ids)]) == list(state.token_ids)
    while engine.has_unfinished_requests():
        engine.step()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_structured_outputs_hold_even_random_weights_to_the_format(llm):
    """A JSON schema, a choice and a regex, greedy and sampled, beside an unconstrained request (which gives
    what it gives alone): each output parses and matches; the grammar ends each request."""
    import json
    import re

    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["plain"], plain, use_tqdm=False)[0].outputs[0].token_ids
    specs = [{"json": SCHEMA}, {"choice": ["yes", "no", "maybe"]}, {"regex": "[0-9]{3}-[a-z]{2}"}]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured_outputs=s)
              for i, (t, s) in enumerate((t, s) for t in (0.0, 1.0) for s in specs)]
    outs = llm.generate(["Answer:"] * len(params) + ["plain"], params + [plain], use_tqdm=False)
    for o, p in zip(outs, params):
        text, kind = o.outputs[0].text, next(iter(p.structured_outputs))
        assert o.outputs[0].finish_reason == "stop", (kind, text)
        if kind == "json":
            value = json.loads(text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
        elif kind == "choice":
            assert text in ("yes", "no", "maybe")
        else:
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", text)
    assert outs[-1].outputs[0].token_ids == alone
    grammar = llm.engine.inputs.grammars.grammar({"choice": ["yes"]}, [1, 2])
    grammar.accept(llm.get_tokenizer().encode("no", add_special_tokens=False)[0])  # what the mask forbids
    assert grammar.terminated  # that request ends; nothing raises into the step the others share
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidRequestError, match="could not be compiled"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "([a-z"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
