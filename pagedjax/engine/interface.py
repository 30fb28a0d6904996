"""The data that crosses the scheduler-runner boundary each step (plain Python, no jax).

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
        -> Scheduler.update_from_output()

The scheduler owns every request's state (`engine.request.Request`); the runner sees only
what is here: for a request entering the batch a frozen `RequestSpec`, made once when the
request is added, and for every scheduled request the ids and counts of this step. Nothing
here refers to a `Request`, so a `SchedulerOutput` can be pickled and sent to another process
(vLLM v1's `NewRequestData` / `CachedRequestData` split).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What the runner needs to know of a request, fixed for its lifetime.

    Attributes:
        prompt_token_ids: the prompt (after truncation).
        temperature, top_p, top_k, min_p: the sampling transforms, already neutral for a
            greedy request (temperature 0, top_p 1, top_k 0, min_p 0).
        seed: the request's seed (64-bit; its draws depend only on it and the token index).
        repetition_penalty, presence_penalty, frequency_penalty: as in SamplingParams.
        stop_token_ids: EOS (unless ignore_eos) and the stop_token_ids, in order; banned
            while the output is shorter than `min_tokens`.
        min_tokens: output tokens before a stop token may be drawn.
        logit_bias: (token id, bias) pairs added to the logits.
        allowed_token_ids: if not None, every other token is masked.
        bad_words: token sequences never to complete; single-token ones are masked always,
            longer ones when the output ends with all but their last token.
        logprobs, prompt_logprobs: top-k alternatives to return (None: none).
    """

    prompt_token_ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @classmethod
    def from_params(
        cls,
        prompt_token_ids,
        params,
        eos_token_id: int | None,
        seed: int,
        bad_words: list[list[int]] | None = None,
    ) -> RequestSpec:
        """The spec of a request with `SamplingParams` `params`.

        Args:
            prompt_token_ids: the prompt's token ids.
            params: its SamplingParams.
            eos_token_id: the tokenizer's EOS, or None.
            seed: the seed its draws use.
            bad_words: the token sequences of `params.bad_words` (tokenized by the engine).
        """
        greedy = params.is_greedy
        eos = () if params.ignore_eos or eos_token_id is None else (eos_token_id,)
        return cls(
            prompt_token_ids=tuple(prompt_token_ids),
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=0 if greedy else max(int(params.top_k), 0),
            min_p=0.0 if greedy else float(params.min_p),
            seed=int(seed),
            repetition_penalty=float(params.repetition_penalty),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            stop_token_ids=tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ())))),
            min_tokens=int(params.min_tokens),
            logit_bias=tuple((params.logit_bias or {}).items()),
            allowed_token_ids=(
                None if params.allowed_token_ids is None else tuple(params.allowed_token_ids)
            ),
            bad_words=tuple(tuple(w) for w in bad_words or ()),
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def longest_bad_word(self) -> int:
        """Tokens in the longest bad word (0 without bad words)."""
        return max((len(w) for w in self.bad_words), default=0)


@dataclasses.dataclass(frozen=True)
class NewRequestData:
    """A request entering the batch (first time, after a preemption, or forked).

    spec: its `RequestSpec`; token_ids: every token it knows (prompt + output so far), for
    the penalties' state; block_ids: its whole block table.
    """

    req_id: str
    spec: RequestSpec
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CachedRequestData:
    """A request that was in the previous step's batch: the blocks appended to its table
    and the (index, block id) entries replaced by copy-on-write."""

    req_id: str
    new_block_ids: tuple[int, ...]
    replaced_block_ids: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """What one request computes this step.

    token_ids: the tokens at positions num_computed_tokens .. + len - 1 (a prefill chunk, or
        the one decode token).
    num_computed_tokens: its tokens whose K/V are already in the cache.
    num_output_tokens: its output tokens so far (the index of the token drawn this step).
    samples: the step reaches its last known token, so a token is drawn for it.
    recent_output_ids: its last output tokens, as many as its longest bad word needs (only
        when it samples and has multi-token bad words).
    num_draft_tokens: k, proposed tokens (speculative decoding) at the end of `token_ids`,
        verified this step; they are not the request's tokens unless kept.
    """

    req_id: str
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_output_tokens: int
    samples: bool
    recent_output_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0


@dataclasses.dataclass
class SchedulerOutput:
    """What the runner does this step, in this order: forget `finished_req_ids` and
    `preempted_req_ids`, take in the new and cached requests' tables, swap blocks out to the
    host, swap blocks in, copy blocks, then compute `scheduled` (in batch order).

    stopped_req_ids: requests `schedule()` ended for lack of KV cache (finish reason
    "length") or because their grammar did not compile ("error"); `update_from_output`
    reports them.
    grammar_bitmask: [len(scheduled), ceil(vocab / 32)] int32, in batch order, or None when no
    constrained request samples this step: bit j of word w allows token 32 w + j (rows of
    unconstrained requests are all ones); the sampler masks the rest before anything else.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    scheduled: list[ScheduledSeq]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    stopped_req_ids: list[str] = dataclasses.field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None

    @property
    def num_draft_tokens(self) -> int:
        """Proposed tokens verified this step."""
        return sum(s.num_draft_tokens for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens computed this step, in batch order."""
        return {s.req_id: len(s.token_ids) for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclasses.dataclass
class SampledToken:
    """A token drawn for a request: its id, logprob and rank (1 = most likely) under the raw
    distribution, and the top `logprobs` alternatives [(id, logprob)] if the request asked."""

    token_id: int
    logprob: float
    rank: int | None = None
    top: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class PromptLogprobs:
    """Prompt logprobs computed in a step: for each prompt position in `positions`, the
    logprob and rank of that prompt token given the tokens before it, and the top-k."""

    positions: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclasses.dataclass
class ModelRunnerOutput:
    """What a step returns: the token drawn for every scheduled request that samples, the
    prompt logprobs computed this step, and where the runner's time went (seconds).

    spec_tokens: for a request that verified proposals, the tokens kept after `sampled`'s
    (accepted proposals, then the replacement or bonus token), in order.
    draft_token_ids: the draft model's proposals for each request's next step.
    """

    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs]
    prepare_s: float = 0.0  # host: request states, block ops, the packed input buffer
    device_s: float = 0.0  # the compiled step's dispatch until its sampled ids are on the host
    bucket: int = 0  # the step's token bucket T (0: nothing ran)
    spec_tokens: dict[str, list[SampledToken]] = dataclasses.field(default_factory=dict)
    draft_token_ids: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
