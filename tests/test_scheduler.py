"""The scheduler and the block manager on plain Python objects (no jax, no model): admission,
token budget, chunked prefill, preemption, prefix caching, LRU eviction, aborts and the
invariant that the pool is whole again when idle."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys

import pytest

from pagedjax.config import SchedulerConfig
from pagedjax.engine.interface import SampledToken
from pagedjax.engine.kv_cache_manager import KVCacheManager, hash_block
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams

EOS = 2


def make_sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=True, **kw):
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=kw.pop("max_model_len", 256),
        **kw,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, caching))


def req(rid, n_prompt, max_tokens=4, first=10, priority=0, arrival=None, **params):
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        EOS,
        priority=priority,
        arrival_time=arrival,
    )


def fake_sample(so, sched):
    """Samples token 100 + (tokens known) for every request whose scheduled tokens reach its end."""
    out = {}
    for rid, n in so.num_scheduled_tokens.items():
        r = sched.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            out[rid] = SampledToken(100 + r.num_tokens, 0.0)
    return out


def step(sched):
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_sample(so, sched))


def run_all(sched, max_steps=1000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched))
    raise AssertionError("did not finish")


def assert_pool_whole(sched):
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(c == 0 for c in pool.ref_cnt)
    assert not sched.kv.req_blocks


HOST_SIDE_MODULES = tuple(
    f"pagedjax.engine.{m}"
    for m in (
        "scheduler",
        "kv_cache_manager",
        "request",
        "output_processor",
        "input_processor",
        "interface",
        "forks",
        "detokenizer",
    )
) + ("pagedjax.executor.input_batch",)


def test_engine_host_side_imports_no_jax():
    code = (
        "import sys; "
        + "; ".join(f"import {m}" for m in HOST_SIDE_MODULES)
        + "; bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
        "assert not bad, f'jax imported: {bad[:3]}'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_scheduler_output_carries_no_request():
    """What crosses to the runner is ids, counts and frozen specs: pickling a SchedulerOutput
    of live requests (new, running, forked, preempted) meets no `Request`."""

    class NoRequestPickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Request):
                raise AssertionError(f"a Request crosses the boundary: {obj!r}")
            return None

    s = make_sched(num_blocks=8, block_size=4, budget=16, caching=False)
    parent = req("p", 6, max_tokens=6, bad_words=None, logit_bias={3: 1.0})
    s.add_request(parent)
    s.add_request(req("k", 6, max_tokens=6), fork_of=parent)
    s.add_request(req("q", 9, max_tokens=6, first=40))
    seen_new = seen_cached = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        NoRequestPickler(io.BytesIO()).dump(so)
        seen_new += len(so.scheduled_new_reqs)
        seen_cached += len(so.scheduled_cached_reqs)
        s.update_from_output(so, fake_sample(so, s))
    assert seen_new >= 3 and seen_cached > 0 and s.num_preemptions > 0


def test_prompt_chunks_sum_to_prompt_and_decode_is_one_token():
    s = make_sched(budget=16)
    r = req("a", 40, max_tokens=3)
    s.add_request(r)
    steps = run_all(s)
    assert [so.num_scheduled_tokens["a"] for so, _ in steps] == [16, 16, 8, 1, 1]
    assert [len(progressed) for _, progressed in steps] == [0, 0, 1, 1, 1]  # mid-prefill: none
    assert r.output_token_ids == [140, 141, 142]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_pool_whole(s)


def test_running_decodes_are_served_before_new_prompts():
    s = make_sched(budget=8)
    s.add_request(req("a", 3, max_tokens=10))
    step(s)  # a prefilled, first token sampled
    s.add_request(req("b", 30, max_tokens=2))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}  # b gets what is left of the budget


def test_admission_waits_for_blocks_and_frees_on_finish():
    s = make_sched(num_blocks=9, block_size=4, budget=64, caching=False)  # 8 usable blocks
    for i in range(3):
        s.add_request(req(f"r{i}", 12, max_tokens=4, first=10 * i))  # 4 blocks each at full length
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}  # 3 + 3 blocks; r2 must wait
    assert len(s.waiting) == 1
    max_running = 0
    while s.has_unfinished_requests():
        step(s)
        max_running = max(max_running, len(s.running))
    assert max_running <= 2
    assert_pool_whole(s)


def test_preemption_recomputes_the_most_recent_request_with_the_same_tokens():
    # 6 usable blocks of 4; two requests of 8 prompt tokens growing to 8 + 8 = 16 tokens
    # (4 blocks each) cannot both run to the end.
    s = make_sched(num_blocks=7, block_size=4, budget=64, caching=False)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=50)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        preempted += sorted(so.preempted_req_ids)
    assert preempted and set(preempted) == {"b"}  # b was admitted last
    assert s.num_preemptions == len(preempted) and b.num_preemptions == len(preempted)
    # Outputs are exactly what they would be without preemption.
    assert a.output_token_ids == list(range(108, 116))
    assert b.output_token_ids == list(range(108, 116))
    assert_pool_whole(s)


def test_request_alone_without_room_stops_with_length():
    s = make_sched(num_blocks=3, block_size=4, budget=64, caching=False)  # 8 tokens of room
    r = req("a", 6, max_tokens=10)
    s.add_request(r)
    run_all(s)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.num_tokens == 9  # 8 slots filled; the 9th token was sampled, never stored
    assert_pool_whole(s)


def test_never_fitting_prompt_is_rejected_at_once():
    s = make_sched(num_blocks=5, block_size=4)
    with pytest.raises(ValueError, match="can never be scheduled"):
        s.add_request(req("big", 17))
    assert not s.has_unfinished_requests()


def test_prefix_cache_hits_full_blocks_and_always_computes_the_last_token():
    s = make_sched(block_size=4, budget=64)
    a = req("a", 12, max_tokens=1)
    s.add_request(a)
    run_all(s)
    b = req("b", 12, max_tokens=1)  # same 12 tokens: 3 full blocks cached
    s.add_request(b)
    so, _ = step(s)
    assert b.num_cached_tokens == 8  # 2 blocks reused; the last block holds the last token
    assert so.num_scheduled_tokens["b"] == 4
    c = req("c", 14, max_tokens=1)  # shares the first 12 tokens, then 2 more
    s.add_request(c)
    so, _ = step(s)
    assert c.num_cached_tokens == 12 and so.num_scheduled_tokens["c"] == 2
    st = s.kv.stats
    assert st.hits == 8 + 12 and st.queries == 12 + 12 + 14
    run_all(s)
    assert_pool_whole(s)


def test_shared_prefix_blocks_are_held_once():
    s = make_sched(block_size=4, budget=256)
    for i in range(4):
        s.add_request(req(f"r{i}", 16 + i, max_tokens=3))
    so, _ = step(s)
    blocks = [s.kv.get_block_ids(f"r{i}") for i in range(4)]
    assert all(b[:4] == blocks[0][:4] for b in blocks)  # the 16-token prefix, 4 shared blocks
    pool = s.kv.pool
    assert all(pool.ref_cnt[b] == 4 for b in blocks[0][:4])
    run_all(s)
    assert_pool_whole(s)


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    s = make_sched(num_blocks=7, block_size=4, budget=64)  # 6 usable
    s.add_request(req("a", 8, max_tokens=1, first=10))
    run_all(s)
    s.add_request(req("b", 8, max_tokens=1, first=60))
    run_all(s)
    pool = s.kv.pool
    h_a0 = hash_block(None, list(range(10, 14)))
    h_b0 = hash_block(None, list(range(60, 64)))
    assert pool.lookup(h_a0) is not None and pool.lookup(h_b0) is not None
    s.add_request(req("c", 16, max_tokens=1, first=200))  # needs 5 of the 6 blocks
    step(s)
    assert pool.lookup(h_a0) is None, "a's blocks were freed first and must go first"
    assert pool.lookup(h_b0) is not None
    run_all(s)
    assert_pool_whole(s)


def test_prefix_caching_off_reuses_nothing():
    s = make_sched(block_size=4, budget=64, caching=False)
    for rid in ("a", "b"):
        s.add_request(req(rid, 12, max_tokens=1))
        run_all(s)
    assert s.kv.stats.hits == 0
    assert s.requests == {}


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_every_stage_frees_everything(stage):
    s = make_sched(num_blocks=7, block_size=4, budget=8, caching=False)  # 6 usable blocks
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=50)
    s.add_request(a)
    s.add_request(b)
    if stage == "waiting":
        target = b  # the budget of 8 goes to a's prompt first
        step(s)
        assert b.status == RequestStatus.WAITING
    elif stage == "prefilling":
        target = b
        step(s)
        step(s)  # a decodes (1 token), b prefills 7 of its 8 tokens
        assert b.status == RequestStatus.RUNNING and 0 < b.num_computed_tokens < 8
    elif stage == "decoding":
        target = a
        step(s)
        step(s)
        assert a.num_output_tokens > 0
    else:
        target = b
        while b.num_preemptions == 0:
            step(s)
        assert b.status == RequestStatus.PREEMPTED
    s.finish_requests([target.request_id], RequestStatus.FINISHED_ABORTED)
    assert target.status == RequestStatus.FINISHED_ABORTED
    assert target.request_id not in s.kv.req_blocks
    run_all(s)
    assert_pool_whole(s)


def test_stop_conditions():
    s = make_sched()
    eos = Request("eos", [5, 6], SamplingParams(max_tokens=10), EOS)
    stop_tok = Request("st", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[7]), EOS)
    min_tok = Request("mt", [5, 6], SamplingParams(max_tokens=10, min_tokens=2), EOS)
    for r in (eos, stop_tok, min_tok):
        s.add_request(r)
    so = s.schedule()
    s.update_from_output(
        so,
        {"eos": SampledToken(EOS, 0.0), "st": SampledToken(7, 0.0), "mt": SampledToken(EOS, 0.0)},
    )
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_tok.status == RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 7
    assert min_tok.status == RequestStatus.RUNNING  # EOS before min_tokens is ignored
    so = s.schedule()
    s.update_from_output(so, {"mt": SampledToken(EOS, 0.0)})
    assert min_tok.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_caps_output():
    s = make_sched(max_model_len=10)
    r = req("a", 8, max_tokens=100)
    s.add_request(r)
    run_all(s)
    assert r.num_tokens == 10 and r.status.finish_reason == "length"


def test_priority_policy_serves_smaller_priority_first():
    s = make_sched(budget=64, max_seqs=1, scheduling_policy="priority")
    s.add_request(req("low", 4, max_tokens=1, priority=5, arrival=1.0))
    s.add_request(req("high", 4, max_tokens=1, priority=-1, arrival=2.0))
    s.add_request(req("mid", 4, max_tokens=1, priority=0, arrival=0.5))
    order = [next(iter(so.num_scheduled_tokens)) for so, _ in run_all(s)]
    assert order == ["high", "mid", "low"]


def test_fcfs_policy_serves_in_arrival_order():
    s = make_sched(budget=64, max_seqs=1)
    for rid in ("x", "y", "z"):
        s.add_request(req(rid, 4, max_tokens=1, priority=-ord(rid)))
    order = [next(iter(so.num_scheduled_tokens)) for so, _ in run_all(s)]
    assert order == ["x", "y", "z"]


def test_max_num_seqs_bounds_the_batch():
    s = make_sched(budget=256, max_seqs=3)
    for i in range(7):
        s.add_request(req(f"r{i}", 5, max_tokens=3, first=20 * i))
    for so, _ in run_all(s):
        assert len(so.num_scheduled_tokens) <= 3
        assert so.total_num_scheduled_tokens <= 256


def test_duplicate_request_id_is_rejected():
    s = make_sched()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 4))


def _swap_sched(num_blocks=7, host_blocks=16, **kw):
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=kw.pop("budget", 64),
        max_model_len=256,
        preemption_mode="swap",
        **kw,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, False, num_host_blocks=host_blocks))


def test_swap_preemption_keeps_progress_and_outputs():
    s = _swap_sched()
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=50)
    s.add_request(a)
    s.add_request(b)
    swapped_out, swapped_in = [], []
    while s.has_unfinished_requests():
        so, _ = step(s)
        swapped_out += so.blocks_to_swap_out
        swapped_in += so.blocks_to_swap_in
        if so.blocks_to_swap_out:
            assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens > 0
            assert s.stats().num_swapped_reqs == 1
        if so.blocks_to_swap_in:
            # Resumed where it was: only the tokens not yet computed are scheduled.
            resumed = next(d for d in so.scheduled_new_reqs if d.req_id == "b")
            seq = next(q for q in so.scheduled if q.req_id == "b")
            assert seq.num_computed_tokens > 0
            assert seq.num_computed_tokens + len(seq.token_ids) == len(resumed.token_ids)
    assert swapped_out and len(swapped_in) == len(swapped_out)
    assert b.num_preemptions >= 1
    assert a.output_token_ids == list(range(108, 116))
    assert b.output_token_ids == list(range(108, 116))
    assert_pool_whole(s)
    assert s.kv.host_pool.num_free_blocks == s.kv.host_pool.num_usable_blocks


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s = _swap_sched(host_blocks=1)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=50)
    s.add_request(a)
    s.add_request(b)
    run_all(s)
    assert b.num_preemptions >= 1 and s.kv.req_host_blocks == {}
    assert b.output_token_ids == list(range(108, 116))
    assert_pool_whole(s)


def test_abort_while_swapped_frees_host_blocks():
    s = _swap_sched()
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, first=50)
    s.add_request(a)
    s.add_request(b)
    while b.status != RequestStatus.SWAPPED:
        step(s)
    assert s.kv.req_host_blocks["b"]
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.host_pool.num_free_blocks == s.kv.host_pool.num_usable_blocks
    run_all(s)
    assert_pool_whole(s)


def test_fork_shares_prompt_blocks_and_copies_the_partial_block_on_write():
    s = make_sched(block_size=4, budget=64, caching=False)
    parent = req("p", 10, max_tokens=3)  # blocks: [0-3] [4-7] [8-9 + outputs]
    s.add_request(parent)
    kids = [req(f"k{i}", 10, max_tokens=3) for i in range(3)]
    for k in kids:
        s.add_request(k, fork_of=parent)
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["p"]  # the siblings wait for the prompt
    table = list(s.kv.get_block_ids("p"))
    pool = s.kv.pool
    assert all(pool.ref_cnt[b] == 4 for b in table)  # forked: every prompt block shared by 4
    so, _ = step(s)
    # Each writer of the shared partial block gets its own copy first; the last one keeps it.
    assert so.num_scheduled_tokens == {"p": 1, "k0": 1, "k1": 1, "k2": 1}
    assert len(so.blocks_to_copy) == 3
    assert {src for src, _ in so.blocks_to_copy} == {table[2]}
    full = table[:2]
    assert all(pool.ref_cnt[b] == 4 for b in full)  # full prompt blocks stay shared, once
    tables = [s.kv.get_block_ids(r) for r in ("p", "k0", "k1", "k2")]
    assert len({t[2] for t in tables}) == 4  # four distinct last blocks
    cow = {c.req_id: c.replaced_block_ids for c in so.scheduled_cached_reqs}
    assert cow["p"] == ((2, s.kv.get_block_ids("p")[2]),)
    held = {b for t in tables for b in t}
    assert len(held) == 2 + 4  # 2 shared full blocks + 4 last blocks
    run_all(s)
    assert_pool_whole(s)


def test_fork_parent_aborted_before_prefill_hands_over_to_a_sibling():
    s = make_sched(block_size=4, budget=4, max_seqs=2, caching=False)
    parent = req("p", 10, max_tokens=2)
    s.add_request(parent)
    kid = req("k", 10, max_tokens=2)
    s.add_request(kid, fork_of=parent)
    step(s)  # parent mid-prefill
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    run_all(s)
    assert kid.output_token_ids == [110, 111]
    assert_pool_whole(s)


def test_prompt_tokens_computed_counts_only_what_runs():
    s = make_sched(block_size=4, budget=64)
    s.add_request(req("a", 13, max_tokens=2))
    run_all(s)
    assert s.stats().prompt_tokens_computed == 13
    s.add_request(req("b", 13, max_tokens=2))
    run_all(s)
    assert s.stats().prompt_tokens_computed == 13 + 1  # 12 tokens hit the cache
