"""What the engine returns: RequestOutput and CompletionOutput (vLLM's names and fields)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """A token's log probability, its rank in the distribution (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One output sequence of a request.

    Attributes:
        index: which of the request's n sequences this is.
        text: the generated text (stop string cut unless include_stop_str_in_output).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs (None if not computed).
        logprobs: per output token, token id -> Logprob (None unless asked for).
        finish_reason: "stop", "length", "abort", "error" (its structured-output grammar did
            not compile, or rejected a token), or None while running.
        stop_reason: the stop string or stop token id that ended it, the error's message for
            finish_reason "error", else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (seconds since the epoch, time.time()) of a request's life.

    Attributes:
        arrival_time: when the engine took the request in.
        first_scheduled_time: when a step first scheduled it (None until then, and for a
            request that ended before any step ran it).
        first_token_time: when the step that gave its first token ended.
        finished_time: when the step that finished it ended.
        num_preemptions: times a step preempted it (all n sequences together), counted
            when it finishes.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclasses.dataclass
class RequestOutput:
    """The output of one request.

    Attributes:
        request_id: its id.
        prompt: the prompt text (None if given as token ids only).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token, token id -> Logprob (None unless asked for; the
            first position is None).
        outputs: one CompletionOutput per sequence (n of them).
        finished: every sequence has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included), the logprobs of its generated tokens, its
    cumulative logprob, its generated text and why it ended ("stop" at EOS, else "length")."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of a prompt, best first."""

    sequences: list[BeamSearchSequence]
