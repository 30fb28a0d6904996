"""From sampled tokens to `RequestOutput`s: text, stop strings, logprobs, n > 1 gathering.

One `ParentState` per user request, one `ChildState` per output sequence (the n samples of a
request are separate scheduler requests, "{i}_{id}" when n > 1). Each step the engine hands
over the requests that progressed (the scheduler has already appended their tokens, grown
their text and decided whether they finished) and what the runner returned for them; this
module gathers their logprobs and the prompt logprobs, and builds the outputs that
`output_kind` asks for. It reads the requests' state and never changes it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from pagedjax.engine.interface import ModelRunnerOutput, PromptLogprobs
from pagedjax.engine.request import Request
from pagedjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class ChildState:
    request: Request
    index: int
    logprobs: list[dict[int, Logprob]] | None = None
    sent_tokens: int = 0  # output tokens already reported (output_kind DELTA)
    sent_finished: bool = False  # its finish already reported (output_kind DELTA)


@dataclasses.dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    """Detokenizes, gathers logprobs and builds `RequestOutput`s.

    Args:
        tokenizer: the engine's tokenizer, or None (no text, no decoded logprob tokens).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, tuple[ParentState, ChildState]] = {}  # by scheduler request id
        # token id -> its text alone, for logprob entries: a Hugging Face `decode` call costs
        # ~14 us, and prompt logprobs of 2,048 positions with 20 alternatives need 43K of
        # them in one step, on the engine thread (at most one entry per vocabulary token)
        self._token_text: dict[int, str] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        requests: list[Request],
        arrival_time: float,
    ) -> None:
        children = [
            ChildState(r, i, [] if params.logprobs is not None else None)
            for i, r in enumerate(requests)
        ]
        parent = ParentState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            children,
            RequestMetrics(arrival_time=arrival_time),
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = parent
        for c in children:
            self.children[c.request.request_id] = (parent, c)

    def remove(self, request_id: str) -> ParentState | None:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for c in parent.children:
                self.children.pop(c.request.request_id, None)
        return parent

    def mark_scheduled(self, req_ids: Iterable[str], now: float) -> None:
        """Sets `first_scheduled_time` (seconds since the epoch) of the parents of requests
        the scheduler has just put into a step, where it is not set yet (a request resumed
        after a preemption keeps its first time)."""
        for rid in req_ids:
            parent, _ = self.children.get(rid, (None, None))
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now

    def _decode(self, token_id: int) -> str | None:
        """The text of one token alone (`tokenizer.decode([token_id])`, remembered)."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(
        self, token_id: int, logprob: float, rank: int | None, top: list[tuple[int, float]]
    ) -> dict[int, Logprob]:
        """vLLM's form: the top alternatives with ranks 1..k, plus the chosen token."""
        d = {tid: Logprob(lp, j + 1, self._decode(tid)) for j, (tid, lp) in enumerate(top)}
        if token_id not in d:
            d[token_id] = Logprob(logprob, rank, self._decode(token_id))
        return d

    def _record_prompt_logprobs(self, parent: ParentState, plp: PromptLogprobs) -> None:
        ids = parent.prompt_token_ids
        for pos, lp, rank, top in zip(plp.positions, plp.logprobs, plp.ranks, plp.top, strict=True):
            parent.prompt_logprobs[pos] = self._logprob_dict(ids[pos], lp, rank, top)

    def update(self, progressed: list[Request], result: ModelRunnerOutput) -> list[ParentState]:
        """Takes a step's results (logprobs, prompt logprobs). Returns the parents that
        progressed."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        for req_id, plp in result.prompt_logprobs.items():
            parent, _ = self.children.get(req_id, (None, None))
            if parent is not None and parent.prompt_logprobs is not None:
                self._record_prompt_logprobs(parent, plp)
        for req in progressed:
            parent, child = self.children.get(req.request_id, (None, None))
            if parent is None:
                continue
            sampled = result.sampled.get(req.request_id)
            if child.logprobs is not None and sampled is not None:
                # With speculation several tokens; those after a stop were not appended.
                run = [sampled, *result.spec_tokens.get(req.request_id, ())]
                for t in run[: req.num_output_tokens - len(child.logprobs)]:
                    child.logprobs.append(
                        self._logprob_dict(t.token_id, t.logprob, t.rank, t.top or [])
                    )
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            touched[parent.request_id] = parent
        return list(touched.values())

    def build(self, touched: list[ParentState]) -> list[RequestOutput]:
        """The outputs `output_kind` asks for; finished parents are forgotten."""
        outputs = []
        for parent in touched:
            if all(c.request.is_finished for c in parent.children):
                self.remove(parent.request_id)
                outputs.append(self.final_output(parent))
            elif parent.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self.make_output(parent, False))
        return outputs

    def final_output(self, parent: ParentState) -> RequestOutput:
        """A finished (or aborted) parent's last output, its metrics completed (finish time,
        preemptions)."""
        parent.metrics.finished_time = time.time()
        parent.metrics.num_preemptions = sum(c.request.num_preemptions for c in parent.children)
        return self.make_output(parent, True)

    def make_output(self, parent: ParentState, finished: bool) -> RequestOutput:
        """The parent's output in its `output_kind`: every sample (CUMULATIVE, FINAL_ONLY) or
        only the samples with a new token or a new finish (DELTA)."""
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for c in parent.children:
            r = c.request
            start = c.sent_tokens if delta else 0
            if delta:
                # Only what is new: a sample with no new token and no new finish is left
                # out (vLLM's DELTA outputs of n > 1 carry the samples that progressed), so
                # a finished sample is not reported again while the others run on.
                if r.num_output_tokens == start and (c.sent_finished or not r.is_finished):
                    continue
                c.sent_tokens = r.num_output_tokens
                c.sent_finished = r.is_finished
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=r.detokenizer.get_text(r.is_finished, delta),
                    token_ids=list(r.output_token_ids[start:]),
                    cumulative_logprob=(
                        float(sum(r.output_logprobs)) if c.logprobs is not None else None
                    ),
                    logprobs=c.logprobs[start:] if c.logprobs is not None else None,
                    finish_reason=r.status.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if delta and parent.sent_prompt_logprobs:
            prompt_logprobs = None
        parent.sent_prompt_logprobs = True
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=parent.metrics,
        )
