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

The n samples of one prompt are forked: the first one prefills the prompt; when it has, the
others take its blocks (shared, ref-counted) and compute only the last prompt token, each
in its own copy of the partly filled last block (copy-on-write).

Plain Python (no jax): the output of `schedule()` is a `SchedulerOutput` of ids and counts.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Iterable

from pagedjax.config import SchedulerConfig
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SampledToken:
    """A token drawn for a request: its id, logprob and rank (1 = most likely) under the raw
    distribution, and the top `logprobs` alternatives [(id, logprob)] if the request asked."""

    token_id: int
    logprob: float
    rank: int | None = None
    top: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class NewRequestData:
    """A request entering the batch (first time, after a preemption, or forked).

    token_ids: every token it knows (prompt + output so far); block_ids: its whole block table;
    num_computed_tokens: tokens already in the cache (prefix-cache hits, shared or swapped-in
    blocks).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    request: Request


@dataclasses.dataclass
class CachedRequestData:
    """A request that was in the previous step's batch: its progress, the blocks appended to
    its table, and (index, block id) entries replaced by copy-on-write."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    replaced_block_ids: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    """What the runner does this step, in this order: swap blocks out to the host, swap
    blocks in, copy blocks, then compute `num_scheduled_tokens` (in batch order)."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)


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


class _WaitingQueue:
    """FCFS: a deque. Priority: a heap on (priority, arrival time, arrival order)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._heap)

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._order), req))

    def add_front(self, req: Request) -> None:
        """A preempted or forked request: first in line under fcfs; by its key under priority."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(req)
        else:
            self.add(req)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, reqs: Iterable[Request]) -> None:
        ids = {id(r) for r in reqs}
        if self.policy == "fcfs":
            self._fcfs = deque(r for r in self._fcfs if id(r) not in ids)
        else:
            self._heap = [e for e in self._heap if id(e[3]) not in ids]
            heapq.heapify(self._heap)


