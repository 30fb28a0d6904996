"""Structured outputs through the engine (tiny random models): every sampled token of a
constrained request is one its grammar allows at that point, checked against an independent
llguidance matcher built here from the constraint (not the engine's), and every step's
bitmask row the engine sent is exactly that matcher's mask; for JSON schema, regex, choice,
Lark and GBNF grammars, greedy and sampled, n = 3, under preemption and with prefix-cache
hits. Bad constraints are refused with InvalidInputError(param="structured_outputs") while
other requests finish untouched; a grammar that fails late ends only its request."""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import weakref

import jsonschema_rs
import llguidance as llg
import llguidance.hf
import llguidance.numpy as llg_np
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.errors import InvalidInputError
from pagedjax.executor.model_runner import compile_count
from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output import compilation
from pagedjax.structured_output import grammar as grammar_mod
from pagedjax.structured_output import manager as manager_mod

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
        "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["id", "tag", "ok", "xs", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,4}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = """
start: "(" pair ("," pair)? ")"
pair: NUM ":" WORD
NUM: /[0-9]{1,2}/
WORD: /[xyz]{1,3}/
"""
LARK_RE = r"\([0-9]{1,2}:[xyz]{1,3}(,[0-9]{1,2}:[xyz]{1,3})?\)"
GBNF = 'root ::= "[" num "," num "]"\nnum ::= [0-9] [0-9]?'
GBNF_RE = r"\[[0-9][0-9]?,[0-9][0-9]?\]"

CONSTRAINTS = {
    "json": SO(json=SCHEMA, whitespace_pattern=""),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "lark": SO(grammar=LARK),
    "gbnf": SO(grammar=GBNF),
}


def output_is_valid(kind: str, text: str) -> bool:
    """The finished output satisfies its constraint (checked without llguidance)."""
    if kind == "json":
        jsonschema_rs.validate(SCHEMA, json.loads(text))
        return True
    pattern = {"regex": REGEX, "lark": LARK_RE, "gbnf": GBNF_RE}.get(kind)
    if pattern is not None:
        return re.fullmatch(pattern, text) is not None
    return text in CHOICES


def independent_grammar(so: SO) -> str:
    """The constraint as llguidance grammar text, built here without the engine's code."""
    if so.json is not None:
        return llg.LLMatcher.grammar_from_json_schema(
            so.json, defaults={"whitespace_pattern": so.whitespace_pattern}
        )
    if so.regex is not None:
        return llg.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice)
        )
    return llg.grammar_from("grammar", so.grammar)


class StepRecorder:
    """Wraps the runner's `execute`: records, per (request id, output index), the bitmask row
    the scheduler sent and the token sampled; checks that rows which sample nothing (prefill
    chunks before the last) carry no mask, and counts them."""

    def __init__(self, llm):
        self.runner = llm.llm_engine.runner
        self.scheduler = llm.llm_engine.scheduler
        self.inner = self.runner.execute
        self.rows: dict[tuple[str, int], tuple[np.ndarray | None, int]] = {}
        self.num_masked_steps = 0
        self.num_constrained_chunks = 0  # constrained rows mid-prefill (no sample, no mask)
        self.runner.execute = self

    def __call__(self, so):
        result = self.inner(so)
        if so.grammar_bitmask is not None:
            self.num_masked_steps += 1
        for i, seq in enumerate(so.scheduled):
            tok = result.sampled.get(seq.req_id)
            if tok is None:
                assert not seq.samples
                if so.grammar_bitmask is not None:
                    assert (so.grammar_bitmask[i] == -1).all()
                req = self.scheduler.requests.get(seq.req_id)
                self.num_constrained_chunks += req is not None and req.structured_output is not None
                continue
            row = None if so.grammar_bitmask is None else so.grammar_bitmask[i].copy()
            key = (seq.req_id, seq.num_output_tokens)
            assert key not in self.rows, f"{key} sampled twice"
            self.rows[key] = (row, tok.token_id)
        return result

    def close(self):
        self.runner.execute = self.inner


