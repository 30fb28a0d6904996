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
normal-priority thread). The result is taken by the engine thread when it next looks
(`Compilation.poll`), never handed over by the thread that ran the compile: that thread would
hold the compiled grammar until it goes on, which an idle-class thread does only when it gets
a core, so an ended request's grammar could be freed there, holding the GIL.

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
import contextlib
import os
import threading
import time
import weakref
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
        # its thread starts now, from this one: a thread takes its scheduling class from the
        # thread that starts it, and one started by an idle-class thread's first submit (a
        # release) would stay in the idle class (`_lower_priority` only changes its nice value)
        self.normal.submit(lambda: None)

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


class _Runs:
    """A compilation's runs, as their done callbacks see them (on the threads that ran them,
    or that cancelled them). The callbacks hold this, never the `Compilation`: a pool's thread
    that is slow to go on after its run (an idle-class one waits for a core) then holds
    nothing of the compiled grammar, which `Compilation.poll` takes out of the run's result
    list and is freed where the compilation's last reference goes."""

    def __init__(self, pools: CompilePools):
        self.pools = pools
        self.lock = threading.Lock()
        self.submitted: list[concurrent.futures.Future] = []
        self.ended: list[concurrent.futures.Future] = []  # before `settled`, in the order ended
        self.settled = False  # `poll` took a result (or the compilation is gone)
        # set once a run has finished, or every run was cancelled: `poll` can then settle
        self.finished: concurrent.futures.Future = concurrent.futures.Future()

    def _can_settle(self) -> bool:
        """A run has finished, or every run was cancelled (call under `lock`)."""
        return len(self.ended) == len(self.submitted) or any(not r.cancelled() for r in self.ended)

    def on_done(self, run: concurrent.futures.Future) -> None:
        with self.lock:
            if not self.settled:
                self.ended.append(run)
                if self._can_settle() and not self.finished.done():
                    self.finished.set_result(None)
                return
        self.discard(run)

    def settle(self, force: bool = False) -> list[concurrent.futures.Future] | None:
        """Marks it settled, if it can be (`force`: in any case; None if it cannot, or already
        is), cancels the runs still queued, and returns those that ended before, in order."""
        with self.lock:
            if self.settled or not (force or self._can_settle()):
                return None
            self.settled = True
            ended, self.ended = self.ended, []
            pending = [r for r in self.submitted if r not in ended]
        for run in pending:  # a run still queued need not start (outside the lock: its
            run.cancel()  # callback, `on_done`, runs here and discards what it gave)
        return ended

    def discard(self, run: concurrent.futures.Future) -> None:
        """A run's result that will not be used: emptied on the normal-priority thread
        (`CompilePools.release`; freeing a 400-object schema's matcher holds the GIL 13-15
        ms, and an idle-class thread holding it could be starved while the engine thread
        waits for it)."""
        if not run.cancelled() and run.exception() is None:
            self.pools.release(run.result())

    def abandon(self) -> None:
        """The compilation is gone: a queued run need not start, a result is not used."""
        for run in self.settle(force=True) or []:
            self.discard(run)


class Compilation:
    """One grammar's compilation, started on the idle-class pool.

    Args:
        pools: where it runs.
        compile_fn: called with no arguments on a pool's thread; returns the raw result, a
            list, which is emptied on the normal-priority thread once used or not.
        finish: turns the first raw result to arrive into `future`'s result (it may raise:
            `future` then holds that exception); called once, by `poll`.

    `future` is settled by `poll`, on the thread that calls it (the engine's, each step for a
    request that waits for its grammar), with the first run to have finished, and a run still
    queued then is cancelled; `future` is cancelled only when every run was (the pools shut
    down before they ran). The pools' threads hold no reference to this object (`_Runs`), so
    it and its result are freed where its last reference goes (`CompilePools.release` puts
    that on the normal-priority thread); dropped before it settled, its queued runs are
    cancelled and a result is freed there too.
    """

    def __init__(
        self, pools: CompilePools, compile_fn: Callable[[], Any], finish: Callable[[Any], Any]
    ):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started = time.monotonic()
        self.expedited = False
        self._compile = compile_fn
        self._finish = finish
        self._runs = _Runs(pools)
        self._submit(pools.idle)
        weakref.finalize(self, self._runs.abandon).atexit = False

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        run = pool.submit(self._compile)
        with self._runs.lock:
            self._runs.submitted.append(run)
        run.add_done_callback(self._runs.on_done)

    def expedite(self) -> None:
        """Also runs it on the normal-priority pool (once; nothing if it is settled)."""
        with self._runs.lock:
            if self.expedited or self._runs.settled:
                return
            self.expedited = True
        with contextlib.suppress(RuntimeError):  # the pools are shut down: nothing runs
            self._submit(self._runs.pools.normal)

    def poll(self) -> bool:
        """Settles `future` here if a run has finished (or every run was cancelled); True
        once `future` is done. Cheap when nothing has: a lock and a list."""
        if self.future.done():
            return True
        runs = self._runs
        ended = runs.settle()
        if ended is None:  # nothing finished yet, or another thread's poll is settling it
            return False
        results = [r for r in ended if not r.cancelled()]
        if not results:  # every run cancelled
            self.future.cancel()
            self.future.set_running_or_notify_cancel()  # wakes its waiters
            return True
        for run in results[1:]:
            runs.discard(run)
        won = results[0]
        try:
            result = self._finish(won.result())
        except Exception as e:  # the compile's own error, or finish's
            self.future.set_exception(e)
        else:
            self.future.set_result(result)
        runs.discard(won)  # its list: `finish` keeps what it needs
        return True

    def result(self, timeout: float | None = None) -> Any:
        """Waits up to `timeout` seconds (None: no limit) for a run to finish, settles, and
        returns `future`'s result. Raises its exception, CancelledError, or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        concurrent.futures.wait([self._runs.finished], timeout)
        self.poll()  # (or another thread's poll is settling it: waits for that)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.future.result(left)


def wait_any(compilations: list[Compilation], timeout: float) -> None:
    """Blocks until one of `compilations` can settle (`Compilation.poll`), or `timeout`
    seconds pass."""
    concurrent.futures.wait(
        [c._runs.finished for c in compilations],
        timeout=timeout,
        return_when=concurrent.futures.FIRST_COMPLETED,
    )
