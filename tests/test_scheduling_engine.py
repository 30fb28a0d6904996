"""Scheduler features through the whole engine on the tiny model, checked against Hugging
Face greedy outputs: prefix caching on and off, token budgets, preemption by recompute and by
swap, shared prefixes under memory pressure, n > 1 forks, and never-fitting requests."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_whole(llm):
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(c == 0 for c in pool.ref_cnt)
    host = llm.llm_engine.kv_cache_manager.host_pool
    if host is not None:
        assert host.num_free_blocks == host.num_usable_blocks


@pytest.fixture(scope="module")
def block_multiple_prompts():
    rng = np.random.default_rng(99)
    return [rng.integers(3, 259, size=n).tolist() for n in (16, 32, 48)]


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=16, enable_prefix_caching=True),
        dict(max_num_batched_tokens=64, enable_prefix_caching=True),
        dict(max_num_batched_tokens=64, enable_prefix_caching=False),
        dict(max_num_batched_tokens=512, enable_prefix_caching=True),
    ],
    ids=["budget16", "budget64", "budget64-nocache", "budget512"],
)
def test_greedy_identical_across_budgets_and_prefix_caching(
    make_llm, tiny_llama_dir, prompts8, block_multiple_prompts, hf_greedy_cache, config
):
    llm = make_llm(tiny_llama_dir, block_size=16, **config)
    # Prompts whose length is a multiple of the block size, sent twice: the second time the
    # whole prompt is cached and only its last token is recomputed.
    prompts = prompts8 + block_multiple_prompts + block_multiple_prompts
    for p, got in zip(prompts, _run(llm, prompts), strict=True):
        assert got == hf_greedy_cache(p, 10), f"prompt of {len(p)} tokens"
    again = _run(llm, block_multiple_prompts)
    assert again == [hf_greedy_cache(p, 10) for p in block_multiple_prompts]
    stats = llm.llm_engine.scheduler.stats()
    if config["enable_prefix_caching"]:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    _assert_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(make_llm, tiny_llama_dir, prompts8, hf_greedy_cache, mode):
    # 26 blocks of 4 tokens: the longest request (90 + 10) just fits alone.
    llm = make_llm(
        tiny_llama_dir,
        block_size=4,
        num_gpu_blocks_override=27,
        enable_prefix_caching=False,
        preemption_mode=mode,
        swap_space=0.01,
    )
    got = _run(llm, prompts8)
    assert got == [hf_greedy_cache(p, 10) for p in prompts8]
    sched = llm.llm_engine.scheduler
    assert sched.stats().num_preemptions > 0
    assert (sched.num_swap_outs > 0) == (mode == "swap")
    _assert_whole(llm)


def test_shared_prefix_under_memory_pressure(make_llm, tiny_llama_dir, hf_greedy_cache):
    """32 requests sharing a 48-token prefix; the pool holds about 3 of them at full length."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 259, size=48).tolist()
    prompts = [
        prefix + rng.integers(3, 259, size=int(n)).tolist() for n in rng.integers(1, 17, size=32)
    ]
    # Full length: at most 48 + 16 + 8 = 72 tokens = 5 blocks of 16; 3 of them: 15 blocks.
    llm = make_llm(tiny_llama_dir, block_size=16, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = _run(llm, prompts, params)
    assert got == [hf_greedy_cache(p, 8) for p in prompts]
    stats = llm.llm_engine.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    _assert_whole(llm)


def test_second_pass_hits_the_prefix_cache_and_computes_fewer_prompt_tokens(
    make_llm, tiny_llama_dir, prompts8
):
    llm = make_llm(tiny_llama_dir, block_size=16)
    sched = llm.llm_engine.scheduler
    first = _run(llm, prompts8)
    s1 = sched.stats()
    second = _run(llm, prompts8)
    s2 = sched.stats()
    assert second == first
    total = sum(len(p) for p in prompts8)
    assert s1.prompt_tokens_computed == total
    cached_blocks = sum((len(p) - 1) // 16 for p in prompts8)  # full blocks, last token aside
    assert s2.prompt_tokens_computed - s1.prompt_tokens_computed == total - 16 * cached_blocks
    hits = s2.prefix_cache_hits - s1.prefix_cache_hits
    queries = s2.prefix_cache_queries - s1.prefix_cache_queries
    assert hits == 16 * cached_blocks and queries == total and hits / queries > 0.5


def test_n4_uses_the_prompt_blocks_once(make_llm, tiny_llama_dir, prompts8):
    llm = make_llm(tiny_llama_dir, block_size=16, enable_prefix_caching=False)
    eng = llm.llm_engine
    prompt = prompts8[5]  # 47 tokens: 2 full blocks and a partly filled third
    eng.add_request(
        "n4",
        {"prompt_token_ids": prompt},
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
    )
    kv = eng.kv_cache_manager
    eng.step()  # the first sample computes the prompt; the others fork its blocks
    tables = [kv.get_block_ids(f"{i}_n4") for i in range(4)]
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert all(kv.pool.ref_cnt[b] == 4 for b in tables[0][:3])
    assert kv.pool.num_usable_blocks - kv.pool.num_free_blocks == 3  # the prompt, once
    eng.step()  # each sample writes its second token: the shared last block is copied
    tables = [kv.get_block_ids(f"{i}_n4") for i in range(4)]
    assert all(kv.pool.ref_cnt[b] == 4 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4
    assert kv.pool.num_usable_blocks - kv.pool.num_free_blocks == 2 + 4
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    samples = [o.token_ids for o in outs[0].outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    _assert_whole(llm)


def test_n4_greedy_samples_equal_the_single_greedy_output(
    make_llm, tiny_llama_dir, prompts8, hf_greedy_cache
):
    """Forked samples read the shared blocks and their own copies correctly: greedy n = 4
    gives the HF greedy output four times."""
    llm = make_llm(tiny_llama_dir, block_size=16, enable_prefix_caching=False)
    for p in (prompts8[2], prompts8[5], prompts8[7]):
        out = llm.generate(
            {"prompt_token_ids": p},
            SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert [o.token_ids for o in out.outputs] == [hf_greedy_cache(p, 10)] * 4
    _assert_whole(llm)


def test_never_fitting_request_is_rejected_while_others_complete(
    make_llm, tiny_llama_dir, prompts8, hf_greedy_cache
):
    llm = make_llm(tiny_llama_dir, block_size=16, num_gpu_blocks_override=8)  # 112 tokens
    eng = llm.llm_engine
    small = [p[:20] for p in prompts8]
    for i, p in enumerate(small):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    with pytest.raises(ValueError, match="can never be scheduled"):
        eng.add_request("huge", {"prompt_token_ids": [7] * 120}, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done == {str(i): hf_greedy_cache(p, 10) for i, p in enumerate(small)}
    _assert_whole(llm)
