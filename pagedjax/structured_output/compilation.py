"""Where, and at which CPU priority, a grammar compiles: two thread pools and `Compilation`.

A grammar first compiles on a pool whose threads run in Linux's idle scheduling class
(SCHED_IDLE; elsewhere, or where that is refused, at nice + `WORKER_NICENESS`): it takes only
CPU time that nothing else wants, and a step's thread that wakes takes the core back at once,
so the running streams keep their step times. Where the steps leave cores spare (more cores
than the step's threads, or an accelerator's steps) it compiles at full speed; where they keep
every core busy (a CPU-only engine on few cores) it compiles in the gaps between their work,
and its request waits longer (it waits alone: vLLM's WAITING_FOR_FSM).

A thread in the idle class can be starved for as long as other work keeps every core busy
(other processes included: beside two busy processes on 2 cores, a 400-object schema had not
compiled after minutes), and an unprivileged thread cannot leave that class. So the scheduler
`expedite`s a compilation once its request has waited `EXPEDITE_AFTER_S`, or at once when the
engine has nothing else to run: the same grammar is then also submitted to a pool at normal
priority, nice + `WORKER_NICENESS`, and the first of the two to finish gives the result (the
other is cancelled if still queued; if running, it runs on and its result is freed on the
normal-priority thread).

Where the operator reserves CPUs for such work (`PAGEDJAX_CPU_NUM_OF_RESERVED_CPU`,
`reserved_cpus`), both pools' threads run on those CPUs, which the steps' threads do not use:
a compile there has a core of its own.

Measured on 2 cores with 8 streams (benchmarks/README.md, "The compile in the idle scheduling
class"): while a new 400-object schema compiled in the idle class, 90 % of the streams' gaps
between tokens stayed within 1.27-1.63 of the step before (no grammar at all: 1.22-1.27),
against 1.77-2.67 when it compiled at nice + 10 with the native kernels leaving it a core (the
engine before); its request waited 1.6-2.8 s instead of 0.5-0.9 s. At nice + 10 or 19 beside
the kernels on every core the gaps were in between (a task that gets a core keeps it for its
time slice whatever its nice value; an idle-class task gives way to any waking thread).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedjax import reserved_cpus

WORKER_NICENESS = 10  # added to the normal-priority compile threads' nice value
EXPEDITE_AFTER_S = 5.0  # a request waits this long for an idle-class compile, at most
NORMAL_THREAD_NAME = "pagedjax-grammar-normal"  # the normal-priority pool's thread's name


def _lower_priority() -> None:
    """Thread initializer: this thread's nice value + `WORKER_NICENESS` (Linux: per thread),
    on the reserved CPUs if any (`reserved_cpus`)."""
    reserved_cpus.pin_to_reserved()
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def _idle_priority() -> None:
    """Thread initializer: this thread runs only on CPU time nothing else wants (Linux's
    SCHED_IDLE, per thread; a thread may always lower itself to it), on the reserved CPUs if
    any (`reserved_cpus`). Elsewhere, or where the idle class is refused, `_lower_priority`."""
    reserved_cpus.pin_to_reserved()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        _lower_priority()


class CompilePools:
    """The idle-class pool (`workers` threads) and the normal-priority one (1 thread, also
    used for one-off work that must not starve, such as building the llguidance tokenizer,
    whose conversion holds the GIL)."""

    def __init__(self, workers: int):
        self.idle = concurrent.futures.ThreadPoolExecutor(
            workers, "pagedjax-grammar", initializer=_idle_priority
        )
        self.normal = concurrent.futures.ThreadPoolExecutor(
            1, NORMAL_THREAD_NAME, initializer=_lower_priority
        )

    def run_holding_gil(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on the normal-priority thread (here if this is that thread, or the pools
        are shut down), for a compile's Python work: an idle-class thread holding the GIL could
        be starved while the engine thread waits for it. Blocks until it returns; raises what
        it raises."""
        if threading.current_thread().name.startswith(NORMAL_THREAD_NAME):
            return fn(*args)
        try:
            run = self.normal.submit(fn, *args)
        except RuntimeError:  # shut down
            return fn(*args)
        return run.result()

    def release(self, box: list) -> None:
        """Empties `box` on the normal-priority thread (here if the pools are shut down): where
        it holds the last references to its items, they are freed there, not on the caller's
        thread (freeing a 400-object schema's compiled grammar holds the GIL for 6-15 ms). The
        caller keeps no other reference to them."""
        try:
            self.normal.submit(box.clear)
        except RuntimeError:
            box.clear()

    def shutdown(self) -> None:
        self.idle.shutdown(wait=False, cancel_futures=True)
        self.normal.shutdown(wait=False, cancel_futures=True)


