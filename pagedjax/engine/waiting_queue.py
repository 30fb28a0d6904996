"""The scheduler's waiting queue: first come first served, or by priority.

Plain Python (no jax). Under "fcfs" a deque; under "priority" a heap on (priority, arrival
time, arrival order), smaller first (vLLM's convention).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

from pagedjax.engine.request import Request


class WaitingQueue:
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