def check_sequence(lltok, so: SO, req_id: str, token_ids: list[int], rec: StepRecorder):
    """Every token of the output is allowed by a fresh matcher at its point, and the engine's
    mask row there equals that matcher's mask. Returns whether the grammar is complete."""
    m = llg.LLMatcher(lltok, independent_grammar(so), log_level=0)
    assert not m.is_error(), m.get_error()
    want = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
    for k, tok in enumerate(token_ids):
        row, sampled = rec.rows[(req_id, k)]
        assert sampled == tok
        llg_np.fill_next_token_bitmask(m, want, 0)
        assert row is not None, f"{req_id} token {k} was drawn without a mask"
        np.testing.assert_array_equal(row, want[0], err_msg=f"{req_id} mask at token {k}")
        assert (want[0, tok // 32] >> (tok % 32)) & 1, f"{req_id} token {k} ({tok}) not allowed"
        assert m.consume_token(tok), m.get_error()
    return m.is_stopped()


@pytest.fixture(scope="module")
def llm(make_llm, tiny_llama_dir):
    # 26 blocks of 4 tokens (104 tokens): 8 requests of ~90 tokens cannot all run at once.
    return make_llm(tiny_llama_dir, block_size=4, num_gpu_blocks_override=27, enforce_eager=False)


@pytest.fixture(scope="module")
def lltok(llm):
    return llguidance.hf.from_tokenizer(llm.get_tokenizer(), n_vocab=320)


@pytest.fixture
def recorder(llm):
    rec = StepRecorder(llm)
    yield rec
    rec.close()


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
    """Token ids of printable ASCII text (the byte tokens 'a'..'z' and ' '), so that the text
    of the outputs is the constraint's alone."""
    rng = np.random.default_rng(seed)
    ascii_ids = list(range(67, 93)) + [223]  # 'a'..'z' and ' ' (byte-level alphabet order)
    return [rng.choice(ascii_ids, size=int(k)).tolist() for k in rng.integers(lo, hi, size=n)]


def _assert_pool_whole(llm):
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_token_is_allowed_and_outputs_match(llm, lltok, recorder, kind, temperature):
    so = CONSTRAINTS[kind]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=60, structured_outputs=so)
    before = compile_count()
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(4, 1)], params, use_tqdm=False)
    assert compile_count() == before  # the bitmask adds no shape: nothing compiles
    for o in outs:
        c = o.outputs[0]
        complete = check_sequence(lltok, so, o.request_id, c.token_ids, recorder)
        # Finite grammars: each completes within 60 tokens and then stops ("stop", no EOS).
        assert complete and c.finish_reason == "stop", (c.text, c.finish_reason)
        assert output_is_valid(kind, c.text), c.text
    _assert_pool_whole(llm)


def test_json_object_tokens_are_allowed(llm, lltok, recorder):
    """json_object: any object, unbounded, so a random model's output is cut by max_tokens;
    every token it drew is allowed, the output starts an object, and a complete one parses."""
    so = SO(json_object=True)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured_outputs=so)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(3, 4)], params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        complete = check_sequence(
            lltok, SO(json={"type": "object"}), o.request_id, c.token_ids, recorder
        )
        assert c.text.lstrip().startswith("{")
        if complete:
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 30


def test_n3_samples_each_follow_the_grammar(llm, lltok, recorder):
    so = CONSTRAINTS["json"]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=60, structured_outputs=so)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert check_sequence(lltok, so, f"{c.index}_{out.request_id}", c.token_ids, recorder)
        jsonschema_rs.validate(SCHEMA, json.loads(c.text))
    assert len({c.text for c in out.outputs}) > 1  # each sample its own draws and matcher


def test_under_preemption_and_with_prefix_hits(llm, lltok, recorder, hf_greedy_cache):
    """Eight constrained requests of 20-34 prompt tokens and up to 70 output tokens in a pool
    of 104 tokens force preemptions (recompute); the same prompts again hit the prefix cache.
    Unconstrained requests in the same batches keep Hugging Face's greedy output."""
    sched = llm.llm_engine.scheduler
    preempted, hits = sched.num_preemptions, sched.stats().prefix_cache_hits
    prompts = _prompts(8, 2, 20, 35)
    kinds = ["json", "regex", "lark", "gbnf"] * 2
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=70, structured_outputs=CONSTRAINTS[k])
        for i, k in enumerate(kinds)
    ]
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    free = _prompts(2, 9)
    for _ in range(2):
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts + free],
            params + [plain, plain],
            use_tqdm=False,
        )
        for o, kind in zip(outs, kinds, strict=False):
            c = o.outputs[0]
            assert check_sequence(lltok, CONSTRAINTS[kind], o.request_id, c.token_ids, recorder)
            assert c.finish_reason == "stop" and output_is_valid(kind, c.text), c.text
        for o, p in zip(outs[8:], free, strict=True):
            assert o.outputs[0].token_ids == hf_greedy_cache(p, 10)
            assert all(
                recorder.rows[(o.request_id, k)][0] is None
                or (recorder.rows[(o.request_id, k)][0] == -1).all()
                for k in range(10)
            )
    assert sched.num_preemptions > preempted
    assert sched.stats().prefix_cache_hits > hits
    assert recorder.num_constrained_chunks > 0  # chunked prefills (recomputes) of constrained
    _assert_pool_whole(llm)


