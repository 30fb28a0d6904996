"""Continuous batching under a token budget: one scheduling loop, no prefill/decode phases.

Each step spends `max_num_batched_tokens` over at most `max_num_seqs` requests. Every request
has a count of tokens whose K/V are cached (`num_computed_tokens`) and a count of tokens it
knows (`num_tokens`: prompt + output); a step lets the first catch up with the second as far
as the budget allows. So a decode is one token, a prompt is one chunk or several (chunked
prefill), and prefix-cache hits simply start a request further along. Running requests are
served first, in admission order, so decodes are never starved by new prompts; then swapped
requests come back; then waiting requests are admitted while blocks and budget last.

When a running request cannot get a block, the lowest-priority running request (the most
recently admitted under "fcfs") is preempted. With preemption_mode="recompute" its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed from its prompt
and the output it already has (its full blocks are likely still in the prefix cache). With
"swap" its blocks are copied to a host pool and copied back when there is room again (if
the host pool is full, it is recomputed instead). Either way its output is unchanged: the
tokens it sees are the same, and its draws depend only on its seed and token index.

The n samples of one prompt are forked (`engine.forks`): the first one prefills the prompt;
when it has, the others take its blocks (shared, ref-counted) and compute only the last
prompt token, each in its own copy of the partly filled last block (copy-on-write).

With speculative decoding (`engine.spec_decode.Speculator`), a decoding request also gets up
to k proposed tokens, computed in the same step (the budget counts them; its blocks cover
them); after verification it takes the kept tokens one by one, stop checks after each (what
follows a stop is dropped), and its computed count advances by the accepted proposals + 1. The
K/V of rejected proposals sit past the computed count: later steps overwrite them before any
attention reads that far.

A structured-output request waits (WAITING_FOR_FSM) until its grammar has compiled on the
worker pool (`structured_output`), then queues like any other; each step the scheduler fills
the token bitmask of the constrained rows that sample (`SchedulerOutput.grammar_bitmask`)
and advances their matchers with the sampled tokens.

The scheduler owns request state: `update_from_output` appends each sampled token, advances
`num_computed_tokens` and decides, in one place (`engine.stop_check`), whether the request
ends (EOS, stop token ids, a completed grammar, max_tokens / max_model_len, stop strings; an
abort comes through `finish_requests`).
Plain Python (no jax): `schedule()` returns a `SchedulerOutput` of ids and counts
(`engine.interface`), with no `Request` in it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable

from pagedjax.config import SchedulerConfig
from pagedjax.engine.forks import ForkGroups
from pagedjax.engine.interface import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.spec_decode import Speculator
from pagedjax.engine.stop_check import check_stop
from pagedjax.engine.waiting_queue import WaitingQueue
from pagedjax.structured_output.scheduling import GrammarWaitQueue, step_bitmask

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerStats:
    """Gauges and counters exposed by the scheduler (vLLM's names where they exist).

    prompt_tokens_computed counts prompt tokens actually run through the model (prefix-cache
    hits and forked prompts are not); recomputation after a preemption counts again.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    num_waiting_for_grammar: int = 0


class Scheduler:
    """The waiting queue, the running list, the swapped queue and their `KVCacheManager`;
    `structured_output` (a `StructuredOutputManager`) fills the bitmasks of constrained
    requests."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        structured_output=None,
        speculator: Speculator | None = None,
    ):
        self.config = config
        self.spec = speculator
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every request not yet reported finished
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.forks = ForkGroups()
        self.finished_req_ids: set[str] = set()  # ended since the last schedule()
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that went to the host pool
        self.prompt_tokens_computed = 0
        self.structured_output = structured_output
        self.waiting_for_grammar = GrammarWaitQueue()

    # ----------------------------------------------------------------- requests in / out

    def add_request(self, request: Request, fork_of: Request | None = None) -> None:
        """Queues a request; with `fork_of`, holds it until that request has computed its
        prompt, then lets it share those blocks (the n > 1 samples of one prompt).

        Raises:
            ValueError: its prompt needs more blocks than the whole pool holds (it could
                never run), or the id is already in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        need = self.kv.blocks_needed(request.num_tokens)
        if need > self.kv.num_usable_blocks:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs {need} KV blocks, but the whole "
                f"KV cache has {self.kv.num_usable_blocks}; it can never be scheduled"
            )
        self.requests[request.request_id] = request
        if fork_of is not None and fork_of.request_id in self.requests:
            self.forks.hold(request, fork_of)
        elif request.structured_output is not None and not request.structured_output.is_ready():
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_grammar.add(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests in any unfinished state (an abort) and frees their blocks at once.
        Unknown or finished ids are ignored."""
        reqs = [
            self.requests[i]
            for i in request_ids
            if i in self.requests and not self.requests[i].is_finished
        ]
        gone = {id(r) for r in reqs}
        self.running = [r for r in self.running if id(r) not in gone]
        self.swapped = deque(r for r in self.swapped if id(r) not in gone)
        self.waiting.remove(reqs)
        self.waiting_for_grammar.remove(reqs)
        self.forks.discard(reqs)
        for r in reqs:
            self._finish(r, status)
            del self.requests[r.request_id]
        return reqs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Marks a request finished and frees its blocks and its grammar state; a sibling
        waiting for its prompt takes its place."""
        request.status = status
        if request.detokenizer is not None:
            request.detokenizer.flush(request.output_token_ids)
        self.kv.free(request)
        if request.structured_output is not None and self.structured_output is not None:
            self.structured_output.release(request.structured_output)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        self.finished_req_ids.add(request.request_id)
        head = self.forks.parent_ended(request)
        if head is not None:
            self.waiting.add_front(head)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block that no request holds. Returns False (and does nothing)
        while a request holds blocks, as vLLM does."""
        return self.kv.reset_prefix_cache()

    # ----------------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's requests and token counts; allocates their blocks."""
        step = _StepPlan(self.config.max_num_batched_tokens)
        if len(self.waiting_for_grammar):
            self._admit_compiled(step)
        if self.config.scheduling_policy == "priority":
            # Highest priority first; the victim of a preemption is then always the last one,
            # which has not been scheduled yet in this step (or is the request being served).
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
            self.swapped = deque(sorted(self.swapped, key=lambda r: (r.priority, r.arrival_time)))
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)

        # Batch order: running requests (in running-list order), then the new ones.
        new_ids = {d.req_id for d in step.new_reqs}
        order = [
            r.request_id
            for r in self.running
            if r.request_id in step.seqs and r.request_id not in new_ids
        ]
        order += [d.req_id for d in step.new_reqs]
        out = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=[step.cached[r] for r in order if r in step.cached],
            scheduled=[step.seqs[r] for r in order],
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            blocks_to_copy=self.kv.take_pending_copies(),
            stopped_req_ids=step.stopped,
        )
        if self.structured_output is not None:
            reqs = [self.requests[s.req_id] for s in out.scheduled]
            out.grammar_bitmask = step_bitmask(self.structured_output, reqs, out.scheduled)
        self.finished_req_ids = set()
        return out

    def _admit_compiled(self, step: _StepPlan) -> None:
        """Requests whose grammar compiled join the waiting queue; those whose grammar failed
        end (with the n - 1 samples held for them) with finish_reason "error"."""
        idle = not self.running and not len(self.waiting) and not self.swapped
        ready, failed = self.waiting_for_grammar.take_done(self.structured_output, idle)
        for req in ready:
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        for req, error in failed:
            logger.warning("request %s: %s", req.request_id, error)
            for r in (req, *self.forks.take_siblings(req)):
                r.stop_reason = error
                self._finish(r, RequestStatus.FINISHED_ERROR)
                step.stopped.append(r.request_id)

    def _schedule_running(self, step: _StepPlan) -> None:
        """Running requests first, in order; preempts from the back when blocks run out."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, step.budget)
            drafts = self.spec.propose(req, n, step.budget) if self.spec is not None else ()
            ahead = len(drafts) + self._lookahead(req, n)
            new_blocks = self.kv.allocate_slots(req, n + ahead)
            if new_blocks is None and ahead:  # no block for the lookahead: no proposals
                drafts = ()
                new_blocks = self.kv.allocate_slots(req, n)
            while new_blocks is None and req in self.running:
                if len(self.running) == 1:
                    self._stop_for_lack_of_cache(req, step)
                    break
                victim = self.running.pop()
                self._preempt(victim, step)
                drafts = ()  # no preemption for the lookahead's sake
                if victim is not req:
                    new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                continue  # req was preempted or stopped; self.running[i] is the next one
            step.cached[req.request_id] = CachedRequestData(
                req.request_id, tuple(new_blocks), tuple(self.kv.take_replaced(req.request_id))
            )
            self._add_seq(req, n, step, drafts)
            i += 1

    def _schedule_swapped(self, step: _StepPlan) -> None:
        """Swapped requests come back while blocks, budget and max_num_seqs allow."""
        while self.swapped and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, step.budget)
            mapping = self.kv.swap_in(req, n)
            if mapping is None:
                break
            self.swapped.popleft()
            step.swap_in.extend(mapping)
            self._start(req, n, step)

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Waiting requests are admitted while blocks, budget and max_num_seqs allow; each
        starts after its longest prefix-cache hit."""
        cfg = self.config
        while step.budget > 0 and len(self.waiting) > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            else:  # forked: it holds the blocks of its first num_computed_tokens already
                hits, num_hit_tokens = [], 0
            n = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if n > step.budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, step.budget)
            ahead = self._lookahead(req, n + num_hit_tokens)
            if self.kv.allocate_slots(req, n + ahead, hits) is None:
                break
            self.waiting.pop()
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            self._start(req, n, step)

    def _lookahead(self, req: Request, n: int) -> int:
        """Slots past this step's tokens that the draft model writes after it (the request
        samples this step), so that its proposals never land in the null block."""
        if self.spec is None or req.num_computed_tokens + n != req.num_tokens:
            return 0
        return self.spec.num_lookahead_tokens

    def _start(self, req: Request, n: int, step: _StepPlan) -> None:
        """Moves a request into the running batch; the runner gets its whole table."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.kv.take_replaced(req.request_id)  # the runner gets the whole table anyway
        step.new_reqs.append(
            NewRequestData(
                req.request_id,
                req.spec,
                tuple(req.all_token_ids),
                tuple(self.kv.get_block_ids(req.request_id)),
            )
        )
        self._add_seq(req, n, step)

    def _add_seq(self, req: Request, n: int, step: _StepPlan, drafts: tuple[int, ...] = ()) -> None:
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens
        k = req.spec.longest_bad_word - 1
        recent = tuple(req.output_token_ids[-k:]) if samples and k > 0 else ()
        step.seqs[req.request_id] = ScheduledSeq(
            req.request_id,
            tuple(req.all_token_ids[start : start + n]) + drafts,
            start,
            req.num_output_tokens,
            samples,
            recent,
            len(drafts),
        )
        self.prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)
        step.budget -= n + len(drafts)

    def _preempt(self, request: Request, step: _StepPlan) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        if self.config.preemption_mode == "swap":
            mapping = self.kv.swap_out(request)
            if mapping is not None:
                self.num_swap_outs += 1
                step.swap_out.extend(mapping)
                request.status = RequestStatus.SWAPPED
                self.swapped.appendleft(request)
                return
            logger.warning(
                "host swap space is full; recomputing request %s instead", request.request_id
            )
        self.kv.free(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.add_front(request)

    def _stop_for_lack_of_cache(self, req: Request, step: _StepPlan) -> None:
        """Alone, and still no room: the pool cannot hold this sequence any longer."""
        self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        step.stopped.append(req.request_id)
        logger.warning(
            "request %s stopped at %d tokens: the KV cache cannot hold more",
            req.request_id,
            req.num_tokens,
        )

    # ----------------------------------------------------------------- after the step

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, SampledToken],
        spec_tokens: dict[str, list[SampledToken]] | None = None,
        draft_token_ids: dict[str, tuple[int, ...]] | None = None,
    ) -> list[Request]:
        """Advances the scheduled requests, appends their sampled tokens and ends those that
        are done (`check_stop`: EOS, a stop token id, a grammar's error or completion,
        max_tokens or max_model_len, a stop string); finished requests are freed and
        forgotten.

        Args:
            out: this step's `SchedulerOutput`.
            sampled: request id -> its `SampledToken`, for requests whose scheduled tokens
                reached their end (a request mid-prefill samples nothing).
            spec_tokens: request id -> the tokens kept after its sampled one (speculation).
            draft_token_ids: request id -> the draft model's proposals for its next step.

        Returns:
            The requests that received a token this step, and those `schedule()` stopped for
            lack of KV cache (their status says whether and why they finished).
        """
        progressed = [self.requests.pop(rid) for rid in out.stopped_req_ids]
        for seq in out.scheduled:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # ended meanwhile (aborted, or stopped for lack of KV cache)
            req.num_computed_tokens += len(seq.token_ids) - seq.num_draft_tokens
            token = sampled.get(seq.req_id)
            if token is None:
                continue
            tokens = [token]
            if seq.num_draft_tokens:
                tokens += (spec_tokens or {}).get(seq.req_id, [])
                self.spec.record(seq.num_draft_tokens, len(tokens) - 1)
            for j, t in enumerate(tokens):
                if j:  # an accepted proposal's K/V is cached: it was computed this step
                    req.num_computed_tokens += 1
                req.append_output_token(t.token_id, t.logprob)
                if req.structured_output is not None:
                    req.structured_output.accept(t.token_id)
                if self.forks.has_siblings(req):
                    for child in self.forks.fork(req, self.kv):
                        self.waiting.add_front(child)
                status = check_stop(req, self.config.max_model_len)
                if status is not None:
                    self.running.remove(req)
                    self._finish(req, status)
                    del self.requests[req.request_id]
                    break
            else:
                if draft_token_ids and seq.req_id in draft_token_ids:
                    self.spec.set_drafts(seq.req_id, draft_token_ids[seq.req_id])
            progressed.append(req)
        return progressed

    def stats(self) -> SchedulerStats:
        s = self.kv.stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.requests) - len(self.running) - len(self.swapped),
            num_swapped_reqs=len(self.swapped),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_requests=s.requests,
            prefix_cache_queries=s.queries,
            prefix_cache_hits=s.hits,
            prompt_tokens_computed=self.prompt_tokens_computed,
            num_waiting_for_grammar=len(self.waiting_for_grammar),
        )


@dataclasses.dataclass
class _StepPlan:
    """What `schedule()` has decided so far this step."""

    budget: int
    seqs: dict[str, ScheduledSeq] = dataclasses.field(default_factory=dict)
    cached: dict[str, CachedRequestData] = dataclasses.field(default_factory=dict)
    new_reqs: list[NewRequestData] = dataclasses.field(default_factory=list)
    preempted: set[str] = dataclasses.field(default_factory=set)
    stopped: list[str] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
