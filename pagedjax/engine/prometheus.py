"""Prometheus metrics of a served engine, with vLLM's metric names (the `vllm:` prefix), so
that existing dashboards and alerts work unchanged.

`AsyncLLM`'s engine thread feeds a `PrometheusStatLogger` after every step (scheduler
gauges, token counters, latency histograms); `/metrics` renders its registry. Each logger has
its own `CollectorRegistry` (plus the process and Python collectors), so several engines in
one process do not clash. Every metric carries the label `model_name`.

Names (vLLM v1 where it has one; prometheus-client appends `_total` to counters):
    vllm:num_requests_running / _waiting / _swapped    gauges, requests
    vllm:kv_cache_usage_perc                           gauge, fraction of usable blocks held
    vllm:prefix_cache_queries / _hits                  counters, prompt tokens looked up / hit
    vllm:num_preemptions                               counter
    vllm:prompt_tokens / vllm:generation_tokens        counters, tokens
    vllm:prompt_tokens_cached                          counter, prompt tokens served from the
                                                       prefix cache
    vllm:request_success{finished_reason}              counter, finished requests
    vllm:time_to_first_token_seconds                   histogram, arrival -> first token
    vllm:inter_token_latency_seconds                   histogram, between a request's steps
    vllm:e2e_request_latency_seconds                   histogram, arrival -> last token
    vllm:request_queue_time_seconds                    histogram, arrival -> first scheduled
    vllm:request_prefill_time_seconds                  histogram, first scheduled -> first token
    vllm:request_decode_time_seconds                   histogram, first token -> last token
    vllm:request_inference_time_seconds                histogram, first scheduled -> last token
    vllm:request_prompt_tokens / _generation_tokens    histograms, tokens per request
    vllm:iteration_tokens_total                        histogram, tokens computed per step
    vllm:request_prefill_kv_computed_tokens            histogram, prompt tokens computed (not
                                                       from the prefix cache) per request
    vllm:request_time_per_output_token_seconds         histogram, a request's decode time over
                                                       its tokens after the first
    vllm:request_max_num_generation_tokens             histogram, the longest of a request's n
                                                       sequences, tokens
    vllm:request_params_n / vllm:request_params_max_tokens  histograms, the request's n and
                                                       max_tokens
    vllm:request_num_preemptions                       histogram, preemptions of a finished
                                                       request
    vllm:cache_config_info                             gauge = 1, the cache config as labels
    vllm:spec_decode_num_drafts                        counter, verification runs
    vllm:spec_decode_num_draft_tokens                  counter, proposed tokens
    vllm:spec_decode_num_accepted_tokens               counter, accepted proposals
    vllm:spec_decode_num_accepted_tokens_per_pos{position}  counter, runs that accepted
                                                       proposal `position` (0-based)
    pagedjax:kv_cache_free_blocks                      gauge, blocks in the free queue (no
                                                       vLLM equivalent; == num_gpu_blocks
                                                       when nothing holds a block)
    pagedjax:num_requests_waiting_for_grammar          gauge, structured-output requests whose
                                                       grammar is compiling
    pagedjax:grammar_compile_seconds                   histogram, one grammar's compilation
    pagedjax:grammar_bitmask_seconds                   histogram, one step's bitmask fill
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)

from pagedjax.engine.scheduler import SchedulerStats
from pagedjax.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS_LONG = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_GRAMMAR_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_PHASE_BUCKETS = (*_LATENCY_BUCKETS, 120.0, 300.0, 600.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class PrometheusStatLogger:
    """The served engine's metrics (see the module docstring for names and units).

    Args:
        model_name: the served model name, the `model_name` label of every metric.
        cache_info: labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, ...).
        registry: where to register (default: a new registry with the process collectors).

    All methods are thread-safe (prometheus-client locks each metric).
    """

    def __init__(
        self,
        model_name: str,
        cache_info: dict | None = None,
        registry: CollectorRegistry | None = None,
    ):
        if registry is None:
            registry = CollectorRegistry()
            process_collector.ProcessCollector(registry=registry)
            platform_collector.PlatformCollector(registry=registry)
            gc_collector.GCCollector(registry=registry)
        self.registry = registry
        label = {"model_name": model_name}
        kw = dict(labelnames=["model_name"], registry=registry)

        def gauge(name, doc):
            return Gauge(name, doc, **kw).labels(**label)

        def counter(name, doc):
            return Counter(name, doc, **kw).labels(**label)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **kw).labels(**label)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("vllm:num_requests_swapped", "Requests swapped to host memory.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage: fraction of usable blocks held (0 to 1)."
        )
        self.free_blocks = gauge(
            "pagedjax:kv_cache_free_blocks", "KV cache blocks in the free queue (cached or not)."
        )
        self.waiting_for_grammar = gauge(
            "pagedjax:num_requests_waiting_for_grammar",
            "Structured-output requests waiting for their grammar to compile.",
        )
        self.grammar_compile = histogram(
            "pagedjax:grammar_compile_seconds",
            "Compilation of one structured-output grammar (worker pool), seconds.",
            _GRAMMAR_BUCKETS,
        )
        self.grammar_bitmask = histogram(
            "pagedjax:grammar_bitmask_seconds",
            "Filling one step's token bitmask of the constrained requests (host), seconds.",
            _GRAMMAR_BUCKETS,
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions of running requests.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens of started requests found in the cache."
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name=model_name, finished_reason=reason)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first token, seconds.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two steps that gave a request tokens, seconds.",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token, seconds.",
            _LATENCY_BUCKETS_LONG,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request (all n sequences).",
            _TOKEN_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the first step that scheduled the request, seconds.",
            _PHASE_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Time from the first scheduling to the first token, seconds.",
            _PHASE_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Time from the first token to the last, seconds.",
            _PHASE_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Time from the first scheduling to the last token, seconds.",
            _PHASE_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request computed (not found in the prefix cache).",
            _TOKEN_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A finished request's decode time over its tokens after the first, seconds.",
            _LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step (prompt and generated, all requests).",
            _STEP_TOKEN_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of a finished request's longest sequence.",
            _TOKEN_BUCKETS,
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Times a finished request was preempted.",
            _PREEMPTION_BUCKETS,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "The n of finished requests.", _N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens of finished requests.", _TOKEN_BUCKETS
        )
        info = Gauge(
            "vllm:cache_config_info",
            "The KV cache configuration, as labels.",
            labelnames=sorted(cache_info or {}),
            registry=registry,
        )
        if cache_info:
            info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative verification runs.")
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed."
        )
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted."
        )
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Verification runs that accepted the proposal at this position (0-based).",
            labelnames=["model_name", "position"],
            registry=registry,
        )
        self._last_spec = (0, 0, 0, [])

    def record_scheduler_stats(self, stats: SchedulerStats, num_free_blocks: int) -> None:
        """Sets the gauges; advances the counters by what the cumulative stats gained."""
        self.num_running.set(stats.num_running_reqs)
        self.num_waiting.set(stats.num_waiting_reqs)
        self.num_swapped.set(stats.num_swapped_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(num_free_blocks)
        self.waiting_for_grammar.set(stats.num_waiting_for_grammar)
        q0, h0 = self._last_prefix
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - q0))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - h0))
        self._last_prefix = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        self.preemptions.inc(max(0, stats.num_preemptions - self._last_preemptions))
        self._last_preemptions = stats.num_preemptions

    def record_spec_decode(self, stats) -> None:
        """Advances the speculative-decoding counters to a cumulative
        `engine.spec_decode.SpecDecodeStats`."""
        d0, t0, a0, p0 = self._last_spec
        self.spec_drafts.inc(max(0, stats.num_drafts - d0))
        self.spec_draft_tokens.inc(max(0, stats.num_draft_tokens - t0))
        self.spec_accepted.inc(max(0, stats.num_accepted_tokens - a0))
        for j, n in enumerate(stats.num_accepted_tokens_per_pos):
            before = p0[j] if j < len(p0) else 0
            self._spec_per_pos.labels(model_name=self._model_name, position=str(j)).inc(
                max(0, n - before)
            )
        self._last_spec = (
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.num_accepted_tokens_per_pos),
        )

    def record_grammar_timings(self, compile_s: list[float], bitmask_s: list[float]) -> None:
        """Observes grammar compilations and bitmask fills (seconds each)."""
        for s in compile_s:
            self.grammar_compile.observe(s)
        for s in bitmask_s:
            self.grammar_bitmask.observe(s)

    def record_first_token(
        self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int = 0
    ) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_cached.inc(num_cached_tokens)

    def record_iteration_tokens(self, n: int) -> None:
        self.iteration_tokens.observe(n)

    def record_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def record_finished(
        self,
        finish_reason: str,
        e2e_s: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        *,
        times: RequestMetrics | None = None,
        max_num_generation_tokens: int | None = None,
        n: int | None = None,
        max_tokens: int | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """Counts a finished request; e2e_s None (an abort) records no histogram.

        `times` (the output's timestamps) gives the phase histograms, vLLM's definitions:
        queue = first scheduled - arrival, prefill = first token - first scheduled, decode =
        finished - first token, inference = finished - first scheduled; a phase whose ends
        are not both known (a request that never reached a step) is not observed. The time
        per output token is the decode time over the longest sequence's tokens after its
        first (vLLM's per-request mean), for sequences of two tokens or more.
        """
        self._success.labels(model_name=self._model_name, finished_reason=finish_reason).inc()
        if e2e_s is None:
            return
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.prefill_kv_computed.observe(max(num_prompt_tokens - num_cached_tokens, 0))
        if max_num_generation_tokens is not None:
            self.max_generation_tokens.observe(max_num_generation_tokens)
        if n is not None:
            self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if times is not None:
            self.request_preemptions.observe(times.num_preemptions)
            for hist, start, end in (
                (self.queue_time, times.arrival_time, times.first_scheduled_time),
                (self.prefill_time, times.first_scheduled_time, times.first_token_time),
                (self.decode_time, times.first_token_time, times.finished_time),
                (self.inference_time, times.first_scheduled_time, times.finished_time),
            ):
                if start is not None and end is not None:
                    hist.observe(max(end - start, 0.0))
            first, last = times.first_token_time, times.finished_time
            tokens = max_num_generation_tokens or 0
            if first is not None and last is not None and tokens > 1:
                self.request_tpot.observe(max(last - first, 0.0) / (tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (Content-Type: `CONTENT_TYPE`)."""
        return generate_latest(self.registry)