@pytest.mark.parametrize(
    "so",
    [
        dict(json={"type": "object", "properties": {"a": {"type": "foo"}}}),
        dict(json={"type": "integer", "minimum": 5, "maximum": 2}),
        dict(json="{not json"),
        dict(regex="[a-"),
        dict(grammar='start: "a" ('),
        dict(grammar='root ::= "a" undefined_rule'),
        dict(json={"type": "object", "default": {1, 2}}),
    ],
    ids=["schema-type", "schema-unsatisfiable", "schema-text", "regex", "lark", "gbnf", "not-json"],
)
def test_bad_constraints_are_refused_and_others_finish(llm, so, hf_greedy_cache):
    eng = llm.llm_engine
    prompt = [9, 10, 11]
    eng.add_request(
        "ok",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    with pytest.raises(InvalidInputError) as e:
        eng.add_request(
            "bad", {"prompt_token_ids": prompt}, SamplingParams(structured_outputs=SO(**so))
        )
    assert e.value.param == "structured_outputs"
    assert "structured_outputs" in str(e.value)
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"]
    assert done[0].outputs[0].token_ids == hf_greedy_cache(prompt, 8)


def test_empty_choice_is_refused():
    with pytest.raises(InvalidInputError) as e:
        SO(choice=[])
    assert e.value.param == "structured_outputs"


def test_late_compile_error_ends_only_that_request(llm, hf_greedy_cache):
    """A schema too large to validate when added, with an error deep inside, fails on the
    worker pool: it ends with finish_reason "error" and the reason; the other request runs."""
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{3}"} for i in range(600)}
    props["broken"] = {"type": "no-such-type"}
    big = SO(json={"type": "object", "properties": props})
    assert len(grammar_mod.grammar_text(big)) > grammar_mod.SYNC_VALIDATION_MAX_CHARS
    eng = llm.llm_engine
    prompt = [12, 13, 14]
    eng.add_request(
        "ok",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    eng.add_request(
        "late", {"prompt_token_ids": prompt}, SamplingParams(n=2, structured_outputs=big)
    )
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    late = done["late"]
    assert [c.finish_reason for c in late.outputs] == ["error", "error"]
    # the JSON-schema compiler's reason alone: not the Lark form's source line (the schema)
    assert late.outputs[0].stop_reason.endswith(
        "the grammar does not compile: Invalid type: no-such-type"
    )
    assert len(late.outputs[0].stop_reason) < 200
    assert done["ok"].outputs[0].token_ids == hf_greedy_cache(prompt, 8)
    _assert_pool_whole(llm)


def test_llguidance_tokenizer_is_built_at_start_up(make_llm, tiny_llama_dir, monkeypatch):
    """The llguidance tokenizer (whose conversion holds the GIL) is built once, on the
    normal-priority compile thread (not the idle class), when the engine starts: a first
    constrained request then builds nothing on its way in.
    (Before, the first constrained request started it, stalling the running streams.)"""
    from pagedjax.structured_output import manager as manager_mod

    built, where = [], []
    real = manager_mod.StructuredOutputManager._build_tokenizer

    def build(self):
        built.append(1)
        if hasattr(os, "SCHED_IDLE"):
            tid = threading.get_native_id()
            where.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, tid)))
        return real(self)

    monkeypatch.setattr(manager_mod.StructuredOutputManager, "_build_tokenizer", build)
    llm = make_llm(tiny_llama_dir, block_size=4)
    mgr = llm.llm_engine.structured_output
    assert mgr._tokenizer.result(timeout=30) is not None and built == [1]
    if hasattr(os, "SCHED_IDLE"):  # not in the idle class: it holds the GIL throughout
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert where == [(os.SCHED_OTHER, min(nice + compilation.WORKER_NICENESS, 19))]
    sp = SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(regex="a[0-9]{2}"))
    (out,) = llm.generate([{"prompt_token_ids": [20, 21]}], sp, use_tqdm=False)
    assert re.fullmatch("a[0-9]{2}", out.outputs[0].text) and built == [1]


