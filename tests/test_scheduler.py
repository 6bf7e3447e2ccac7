"""Scheduler and block pool under random workloads: limits per step, no leaked or doubly freed block."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.model.runner import prompt_graph_sizes
from pagedserve.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int, eos: tuple[int, ...] = ()) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=not eos),
                   eos_token_ids=eos, max_tokens=max_tokens)


def check_pool(pool: BlockPool, sched: Scheduler) -> None:
    held = Counter(b for rid in sched.requests for b in pool.block_table(rid))
    free = set(pool._free)
    assert len(free) == pool.num_free_blocks
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == held[b], "a reference count disagrees with the tables"
    if not pool.enable_prefix_caching:
        assert all(n == 1 for n in held.values()), "a block is in two tables"
    assert not set(held) & free, "a block is both held and free"
    assert set(held) | free == set(range(pool.num_blocks)), "a block leaked"
    for rid, req in sched.requests.items():
        if req.status == RequestStatus.RUNNING:
            assert len(pool.block_table(rid)) * pool.block_size >= req.num_computed_tokens


workload = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(workload=workload, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]),
       max_num_seqs=st.integers(1, 8), budget=st.integers(8, 64), chunked=st.booleans(),
       caching=st.booleans(), overlap=st.booleans(), mixed=st.sampled_from([0, 3, 16]), seed=st.integers(0, 2**16),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workload_invariants(workload, num_blocks, block_size, max_num_seqs, budget, chunked, caching,
                                    overlap, mixed, seed, policy):
    """``overlap``: as the engine core runs it, step N+1 is scheduled before step N's tokens are in; with
    the priority policy, requests get random priorities, and every one still finishes."""
    rng = random.Random(seed)
    max_model_len = 90
    # every request must fit alone in the cache, as the engine's start-up check guarantees
    if num_blocks * block_size < max_model_len:
        num_blocks = -(-max_model_len // block_size)
    if not chunked:
        budget = max(budget, max_model_len)
    budget = max(budget, max_num_seqs)
    pool = BlockPool(num_blocks, block_size, -(-max_model_len // block_size), enable_prefix_caching=caching)
    sched = Scheduler(pool, max_num_seqs, budget, max_model_len, chunked, mixed, policy)
    # prompts share prefixes (every one starts 0, 1, 2, ...), so the prefix cache is hit and blocks shared;
    # odd requests stop at token 13 (about one sampled token in 20)
    pending = [make_request(str(i), p, o, eos=(13,) if i % 2 else ()) for i, (p, o, _) in enumerate(workload)]
    by_id = {r.request_id: r for r in pending}
    if policy == "priority":
        for r in pending:
            r.priority = rng.randrange(3)
    arrivals = [a for _, _, a in workload]
    aborted: set[str] = set()
    in_flight = None

    def collect(step):
        out, sampled = step
        for _, req in sched.update_from_output(out, sampled):
            assert req.num_pending_tokens >= 0
        check_pool(pool, sched)

    for step in range(5000):
        while pending and arrivals[0] <= step % 4:
            sched.add_request(pending.pop(0))
            arrivals.pop(0)
        if not pending and not sched.has_unfinished and in_flight is None:
            break
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(list(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if policy == "priority":  # both queues in urgency order: the running list's last is preempted first
            for queue in (list(sched.waiting), sched.running):
                keys = [(r.priority, r.arrival_time) for r in queue]
                assert keys == sorted(keys)
        # the backlog the mixed-step bound reads is kept as requests change, never recomputed: check it is
        assert sched.prefilling == {r for r in sched.running if r.num_tokens_with_pending - r.num_computed_tokens > 1}
        held = mixed and chunked and sched._holds_prompts_down()
        out = sched.schedule()
        assert out.total_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        if held:
            assert sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1) <= mixed
        for s in out.scheduled:
            assert s.num_tokens >= 1
            assert s.request.num_pending_tokens <= 2  # at most one step in flight besides this one
            # never a step for a token beyond the request's length limits
            total = s.request.num_tokens_with_pending
            assert total - s.request.num_prompt_tokens <= s.request.max_tokens and total <= max_model_len
            if not chunked and s.start < s.request.num_prompt_tokens:
                assert s.start + s.num_tokens == s.request.num_tokens  # the rest of the prompt at once
        launched = (out, [rng.choice([13] + list(range(20))) for s in out.scheduled if s.samples])
        if overlap:
            if in_flight is not None:
                collect(in_flight)
            in_flight = launched if out.scheduled else None
        else:
            collect(launched)
    assert not sched.has_unfinished
    assert pool.num_free_blocks == num_blocks
    for i, (p, o, _) in enumerate(workload):
        req = by_id[str(i)]
        assert req.num_pending_tokens == 0
        if str(i) in aborted:
            continue
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert req.all_token_ids[-1] == 13 and 13 not in req.output_token_ids[:-1]
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert req.num_output_tokens == min(o, max_model_len - p)
            assert i % 2 == 0 or 13 not in req.output_token_ids


def test_block_tables_outgrow_their_array_and_rows_are_reused_clean():
    """Tables are rows of one array that doubles when full; a step's stacked tables are as wide as its longest,
    zero-padded, and a freed row comes back empty for the next request."""
    pool = BlockPool(400, 4, 16, enable_prefix_caching=False)
    reqs = [make_request(str(i), 1 + i % 9, 5) for i in range(40)]  # 1-3 blocks each
    for r in reqs:
        assert pool.allocate_slots(r, r.num_tokens)
    tables = {r.request_id: pool.block_table(r.request_id) for r in reqs}
    assert sorted(b for t in tables.values() for b in t) == list(range(sum(map(len, tables.values()))))
    ids = [r.request_id for r in reqs[::-1]]
    stacked = pool.stacked_tables(ids)
    assert stacked.shape == (40, 3) and stacked.flags.c_contiguous
    for rid, row in zip(ids, stacked.tolist()):
        assert row == tables[rid] + [0] * (3 - len(tables[rid]))
    for r in reqs[:20]:
        pool.free(r)
    late = make_request("late", 2, 5)  # one block, in a row a three-block table held before
    assert pool.allocate_slots(late, late.num_tokens)
    assert pool.stacked_tables(["late"]).tolist() == [pool.block_table("late")] and len(pool.block_table("late")) == 1
    assert len(tables["35"]) == 3 and pool.stacked_tables(["late", "35"]).tolist()[0][1:] == [0, 0]


def test_decode_first_then_fcfs_and_mixed_step():
    pool = BlockPool(100, 4, 16, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64, enable_chunked_prefill=True)
    a, b = make_request("a", 6, 5), make_request("b", 30, 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6), ("b", 4)]
    sched.update_from_output(out, [7])  # a samples, b was a chunk
    out = sched.schedule()
    # a decodes (1 token) and b's prefill continues in the same step with the rest of the budget
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9


def test_prompt_tokens_are_held_down_while_requests_decode_unless_a_backlog_builds_up():
    pool = BlockPool(100, 4, 16, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=12, max_model_len=64, enable_chunked_prefill=True,
                      max_mixed_prefill_tokens=3)
    assert sched.BOUND_STEPS * 3 == 24  # the backlog, in prompt tokens, up to which the bound holds
    for r in (make_request("a1", 2, 9), make_request("a2", 2, 9), make_request("a3", 2, 9), make_request("b", 26, 5)):
        sched.add_request(r)
    out = sched.schedule()  # nothing decodes yet: the whole token budget
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a1", 2), ("a2", 2), ("a3", 2), ("b", 6)]
    sched.update_from_output(out, [7, 7, 7])
    sched.add_request(make_request("c", 2, 5))
    out = sched.schedule()  # decoding, backlog 20 (b) + 2 (c): b's chunk gets the 3 tokens, c waits
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [
        ("a1", 1), ("a2", 1), ("a3", 1), ("b", 3)]
    sched.update_from_output(out, [7, 7, 7])
    sched.add_request(make_request("d", 10, 5))
    out = sched.schedule()  # backlog 17 + 2 + 10 > 24: the bound lifts and the step fills up
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [
        ("a1", 1), ("a2", 1), ("a3", 1), ("b", 9)]


def test_a_held_down_step_ends_on_a_step_size_where_the_bound_allows():
    """With the model's unpadded step sizes known, prompt tokens beside decodes make the step one of them:
    16 decodes + 256 prompt tokens would pad to 320; 16 + 240 is 256. Not where the size above is nearer,
    nor below half the bound."""
    def held_prompt_tokens(decodes: int, sizes: tuple[int, ...]) -> int:
        pool = BlockPool(400, 16, 64, enable_prefix_caching=False)
        sched = Scheduler(pool, max_num_seqs=decodes + 1, max_num_batched_tokens=4096, max_model_len=1024,
                          enable_chunked_prefill=True, max_mixed_prefill_tokens=256, step_sizes=sizes)
        for i in range(decodes):
            sched.add_request(make_request(f"d{i}", 4, 9))
        sched.update_from_output(sched.schedule(), [7] * decodes)
        sched.add_request(make_request("p", 1000, 5))
        out = sched.schedule()
        assert out.num_decode_tokens == decodes
        return out.num_prefill_tokens

    sizes = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
    assert held_prompt_tokens(16, ()) == 256 and held_prompt_tokens(16, sizes) == 240
    assert held_prompt_tokens(64, sizes) == 256  # 320 already
    assert held_prompt_tokens(1, sizes) == 255 and held_prompt_tokens(150, sizes) == 234  # 406 -> 384
    assert held_prompt_tokens(250, sizes) == 256  # 506 pads to 512 by 6: nearer than 448
    assert held_prompt_tokens(300, sizes) == 212  # 556 is past the largest graph: 512 replays one
    assert held_prompt_tokens(100, (128, 512)) == 256  # 128 would leave 28: the bound stands
    # the engine's own sizes (an eighth apart from 256 on): the reference online test's step, 15 decodes beside a
    # prompt, still replays the 256-token graph; 24 decodes take the whole bound into the 288-token graph
    engine_sizes = tuple(prompt_graph_sizes(4096))
    assert held_prompt_tokens(15, engine_sizes) == 241 and held_prompt_tokens(24, engine_sizes) == 256


def test_token_budget_wins_over_sequence_cap():
    pool = BlockPool(100, 4, 16, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=12, max_model_len=64, enable_chunked_prefill=False)
    for i in range(5):
        sched.add_request(make_request(str(i), 5, 3))
    out = sched.schedule()
    assert len(out.scheduled) == 2  # 5 + 5 tokens; a third whole prompt does not fit in 12


def test_preempts_most_recent_and_requeues_at_front():
    pool = BlockPool(4, 4, 4, enable_prefix_caching=False)  # 16 token slots
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, enable_chunked_prefill=True)
    a, b = make_request("a", 8, 8), make_request("b", 8, 8)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), [1, 1])  # both hold 2 blocks, 8 tokens each
    out = sched.schedule()  # a needs a third block: b (admitted last) is preempted
    assert out.preempted == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED


def test_priority_policy_serves_the_urgent_first_and_preempts_the_least_urgent():
    pool = BlockPool(4, 4, 4, enable_prefix_caching=False)  # 16 token slots
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16, enable_chunked_prefill=True,
                      policy="priority")
    low, mid, high = make_request("low", 8, 8), make_request("mid", 8, 8), make_request("high", 4, 8)
    low.priority, mid.priority, high.priority = 5, 1, 0
    sched.add_request(low)
    sched.update_from_output(sched.schedule(), [1])  # low runs alone: 2 blocks
    sched.add_request(mid)
    sched.add_request(high)  # arrived last, most urgent: admitted before mid
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["low", "high"] and list(sched.waiting) == [mid]
    assert sched.running == [high, low]  # urgency order
    sched.update_from_output(out, [1, 1])  # low holds 3 blocks (9 tokens + 1), high 1 (4 + 1): the pool is full
    out = sched.schedule()  # high needs a second block: low, admitted first but least urgent, makes room
    assert out.preempted == ["low"] and [s.request.request_id for s in out.scheduled] == ["high"]
    assert list(sched.waiting) == [mid, low]  # back in the queue by its priority, not at the front
    fcfs = Scheduler(BlockPool(4, 4, 4, enable_prefix_caching=False), 2, 64, 16, True)
    for r in (make_request("a", 4, 1), make_request("b", 4, 1)):
        r.priority = -r.num_prompt_tokens  # ignored under fcfs
        fcfs.add_request(r)
    assert [r.request_id for r in fcfs.waiting] == ["a", "b"]


def test_waiting_request_without_blocks_stops_admission():
    pool = BlockPool(3, 4, 3, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12, enable_chunked_prefill=True)
    big, small = make_request("big", 12, 1), make_request("small", 2, 1)
    sched.add_request(make_request("first", 8, 4))
    sched.update_from_output(sched.schedule(), [0])
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    # "big" cannot get 3 blocks, and FCFS keeps "small" behind it
    assert [s.request.request_id for s in out.scheduled] == ["first"]
    assert list(sched.waiting) == [big, small]


def test_prefix_cache_hits_share_blocks_and_survive_the_first_request():
    pool = BlockPool(20, 4, 16)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=True)
    a = make_request("a", 10, 1)  # blocks [0-3] [4-7] full, [8-9] partial
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), [99])  # a finishes (max_tokens 1); its blocks are freed, cached
    assert pool.num_free_blocks == 20
    b = Request("b", list(range(8)) + [50, 51, 52], SamplingParams(max_tokens=2, ignore_eos=True), (), 2)
    sched.add_request(b)
    out = sched.schedule()
    # b's first 8 tokens are a's two full blocks: only the 3 new tokens are computed
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(8, 3)]
    assert out.prefix_cache_hits == 8 and out.prefix_cache_queries == 11
    a_blocks_reused = pool.block_table("b")[:2]
    c = Request("c", list(range(8)) + [60], SamplingParams(max_tokens=1, ignore_eos=True), (), 1)
    sched.add_request(c)
    sched.update_from_output(out, [7])
    out = sched.schedule()
    assert pool.block_table("c")[:2] == a_blocks_reused  # shared while both run
    assert all(pool.ref_count(blk) == 2 for blk in a_blocks_reused)
    assert [(s.request.request_id, s.start) for s in out.scheduled] == [("b", 11), ("c", 8)]


def test_a_cache_salt_starts_its_own_chain():
    pool = BlockPool(20, 4, 16)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=True)

    def hits(salt: str | None) -> int:
        req = make_request(f"r{len(sched.requests)}-{salt}", 9, 1)
        req.cache_salt = salt
        sched.add_request(req)
        out = sched.schedule()
        sched.update_from_output(out, [1] * len(out.scheduled))
        return out.prefix_cache_hits

    assert [hits(None), hits(None), hits("a"), hits("b"), hits("a"), hits(None)] == [0, 8, 0, 0, 8, 8]


def test_a_full_prompt_hit_still_computes_its_last_token():
    pool = BlockPool(10, 4, 16)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=True)
    sched.add_request(make_request("a", 8, 1))
    sched.update_from_output(sched.schedule(), [1])
    sched.add_request(make_request("b", 8, 1))
    out = sched.schedule()
    # 8 tokens = 2 full cached blocks, but the last token is recomputed for its logits: 1 block hit
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(4, 4)]
