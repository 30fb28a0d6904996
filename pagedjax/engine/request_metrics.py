"""Prometheus metrics from the engine's outputs and its schedulers' stats, as `AsyncLLM`'s
engine thread records them for the server and `OfflineMetrics` for `LLM.get_metrics()` (the
metrics: `pagedjax.engine.prometheus`).

Per output of a DELTA or CUMULATIVE request: time to first token (from its arrival at the
engine thread), inter-token latency, generation tokens, and the finished request. A
FINAL_ONLY request's single output gives its time to first token from the engine's own
timestamps and its inter-token latency as the mean over its decode steps (count and sum
exact, one observation per step after the first). A finished request also gives its n,
max_tokens, longest sequence and the phase times of its `RequestOutput.metrics` (queue,
prefill, decode, inference: `PrometheusStatLogger.record_finished`). Per step: the
scheduler stats summed over the replicas (KV-cache usage: held over usable blocks),
speculative-decoding counts and the structured-output grammar timings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from pagedjax.engine.prometheus import PrometheusStatLogger
from pagedjax.engine.scheduler import SchedulerStats
from pagedjax.engine.spec_decode import sum_spec_stats
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind


@dataclasses.dataclass
class LiveRequest:
    """Engine-thread bookkeeping of one unfinished request (times from time.monotonic())."""

    stream: Any  # its RequestStream (pagedjax.engine.async_llm)
    arrival: float
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    seen_tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # per sequence index
    n: int | None = None  # the request's n and max_tokens, for their histograms
    max_tokens: int | None = None


def record_output(
    metrics: PrometheusStatLogger, live: LiveRequest, out: RequestOutput, now: float
) -> None:
    """Metrics from one output of the engine, in the request's output kind."""
    if live.output_kind == RequestOutputKind.FINAL_ONLY:
        _record_final_only(metrics, live, out, now)
        return
    new_tokens = 0
    for o in out.outputs:
        seen = live.seen_tokens.get(o.index, 0)
        if live.output_kind == RequestOutputKind.CUMULATIVE:
            new_tokens += len(o.token_ids) - seen
            live.seen_tokens[o.index] = len(o.token_ids)
        else:
            new_tokens += len(o.token_ids)
            live.seen_tokens[o.index] = seen + len(o.token_ids)
    if new_tokens:
        if live.first_token_time is None:
            live.first_token_time = now
            live.num_prompt_tokens = len(out.prompt_token_ids)
            metrics.record_first_token(
                now - live.arrival, live.num_prompt_tokens, out.num_cached_tokens or 0
            )
        else:
            metrics.record_inter_token(now - live.last_token_time)
        live.last_token_time = now
        live.num_generation_tokens += new_tokens
        metrics.record_generation_tokens(new_tokens)
    if out.finished:
        _record_finished(metrics, live, out, now - live.arrival, live.num_generation_tokens)


def _record_final_only(
    metrics: PrometheusStatLogger, live: LiveRequest, out: RequestOutput, now: float
) -> None:
    """A FINAL_ONLY request's one output: time to first token from the engine's own
    timestamps (seconds since the epoch), one inter-token observation per decode step
    after the first (the mean step time: the steps themselves were not reported)."""
    generated = sum(len(o.token_ids) for o in out.outputs)
    steps = max((len(o.token_ids) for o in out.outputs), default=0)
    e2e = now - live.arrival
    m = out.metrics
    first = m.first_token_time if m is not None else None
    if generated:
        ttft = e2e if first is None else min(max(first - m.arrival_time, 0.0), e2e)
        metrics.record_first_token(ttft, len(out.prompt_token_ids), out.num_cached_tokens or 0)
        if steps > 1:
            last = m.finished_time if m is not None else None
            span = last - first if first is not None and last is not None else e2e - ttft
            for _ in range(steps - 1):
                metrics.record_inter_token(max(span, 0.0) / (steps - 1))
        metrics.record_generation_tokens(generated)
    if out.finished:
        live.seen_tokens = {o.index: len(o.token_ids) for o in out.outputs}
        _record_finished(metrics, live, out, e2e, generated)