def test_slow_grammar_waits_alone(llm, monkeypatch):
    """While one request's grammar compiles (held here until released), another request keeps
    receiving a token every step; the held request then runs constrained. The Prometheus
    gauge counts the waiting request; the histograms count the compilation and the fills."""
    from pagedjax.engine.prometheus import PrometheusStatLogger

    metrics = PrometheusStatLogger("tiny")
    mgr = llm.llm_engine.structured_output
    release = threading.Event()
    compile_ = mgr._compile

    def slow(text):
        assert release.wait(30)
        return compile_(text)

    monkeypatch.setattr(mgr, "_compile", slow)
    eng = llm.llm_engine
    so = SO(regex="slow-[0-9]{3}")
    eng.add_request(
        "free",
        {"prompt_token_ids": [20, 21]},
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    eng.add_request(
        "slow",
        {"prompt_token_ids": [22, 23]},
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=so),
    )
    got = {}
    for _ in range(6):
        for o in eng.step():
            got[o.request_id] = o
    assert len(got["free"].outputs[0].token_ids) == 6  # one token per step while it waits
    assert "slow" not in got
    assert eng.scheduler.stats().num_waiting_for_grammar == 1
    metrics.record_scheduler_stats(eng.scheduler.stats(), 0)
    assert _metric(metrics, "pagedjax:num_requests_waiting_for_grammar") == 1
    mgr.take_timings()
    release.set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = o
    assert re.fullmatch("slow-[0-9]{3}", got["slow"].outputs[0].text)
    assert got["slow"].outputs[0].finish_reason == "stop"
    metrics.record_scheduler_stats(eng.scheduler.stats(), 0)
    metrics.record_grammar_timings(*mgr.take_timings())
    assert _metric(metrics, "pagedjax:num_requests_waiting_for_grammar") == 0
    assert _metric(metrics, "pagedjax:grammar_compile_seconds_count") == 1
    # one fill per token of "slow-ddd" (8 byte tokens); it ends with the grammar, no EOS step
    assert _metric(metrics, "pagedjax:grammar_bitmask_seconds_count") == 8


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_grammars_compile_in_the_idle_class_while_steps_run(llm, monkeypatch):
    """While another request runs, a grammar compiles (held here) on a thread of Linux's idle
    class, so that it takes only CPU time the steps leave, and is not expedited before
    EXPEDITE_AFTER_S; released, the constrained request runs to its grammar. (Before, the
    compile ran at normal priority, nice + 10.)"""
    seen, started, release = [], threading.Event(), threading.Event()
    real = manager_mod.llg.LLMatcher

    class Held:  # LLMatcher, recording the scheduling class of the thread that builds one
        def __call__(self, *args, **kw):
            seen.append(os.sched_getscheduler(0))
            started.set()
            assert release.wait(30)
            return real(*args, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(manager_mod.llg, "LLMatcher", Held())
    eng = llm.llm_engine
    busy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("busy", {"prompt_token_ids": [30, 31, 32]}, busy)
    so = SO(regex="idle-[0-9]{2}")
    sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs=so)
    eng.add_request("held", {"prompt_token_ids": [33, 34]}, sp)
    done = {}
    try:
        assert started.wait(30)
        for _ in range(3):
            done.update({o.request_id: o for o in eng.step() if o.finished})
        held = eng.scheduler.requests["held"].structured_output
        assert seen == [os.SCHED_IDLE] and not held.compilation.expedited
    finally:
        release.set()
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert re.fullmatch("idle-[0-9]{2}", done["held"].outputs[0].text)
    _assert_pool_whole(llm)


