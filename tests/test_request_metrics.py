"""The served engine's per-request Prometheus metrics (`engine.request_metrics`), on
hand-built outputs: each output kind counts every token once, and a finished request gives
vLLM's phase histograms (queue, prefill, decode, inference) from its timestamps."""

from __future__ import annotations

import pytest

from pagedjax.engine.prometheus import PrometheusStatLogger
from pagedjax.engine.request_metrics import LiveRequest, record_output
from pagedjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.sampling_params import RequestOutputKind

# arrival 100 s, first scheduled 101.5 s, first token 103 s, finished 107 s, 3 preemptions
TIMES = RequestMetrics(
    arrival_time=100.0,
    first_scheduled_time=101.5,
    first_token_time=103.0,
    finished_time=107.0,
    num_preemptions=3,
)


def _output(tokens: list[list[int]], finished: bool, times=TIMES) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(i, "", t, finish_reason="length" if finished else None)
            for i, t in enumerate(tokens)
        ],
        finished=finished,
        metrics=times,
        num_cached_tokens=2,
    )


def _value(m: PrometheusStatLogger, name: str) -> float:
    v = m.registry.get_sample_value(name, {"model_name": "tiny"})
    assert v is not None, name
    return v


# Two sequences (n = 2) of 3 and 5 tokens, as each output kind reports them over 3 steps.
STEPS = {
    RequestOutputKind.DELTA: [([[7], [7]], False), ([[8], [8]], False), ([[9], [9, 9, 9]], True)],
    RequestOutputKind.CUMULATIVE: [
        ([[7], [7]], False),
        ([[7, 8], [7, 8]], False),
        ([[7, 8, 9], [7, 8, 9, 9, 9]], True),
    ],
    RequestOutputKind.FINAL_ONLY: [([[7, 8, 9], [7, 8, 9, 9, 9]], True)],
}


@pytest.mark.parametrize("kind", list(STEPS), ids=lambda k: k.name)
def test_a_finished_request_gives_the_phase_histograms(kind):
    m = PrometheusStatLogger("tiny")
    live = LiveRequest(stream=None, arrival=50.0, output_kind=kind, n=2, max_tokens=5)
    for step, (tokens, finished) in enumerate(STEPS[kind]):
        record_output(m, live, _output(tokens, finished), now=51.0 + step)
    assert _value(m, "vllm:generation_tokens_total") == 8
    assert _value(m, "vllm:request_generation_tokens_sum") == 8
    assert _value(m, "vllm:request_max_num_generation_tokens_sum") == 5
    assert _value(m, "vllm:request_params_n_sum") == 2
    assert _value(m, "vllm:request_params_max_tokens_sum") == 5
    # 2 of the 3 prompt tokens came from the prefix cache
    assert _value(m, "vllm:prompt_tokens_cached_total") == 2
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 1
    # 4 s of decoding over the longest sequence's 4 tokens after its first
    assert _value(m, "vllm:request_time_per_output_token_seconds_sum") == 1.0
    assert _value(m, "vllm:request_num_preemptions_sum") == 3
    for name, seconds in [
        ("queue", 1.5),  # first scheduled - arrival
        ("prefill", 1.5),  # first token - first scheduled
        ("decode", 4.0),  # finished - first token
        ("inference", 5.5),  # finished - first scheduled
    ]:
        assert _value(m, f"vllm:request_{name}_time_seconds_count") == 1, name
        assert _value(m, f"vllm:request_{name}_time_seconds_sum") == seconds, name


def test_a_phase_without_both_ends_is_not_observed():
    """A request that ended before any step scheduled it (first_scheduled_time None) has no
    queue, prefill or inference time; its end-to-end latency is still observed."""
    m = PrometheusStatLogger("tiny")
    times = RequestMetrics(arrival_time=100.0, finished_time=100.5)
    live = LiveRequest(stream=None, arrival=50.0, output_kind=RequestOutputKind.DELTA)
    record_output(m, live, _output([[]], True, times), now=50.5)
    assert _value(m, "vllm:e2e_request_latency_seconds_count") == 1
    for name in ("queue", "prefill", "decode", "inference"):
        assert _value(m, f"vllm:request_{name}_time_seconds_count") == 0, name
    assert _value(m, "vllm:request_params_n_count") == 0  # not known here