def _record_finished(
    metrics: PrometheusStatLogger, live: LiveRequest, out: RequestOutput, e2e: float, generated: int
) -> None:
    metrics.record_finished(
        out.outputs[0].finish_reason or "stop",
        e2e,
        len(out.prompt_token_ids),
        generated,
        times=out.metrics,
        max_num_generation_tokens=max(live.seen_tokens.values(), default=0),
        n=live.n,
        max_tokens=live.max_tokens,
        num_cached_tokens=out.num_cached_tokens or 0,
    )


def record_scheduler_stats(metrics: PrometheusStatLogger, replicas: Sequence[Any]) -> None:
    """Scheduler stats summed over the replicas (KV usage: held / usable blocks)."""
    stats = [r.scheduler.stats() for r in replicas]
    pools = [r.kv_cache_manager.pool for r in replicas]
    total = SchedulerStats(
        **{
            f.name: sum(getattr(x, f.name) for x in stats)
            for f in dataclasses.fields(SchedulerStats)
            if f.name != "kv_cache_usage"
        }
    )
    usable = sum(p.num_usable_blocks for p in pools)
    free = sum(p.num_free_blocks for p in pools)
    total.kv_cache_usage = 1.0 - free / usable if usable else 0.0
    metrics.record_scheduler_stats(total, free)
    specs = [r.speculator.stats for r in replicas if getattr(r, "speculator", None)]
    if specs:
        metrics.record_spec_decode(sum_spec_stats(specs))
    for r in replicas:
        if getattr(r, "structured_output", None) is not None:
            metrics.record_grammar_timings(*r.structured_output.take_timings())


def prometheus_for(engine: Any) -> PrometheusStatLogger:
    """A `PrometheusStatLogger` (its own registry) labelled for an engine or data-parallel
    replicas of it."""
    replicas = list(getattr(engine, "replicas", [engine]))
    return PrometheusStatLogger(
        engine.config.model_config.served_model_name,
        cache_info={
            "block_size": engine.config.cache_config.block_size,
            "num_gpu_blocks": sum(r.kv_cache_manager.pool.num_usable_blocks for r in replicas),
            "enable_prefix_caching": engine.config.cache_config.enable_prefix_caching,
        },
    )


def record_iteration_tokens(
    metrics: PrometheusStatLogger, replicas: Sequence[Any], last: dict[int, Any]
) -> None:
    """Tokens of each replica's step that ran: a `last_step_timing` not seen before (`last`,
    replica index -> its last counted timing, is updated; replicas without one, remote
    ones, are not counted)."""
    for i, r in enumerate(replicas):
        t = getattr(r, "last_step_timing", None)
        if t is not None and t is not last.get(i):
            last[i] = t
            metrics.record_iteration_tokens(t.num_scheduled_tokens)


class OfflineMetrics:
    """The server's metrics for the requests of an offline `LLM` (`LLM.get_metrics()`), from
    the FINAL_ONLY outputs its `generate` collects: added, stepped and aborted requests are
    reported by the caller, on the thread that steps the engine."""

    def __init__(self, engine: Any):
        self.metrics = prometheus_for(engine)
        self._replicas = list(getattr(engine, "replicas", [engine]))
        self._live: dict[str, LiveRequest] = {}
        self._last_timings: dict[int, Any] = {}
        record_scheduler_stats(self.metrics, self._replicas)

    def added(self, request_id: str, n: int, max_tokens: int | None) -> None:
        self._live[request_id] = LiveRequest(
            None, time.monotonic(), RequestOutputKind.FINAL_ONLY, n=n, max_tokens=max_tokens
        )

    def stepped(self, outputs: Iterable[RequestOutput]) -> None:
        now = time.monotonic()
        record_iteration_tokens(self.metrics, self._replicas, self._last_timings)
        for out in outputs:
            live = self._live.pop(out.request_id, None) if out.finished else None
            if live is not None:
                record_output(self.metrics, live, out, now)
        record_scheduler_stats(self.metrics, self._replicas)

    def aborted(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            if self._live.pop(rid, None) is not None:
                self.metrics.record_finished("abort", None, 0, 0)
        record_scheduler_stats(self.metrics, self._replicas)
