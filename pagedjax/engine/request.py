"""A request as the scheduler sees it: token ids, counts, and its state machine.

States:
    WAITING_FOR_FSM --grammar compiled--> WAITING (a structured-output request whose grammar
        compiles on the worker pool; --compile error--> FINISHED_ERROR)
    WAITING --schedule--> RUNNING --stop/length--> FINISHED_STOPPED / FINISHED_LENGTH_CAPPED
    RUNNING --preempt (recompute)--> PREEMPTED (queued again at the front of waiting)
    RUNNING --preempt (swap)--> SWAPPED --swap in--> RUNNING
    any unfinished state --abort--> FINISHED_ABORTED
    RUNNING --token the grammar rejects--> FINISHED_ERROR

The request is the one record of a sequence's progress: its tokens, how many are computed,
its status, and (with a tokenizer) its text, through `detokenizer`. The scheduler alone
changes it. It owns no device memory; its blocks live in the `KVCacheManager` under its id.
`num_computed_tokens` counts tokens whose K/V are in the cache; a step schedules up to
`num_tokens - num_computed_tokens` of them (a prefill chunk, or the one decode token). The
runner never sees it: it gets `spec`, a frozen `engine.interface.RequestSpec` made here once.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagedjax.engine.interface import RequestSpec

if TYPE_CHECKING:
    from pagedjax.engine.detokenizer import IncrementalDetokenizer
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # vLLM's name: its grammar is still compiling
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its grammar did not compile (stop_reason: the error)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, non-empty.
        sampling_params: its `SamplingParams` (stop conditions are read from it).
        eos_token_id: the tokenizer's EOS, or None.
        seed: the seed of this request's draws (the params' seed, or one the engine drew).
        arrival_time: seconds (time.time()) when it arrived.
        priority: smaller runs earlier under the "priority" policy (vLLM's convention).
        cache_salt: extra key mixed into the prefix-cache hash of every block.
        bad_words_token_ids: the token sequences of `sampling_params.bad_words`.
        detokenizer: its `IncrementalDetokenizer` (text and stop strings), or None.
        structured_output: its grammar state, if `sampling_params.structured_outputs` is set.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        seed: int = 0,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        structured_output: StructuredOutputRequest | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.structured_output = structured_output
        self.spec = RequestSpec.from_params(
            prompt_token_ids, sampling_params, eos_token_id, seed, bad_words_token_ids
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
