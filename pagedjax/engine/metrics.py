"""Engine statistics: counters kept per step and a periodic log line (vLLM's wording)."""

from __future__ import annotations

import logging
import time

from pagedjax.engine.scheduler import SchedulerStats

logger = logging.getLogger("pagedjax.stats")


class StatLogger:
    """Counts tokens and steps; every `interval` seconds logs throughput and queue state.

    Attributes:
        num_prompt_tokens / num_generation_tokens: totals since start.
        num_steps: engine steps run; step_seconds: their summed wall time.
        last: the latest SchedulerStats.
    """

    def __init__(self, enabled: bool = True, interval: float = 5.0):
        self.enabled = enabled
        self.interval = interval
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        self.last = SchedulerStats()
        self._last_log = time.monotonic()
        self._since = (0, 0)

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens

    def on_step(
        self,
        scheduled_tokens: int,
        sampled: int,
        seconds: float,
        stats: SchedulerStats,
        spec=None,
    ) -> None:
        """One step: tokens scheduled and drawn, its seconds, the scheduler's stats and the
        speculative-decoding counters (`engine.spec_decode.SpecDecodeStats`, or None)."""
        self.num_steps += 1
        self.step_seconds += seconds
        self.num_scheduled_tokens += scheduled_tokens
        self.num_generation_tokens += sampled
        self.last = stats
        now = time.monotonic()
        if self.enabled and now - self._last_log >= self.interval:
            dt = now - self._last_log
            sched0, gen0 = self._since
            hit = (
                stats.prefix_cache_hits / stats.prefix_cache_queries
                if stats.prefix_cache_queries
                else 0.0
            )
            logger.info(
                "Avg scheduled throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, "
                "KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%, Preemptions: %d",
                (self.num_scheduled_tokens - sched0) / dt,
                (self.num_generation_tokens - gen0) / dt,
                stats.num_running_reqs,
                stats.num_swapped_reqs,
                stats.num_waiting_reqs,
                100 * stats.kv_cache_usage,
                100 * hit,
                stats.num_preemptions,
            )
            if spec is not None and spec.num_drafts:
                logger.info(
                    "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                    "Drafted: %d tokens, Per-position acceptance rate: %s",
                    spec.mean_acceptance_length,
                    spec.num_accepted_tokens,
                    spec.num_draft_tokens,
                    ", ".join(
                        f"{n / spec.num_drafts:.3f}" for n in spec.num_accepted_tokens_per_pos
                    ),
                )
            self._last_log = now
            self._since = (self.num_scheduled_tokens, self.num_generation_tokens)