def _metric(metrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_device_mask_matches_llguidance_reference():
    from pagedjax.ops.bitmask import apply_token_bitmask

    rng = np.random.default_rng(0)
    V = 100
    logits = rng.standard_normal((3, V)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    mask[1] = -1
    want = logits.copy()
    llg_np.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(apply_token_bitmask(logits, mask))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[1]).all()


@pytest.fixture(scope="module")
def smol_llm(make_llm, smol_vocab_dir):
    return make_llm(smol_vocab_dir, block_size=16, max_model_len=128)


def test_json_with_a_real_bpe_vocabulary(smol_llm):
    """SmolLM2's 49,152-token BPE vocabulary (tokens spanning several JSON characters)."""
    rec = StepRecorder(smol_llm)
    try:
        lltok = llguidance.hf.from_tokenizer(smol_llm.get_tokenizer(), n_vocab=49152)
        so = CONSTRAINTS["json"]
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=80, structured_outputs=so)
        outs = smol_llm.generate(["Give me a record:", "JSON please"], params, use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert check_sequence(lltok, so, o.request_id, c.token_ids, rec)
            assert c.finish_reason == "stop"
            jsonschema_rs.validate(SCHEMA, json.loads(c.text))
    finally:
        rec.close()


def test_a_grammar_evicted_while_its_request_runs_is_freed_off_the_engine_thread(llm, monkeypatch):
    """With a cache of one, a running request's grammar is evicted by another request's; when
    the first request ends, its grammar (the compilation, and the request's own matcher, which
    shares its parts) is freed on the normal-priority compile thread, not on the thread that
    steps the engine (freeing a 400-object schema's grammar holds the GIL 8-13 ms). It was
    freed on the engine thread (or by the cyclic collector, wherever that ran)."""
    monkeypatch.setattr(manager_mod, "CACHE_SIZE", 1)
    eng = llm.llm_engine
    mgr = eng.structured_output
    freed: list[str] = []

    def params(regex: str) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=6, structured_outputs=SO(regex=regex))

    was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting, where the last reference goes
    try:
        eng.add_request("first", {"prompt_token_ids": [40, 41]}, params("[a-c]{6}"))
        while not eng.scheduler.requests["first"].output_token_ids:
            eng.step()
        so = eng.scheduler.requests["first"].structured_output
        assert so.matcher is not None
        weakref.finalize(so.compilation, lambda: freed.append(threading.current_thread().name))
        eng.add_request("second", {"prompt_token_ids": [42]}, params("[d-f]{6}"))
        assert all(c is not so.compilation for c in mgr._cache.values())  # evicted
        while eng.has_unfinished_requests():
            eng.step()
        mgr._pools.normal.submit(lambda: None).result(30)  # after the releases' tasks
    finally:
        if was_enabled:
            gc.enable()
    assert so.compilation is None and so.matcher is None
    assert len(freed) == 1 and freed[0].startswith(compilation.NORMAL_THREAD_NAME), freed
    _assert_pool_whole(llm)


def test_constraint_is_read_once_when_added(llm, monkeypatch):
    """A request's schema is turned into grammar text once, when it is added (the engine
    never reads the user's dict again: changing it afterwards changes nothing); equal
    schemas in separate dicts compile once; `SamplingParams.clone` shares the constraint
    instead of deep-copying it (a large schema cost a decode step to copy)."""
    eng = llm.llm_engine
    mgr = eng.structured_output
    calls = []
    text_of = grammar_mod.grammar_text

    def counted(so):
        calls.append(so.kind)
        return text_of(so)

    monkeypatch.setattr(grammar_mod, "grammar_text", counted)
    monkeypatch.setattr(manager_mod, "grammar_text", counted)  # the manager's own name for it
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["once"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=SO(json=schema, whitespace_pattern="")
    )
    assert params.clone().structured_outputs is params.structured_outputs
    assert params.clone().stop is not params.stop
    compiles = mgr.stats["compiles"]
    eng.add_request("a", {"prompt_token_ids": [30, 31]}, params)
    copy_params = SamplingParams(
        temperature=0,
        max_tokens=24,
        structured_outputs=SO(json=json.loads(json.dumps(schema)), whitespace_pattern=""),
    )
    eng.add_request("b", {"prompt_token_ids": [32, 33]}, copy_params)
    assert calls == ["json", "json"]  # one per request, none for the cache key or the pool
    schema["properties"]["k"]["enum"] = ["changed"]  # after add_request: no effect
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert mgr.stats["compiles"] == compiles + 1
    for rid in "ab":
        out = done[rid].outputs[0]
        assert out.finish_reason == "stop", out
        assert json.loads(out.text) == {"k": "once"}
    _assert_pool_whole(llm)
