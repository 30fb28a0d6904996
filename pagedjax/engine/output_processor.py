"""From sampled tokens to `RequestOutput`s: text, stop strings, logprobs, n > 1 gathering.

One `ParentState` per user request, one `ChildState` per output sequence (the n samples of a
request are separate scheduler requests, "{i}_{id}" when n > 1). Each step the engine hands
over the requests that progressed and what the runner returned for them; this module updates
their detokenizers (reporting stop strings back, so the engine can end those requests), their
logprobs and the prompt logprobs, and builds the outputs that `output_kind` asks for.
"""

from __future__ import annotations

import dataclasses
import time

from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.request import Request
from pagedjax.engine.runner import PromptLogprobs, StepResult
from pagedjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class ChildState:
    request: Request
    detokenizer: IncrementalDetokenizer
    index: int
    logprobs: list[dict[int, Logprob]] | None = None
    sent_tokens: int = 0  # output tokens already reported (output_kind DELTA)


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
        self.child_to_parent: dict[str, str] = {}

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
            ChildState(
                r,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                i,
                [] if params.logprobs is not None else None,
            )
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
        for r in requests:
            self.child_to_parent[r.request_id] = request_id

    def remove(self, request_id: str) -> ParentState | None:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for c in parent.children:
                self.child_to_parent.pop(c.request.request_id, None)
        return parent

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

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

    def update(
        self, progressed: list[Request], result: StepResult
    ) -> tuple[list[ParentState], list[tuple[Request, str]]]:
        """Takes a step's results: text, stop strings, logprobs.

        Returns:
            The parents that progressed, and (request, stop string) pairs of requests whose
            text reached a stop string (the engine ends them before `build`).
        """
        now = time.time()
        stops: list[tuple[Request, str]] = []
        touched: dict[str, ParentState] = {}
        for req_id, plp in result.prompt_logprobs.items():
            parent_id = self.child_to_parent.get(req_id)
            if parent_id is not None and self.parents[parent_id].prompt_logprobs is not None:
                self._record_prompt_logprobs(self.parents[parent_id], plp)
        for req in progressed:
            parent_id = self.child_to_parent.get(req.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = next(c for c in parent.children if c.request is req)
            new_tokens = req.output_token_ids[len(child.detokenizer.token_ids) :]
            sampled = result.sampled.get(req.request_id)
            if child.logprobs is not None and sampled is not None and new_tokens:
                child.logprobs.append(
                    self._logprob_dict(
                        sampled.token_id, sampled.logprob, sampled.rank, sampled.top or []
                    )
                )
            stop = child.detokenizer.update(new_tokens)
            if stop is not None and not req.is_finished:
                stops.append((req, stop))
            elif req.is_finished:
                child.detokenizer.flush()
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            touched[parent_id] = parent
        return list(touched.values()), stops

    def build(self, touched: list[ParentState]) -> list[RequestOutput]:
        """The outputs `output_kind` asks for; finished parents are forgotten."""
        outputs = []
        for parent in touched:
            finished = all(c.request.is_finished for c in parent.children)
            if finished:
                parent.metrics.finished_time = time.time()
                self.remove(parent.request_id)
            if finished or parent.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self.make_output(parent, finished))
        return outputs

    def make_output(self, parent: ParentState, finished: bool) -> RequestOutput:
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for c in parent.children:
            r = c.request
            start = c.sent_tokens if delta else 0
            if delta:
                c.sent_tokens = r.num_output_tokens
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.detokenizer.get_text(r.is_finished, delta),
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
