"""The scheduler's structured-output helpers: the queue of requests whose grammar is still
compiling (vLLM's WAITING_FOR_FSM), and the bitmask rows of a step's batch.

Kept out of `engine.scheduler` so that unconstrained scheduling stays as it was: the
scheduler asks this queue, at the start of each step, which requests may now wait for blocks
like any other, and which failed to compile (they end with finish_reason "error").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.structured_output.compilation import EXPEDITE_AFTER_S

if TYPE_CHECKING:
    from pagedjax.engine.interface import ScheduledSeq
    from pagedjax.engine.request import Request
    from pagedjax.structured_output.manager import StructuredOutputManager

WAIT_WHEN_IDLE_S = 0.005  # how long schedule() blocks on a compile when nothing else can run


class GrammarWaitQueue:
    """Requests whose grammar is compiling, in arrival order."""

    def __init__(self) -> None:
        self._reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, req: Request) -> None:
        self._reqs.append(req)

    def remove(self, reqs: Iterable[Request]) -> None:
        gone = {id(r) for r in reqs}
        self._reqs = [r for r in self._reqs if id(r) not in gone]

    def take_done(
        self, manager: StructuredOutputManager, idle: bool
    ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Removes and returns the requests whose grammar compiled, and (request, error) of
        those whose grammar failed. A grammar that has compiled for `EXPEDITE_AFTER_S` on the
        idle-class pool, or any with `idle` (nothing else to run), is expedited to the
        normal-priority one (`compilation`). With `idle`, first waits up to WAIT_WHEN_IDLE_S
        for one to finish instead of letting the engine spin."""
        if not self._reqs:
            return [], []
        for r in self._reqs:  # nothing else to run, or waited long enough: normal priority
            if idle or r.structured_output.waited() >= EXPEDITE_AFTER_S:
                r.structured_output.expedite()
        if idle:
            manager.wait_any([r.structured_output for r in self._reqs], WAIT_WHEN_IDLE_S)
        ready, failed, kept = [], [], []
        for r in self._reqs:
            so = r.structured_output
            if not so.is_ready():
                kept.append(r)
            elif (error := so.compile_error()) is not None:
                if not error.startswith("structured_outputs"):
                    error = f"structured_outputs.{so.kind} is invalid: {error}"
                failed.append((r, error))
            else:
                ready.append(r)
        self._reqs = kept
        return ready, failed


def step_bitmask(
    manager: StructuredOutputManager, reqs: list[Request], seqs: list[ScheduledSeq]
) -> np.ndarray | None:
    """The step's [len(seqs), ceil(V / 32)] int32 bitmask (batch order), or None when no
    scheduled row that samples is constrained (the step then carries no mask)."""
    rows = [
        r.structured_output if r.structured_output is not None and s.samples else None
        for r, s in zip(reqs, seqs, strict=True)
    ]
    if not any(row is not None for row in rows):
        return None
    return manager.fill_bitmask(rows)
