"""`LLM.get_metrics()` (vLLM's offline metrics): the server's Prometheus metrics for an
offline LLM's requests, as `metrics_reader` objects; and the reader itself on a hand-built
registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from pagedjax import LLM, SamplingParams
from pagedjax.engine.metrics_reader import (
    Counter,
    Gauge,
    Histogram,
    Vector,
    get_metrics_snapshot,
)

PROMPTS = [[10, 11, 12], [40, 41, 42, 43, 44], [7, 8, 9, 10]]


def _by_name(metrics) -> dict:
    """name -> the series without a finished_reason label, or that of "length"."""
    out = {}
    for m in metrics:
        if m.labels.get("finished_reason", "length") == "length":
            out[m.name] = m
    return out


def test_get_metrics_counts_an_offline_runs_requests_and_tokens(make_llm, tiny_llama_dir):
    """Three requests (one with n=2) of 5 tokens each: 3 successes, 20 generated tokens, the
    prompts' 12 tokens, 3 time-to-first-token observations, nothing running after; every
    histogram's buckets are cumulative and end at "+Inf" = count."""
    llm = make_llm(tiny_llama_dir, disable_log_stats=False)
    before = _by_name(llm.get_metrics())
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 3
    params[1] = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    metrics = llm.get_metrics()
    after = _by_name(metrics)

    def gained(name):
        a, b = after[name], before.get(name)
        if isinstance(a, Histogram):
            return a.count - (b.count if b else 0)
        return a.value - (b.value if b else 0)

    assert isinstance(after["vllm:request_success"], Counter)
    assert gained("vllm:request_success") == 3
    assert gained("vllm:generation_tokens") == 20
    assert gained("vllm:prompt_tokens") == sum(map(len, PROMPTS))
    assert gained("vllm:time_to_first_token_seconds") == 3
    assert gained("vllm:e2e_request_latency_seconds") == 3
    assert isinstance(after["vllm:num_requests_running"], Gauge)
    assert after["vllm:num_requests_running"].value == 0
    assert after["vllm:kv_cache_usage_perc"].value == 0
    for m in metrics:
        if isinstance(m, Histogram):
            counts = list(m.buckets.values())
            assert counts == sorted(counts) and list(m.buckets)[-1] == "+Inf"
            assert m.buckets["+Inf"] == m.count
    assert all(m.name.startswith(("vllm:", "pagedjax:")) for m in metrics)


def test_get_metrics_needs_stats():
    llm = object.__new__(LLM)
    llm._metrics = None  # LLM(..., disable_log_stats=True)
    with pytest.raises(RuntimeError, match="disable_log_stats"):
        llm.get_metrics()


def test_the_reader_on_a_hand_built_registry():
    reg = CollectorRegistry()
    c = PromCounter("vllm:things", "", ["model_name"], registry=reg)
    c.labels(model_name="m").inc(3)
    PromGauge("pagedjax:level", "", registry=reg).set(0.25)
    PromGauge("other:skipped", "", registry=reg).set(1)
    h = PromHistogram("vllm:latency", "", buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    pos = PromCounter(
        "vllm:spec_decode_num_accepted_tokens_per_pos", "", ["position"], registry=reg
    )
    pos.labels(position="0").inc(5)
    pos.labels(position="2").inc(1)
    got = {m.name: m for m in get_metrics_snapshot(reg)}
    assert got["vllm:things"] == Counter("vllm:things", {"model_name": "m"}, 3)
    assert got["pagedjax:level"] == Gauge("pagedjax:level", {}, 0.25)
    assert "other:skipped" not in got
    assert got["vllm:latency"] == Histogram(
        "vllm:latency", {}, 4, pytest.approx(4.25), {"0.1": 1, "1.0": 3, "+Inf": 4}
    )
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos == Vector(per_pos.name, {}, [5, 0, 1])


def test_from_engine_args_builds_from_every_field(monkeypatch):
    """vLLM's `LLM.from_engine_args(EngineArgs(...))`: the engine gets the same arguments."""
    from pagedjax import EngineArgs
    from pagedjax import llm as llm_module

    seen = []
    monkeypatch.setattr(llm_module, "create_engine", lambda args, use_tqdm: seen.append(args))
    args = EngineArgs(model="m", max_model_len=77, block_size=8, disable_log_stats=True)
    LLM.from_engine_args(args)
    assert seen == [args]