class Scheduler:
    """The waiting queue, the running list, the swapped queue and their `KVCacheManager`."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = _WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> siblings to fork
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that went to the host pool
        self.prompt_tokens_computed = 0
        self._stopped_in_schedule: list[Request] = []

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
            self.pending_forks.setdefault(fork_of.request_id, []).append(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests in any unfinished state (abort, or a stop string found by the
        detokenizer) and frees their blocks. Unknown or finished ids are ignored."""
        reqs = [self.requests[i] for i in request_ids if i in self.requests]
        gone = {id(r) for r in reqs}
        self.running = [r for r in self.running if id(r) not in gone]
        self.swapped = deque(r for r in self.swapped if id(r) not in gone)
        self.waiting.remove(reqs)
        for parent_id in list(self.pending_forks):
            kept = [r for r in self.pending_forks[parent_id] if id(r) not in gone]
            if kept:
                self.pending_forks[parent_id] = kept
            else:
                del self.pending_forks[parent_id]
        for r in reqs:
            r.status = status
            self._free(r)
        return reqs

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        siblings = self.pending_forks.pop(request.request_id, None)
        if siblings:  # it ended before its prompt was computed: the next sibling takes over
            head, rest = siblings[0], siblings[1:]
            self.waiting.add_front(head)
            if rest:
                self.pending_forks[head.request_id] = rest

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ----------------------------------------------------------------- scheduling

    def _preempt(self, request: Request, swap_out: list[tuple[int, int]]) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            mapping = self.kv.swap_out(request)
            if mapping is not None:
                self.num_swap_outs += 1
                swap_out.extend(mapping)
                request.status = RequestStatus.SWAPPED
                self.swapped.appendleft(request)
                return
            logger.warning(
                "host swap space is full; recomputing request %s instead", request.request_id
            )
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.add_front(request)

    def _new_data(self, req: Request) -> NewRequestData:
        self.kv.take_replaced(req.request_id)  # the runner gets the whole table anyway
        return NewRequestData(
            req.request_id,
            list(req.all_token_ids),
            req.num_prompt_tokens,
            list(self.kv.get_block_ids(req.request_id)),
            req.num_computed_tokens,
            req,
        )

    def _count_prompt_tokens(self, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        self.prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's requests and token counts; allocates their blocks."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs: dict[str, CachedRequestData] = {}
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        if cfg.scheduling_policy == "priority":
            # Highest priority first; the victim of a preemption is then always the last one,
            # which has not been scheduled yet in this step (or is the request being served).
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
            self.swapped = deque(sorted(self.swapped, key=lambda r: (r.priority, r.arrival_time)))

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = None
            while True:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                if len(self.running) == 1:
                    # Alone, and still no room: the pool cannot hold this sequence any longer.
                    self.running.pop()
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self._free(req)
                    self._stopped_in_schedule.append(req)
                    logger.warning(
                        "request %s stopped at %d tokens: the KV cache cannot hold more",
                        req.request_id,
                        req.num_tokens,
                    )
                    break
                victim = self.running.pop()
                self._preempt(victim, swap_out)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                continue  # req was preempted or stopped; self.running[i] is the next one
            self._count_prompt_tokens(req, n)
            num_scheduled[req.request_id] = n
            cached_reqs[req.request_id] = CachedRequestData(
                req.request_id,
                new_blocks,
                req.num_computed_tokens,
                self.kv.take_replaced(req.request_id),
            )
            budget -= n
            i += 1

        while (
            not preempted and self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            mapping = self.kv.swap_in(req, n)
            if mapping is None:
                break
            self.swapped.popleft()
            swap_in.extend(mapping)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(self._new_data(req))
            self._count_prompt_tokens(req, n)
            num_scheduled[req.request_id] = n
            budget -= n

        while (
            not preempted
            and not self.swapped
            and budget > 0
            and len(self.waiting) > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            else:  # forked: it holds the blocks of its first num_computed_tokens already
                hits, num_hit_tokens = [], 0
            n = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            new_blocks = self.kv.allocate_slots(req, n, hits)
            if new_blocks is None:
                break
            self.waiting.pop()
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(self._new_data(req))
            self._count_prompt_tokens(req, n)
            num_scheduled[req.request_id] = n
            budget -= n

        # Batch order: running requests (in running-list order), then the new ones.
        new_ids = {d.req_id for d in new_reqs}
        ordered = {
            r.request_id: num_scheduled[r.request_id]
            for r in self.running
            if r.request_id in num_scheduled and r.request_id not in new_ids
        }
        ordered.update((d.req_id, num_scheduled[d.req_id]) for d in new_reqs)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=[cached_reqs[r] for r in ordered if r in cached_reqs],
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(ordered.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            blocks_to_copy=self.kv.take_pending_copies(),
        )
        self.finished_req_ids = set()
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledToken]
    ) -> list[Request]:
        """Advances the scheduled requests and appends their sampled tokens.

        Args:
            out: this step's `SchedulerOutput`.
            sampled: request id -> its `SampledToken`, for requests whose scheduled tokens
                reached their end (a request mid-prefill samples nothing).

        Returns:
            The requests that received a token this step, and those `schedule()` stopped for
            lack of KV cache (finished ones are already freed; their status says why).
        """
        progressed, self._stopped_in_schedule = self._stopped_in_schedule, []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished meanwhile (e.g. stopped for lack of KV cache)
            req.num_computed_tokens += n
            if req_id not in sampled:
                continue
            token = sampled[req_id].token_id
            req.append_output_token(token, sampled[req_id].logprob)
            if req_id in self.pending_forks:
                self._fork_siblings(req)
            status = self._check_stop(req, token)
            if status is not None:
                req.status = status
                self.running.remove(req)
                self._free(req)
            progressed.append(req)
        return progressed

    def _fork_siblings(self, parent: Request) -> None:
        """The parent has computed its prompt: its siblings share those blocks and compute
        only the last prompt token themselves (to sample their own first token)."""
        shared = parent.num_prompt_tokens - 1
        for child in self.pending_forks.pop(parent.request_id):
            self.kv.fork(parent, child, shared)
            child.num_computed_tokens = shared
            self.waiting.add_front(child)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

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
        )