class Compilation:
    """One grammar's compilation, started on the idle-class pool.

    Args:
        pools: where it runs.
        compile_fn: called with no arguments on a pool's thread; returns the raw result, a
            list (a losing run's list is emptied, its items freed on the normal thread).
        finish: turns the first raw result to arrive into `future`'s result (it may raise:
            `future` then holds that exception); called once, under this object's lock.

    `future` settles with the first run to finish, and a run still queued then is cancelled;
    `future` is cancelled only when every run was (the pools shut down before they ran).
    """

    def __init__(
        self, pools: CompilePools, compile_fn: Callable[[], Any], finish: Callable[[Any], Any]
    ):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started = time.monotonic()
        self.expedited = False
        self._pools = pools
        self._compile = compile_fn
        self._finish = finish
        self._lock = threading.Lock()
        self._runs = 1  # submitted and not settled
        self._submitted = [pools.idle.submit(compile_fn)]
        self._submitted[0].add_done_callback(self._settle)

    def expedite(self) -> None:
        """Also runs it on the normal-priority pool (once; nothing if it is done)."""
        with self._lock:
            if self.expedited or self.future.done():
                return
            self.expedited = True
            self._runs += 1
        try:
            run = self._pools.normal.submit(self._compile)
        except RuntimeError:  # the pools are shut down
            with self._lock:
                self._runs -= 1
                if self._runs == 0:
                    self._forget_runs()
            return
        self._submitted.append(run)
        run.add_done_callback(self._settle)

    def _settle(self, run: concurrent.futures.Future) -> None:
        with self._lock:
            self._runs -= 1
            try:
                if self.future.done():
                    self._discard(run)
                    return
                if run.cancelled():
                    if self._runs == 0:
                        self.future.cancel()
                        self.future.set_running_or_notify_cancel()  # wakes its waiters
                    return
                try:
                    result = self._finish(run.result())
                except Exception as e:  # the compile's own error, or finish's
                    self.future.set_exception(e)
                else:
                    self.future.set_result(result)
                pending = self._submitted
            finally:
                if self._runs == 0:  # every run settled: see `_forget_runs`
                    self._forget_runs()
        for other in pending:  # a run still queued need not start (outside the lock:
            other.cancel()  # cancelling runs its callback, this method, here)

    def _forget_runs(self) -> None:
        """Drops the runs' futures once each has settled. Each holds `_settle` bound to this
        object, so while this object holds them it is in a reference cycle, which only Python's
        cyclic collector frees, on whatever thread it happens to run (often the engine's);
        without the cycle it is freed where its last reference goes, which
        `CompilePools.release` puts on the normal-priority thread."""
        self._submitted = []

    def _discard(self, run: concurrent.futures.Future) -> None:
        """Frees a losing run's result on the normal-priority thread: freeing a large matcher
        holds the GIL (13-15 ms for a 400-object schema's), and an idle-class thread holding
        it could be starved while the engine thread waits for it. The result is a list, which
        the normal thread empties (`CompilePools.release`)."""
        self._submitted = [f for f in self._submitted if f is not run]
        if run.cancelled() or run.exception() is not None:
            return
        self._pools.release(run.result())
