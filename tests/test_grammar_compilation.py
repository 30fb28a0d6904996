"""Where grammars compile (`structured_output.compilation`) and when the scheduler expedites
them (`structured_output.scheduling.GrammarWaitQueue`): the idle-class pool first, a
normal-priority thread once the request has waited `EXPEDITE_AFTER_S` or the engine has nothing
else to run, and the first run to finish gives the result."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest

from pagedjax.structured_output import compilation as comp_mod
from pagedjax.structured_output.compilation import Compilation, CompilePools
from pagedjax.structured_output.scheduling import GrammarWaitQueue

linux = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")


def _where() -> tuple[int, int]:
    """This thread's scheduling class and nice value."""
    tid = threading.get_native_id()
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def pools():
    p = CompilePools(1)
    yield p
    p.shutdown()


class Tracked:
    """Records the scheduling class of the thread that frees it."""

    def __init__(self, freed: list):
        self.freed = freed

    def __del__(self):
        self.freed.append(os.sched_getscheduler(0))


class Held:
    """A compile that records where it ran and returns [its tag, a Tracked] once released."""

    def __init__(self):
        self.where: list[tuple[int, int]] = []
        self.freed: list[int] = []
        self.started = threading.Semaphore(0)
        self.release = {"idle": threading.Event(), "normal": threading.Event()}

    def __call__(self):
        where = _where()
        self.where.append(where)
        self.started.release()
        tag = "idle" if where[0] == getattr(os, "SCHED_IDLE", -1) else "normal"
        assert self.release[tag].wait(30)
        return [tag, Tracked(self.freed)]


@linux
def test_a_compilation_starts_in_the_idle_class_and_expedites_to_normal_priority(pools):
    """It runs on an idle-class thread; expedited, it also runs at nice + WORKER_NICENESS
    (never the idle class), and the first run to finish gives the result, finished once; the
    losing idle run's result is freed on the normal thread (freeing a matcher holds the GIL)."""
    nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    held, finished = Held(), []
    # finish keeps the Tracked, as the manager's keeps the matcher out of the run's result
    c = Compilation(pools, held, lambda r: finished.append(r[0]) or (r[0].upper(), r[1]))
    assert held.started.acquire(timeout=30)
    assert held.where == [(os.SCHED_IDLE, nice)]
    assert not c.future.done() and not c.expedited
    c.expedite()
    c.expedite()  # once only
    assert held.started.acquire(timeout=30)
    assert held.where[1] == (os.SCHED_OTHER, min(nice + comp_mod.WORKER_NICENESS, 19))
    held.release["normal"].set()
    assert c.result(30)[0] == "NORMAL"
    held.release["idle"].set()  # the idle run ends later: its result is freed, not there
    pools.idle.submit(lambda: None).result(30)  # the idle run is done, and settled
    pools.normal.submit(lambda: None).result(30)  # and the normal thread has freed it
    assert c.future.result()[0] == "NORMAL" and finished == ["normal"]
    assert len(held.where) == 2 and held.freed == [os.SCHED_OTHER]


def test_the_idle_run_can_win_and_a_queued_run_is_cancelled(pools):
    """Without expedite the idle run gives the result; a run still queued when the result
    arrives never starts; finish's error becomes the future's."""
    block = threading.Event()
    pools.normal.submit(block.wait, 30)  # the normal thread is busy: an expedited run queues
    ran = []
    c = Compilation(pools, lambda: ran.append(1) or ["x"], lambda r: r[0] * 2)
    c.expedite()
    assert c.result(30) == "xx"
    block.set()
    pools.normal.submit(lambda: None).result(30)
    assert ran == [1]
    bad = Compilation(pools, lambda: ["y"], lambda r: (_ for _ in ()).throw(ValueError("bad: y")))
    with pytest.raises(ValueError, match="bad: y"):
        bad.result(30)


def test_a_compilation_of_shut_down_pools_is_cancelled():
    """Pools shut down before the run started: the future is cancelled (its waiters woken),
    and expedite does nothing."""
    p = CompilePools(1)
    block = threading.Event()
    p.idle.submit(block.wait, 30)
    c = Compilation(p, lambda: ["never"], lambda r: r)
    p.shutdown()
    block.set()
    assert c.poll() and c.future.cancelled()
    c.expedite()
    assert c.future.cancelled()


class FakeSO:
    """The part of a StructuredOutputRequest the wait queue uses."""

    def __init__(self, waited: float):
        self._waited = waited
        self.expedited = 0
        self.compiled = None

    def waited(self) -> float:
        return self._waited

    def expedite(self) -> None:
        self.expedited += 1

    def is_ready(self) -> bool:
        return False


class FakeReq:
    def __init__(self, waited: float):
        self.structured_output = FakeSO(waited)


class FakeManager:
    def __init__(self):
        self.waits = []

    def wait_any(self, sos, timeout):
        self.waits.append((len(sos), timeout))


def test_the_wait_queue_expedites_after_the_wait_or_when_idle():
    """Busy: only a request that has waited EXPEDITE_AFTER_S is expedited; idle (nothing else
    to run): every waiting request is, and the queue waits briefly for one."""
    q, mgr = GrammarWaitQueue(), FakeManager()
    short, long_ = FakeReq(0.2), FakeReq(comp_mod.EXPEDITE_AFTER_S + 0.1)
    q.add(short)
    q.add(long_)
    assert q.take_done(mgr, idle=False) == ([], [])
    assert (short.structured_output.expedited, long_.structured_output.expedited) == (0, 1)
    assert mgr.waits == []
    assert q.take_done(mgr, idle=True) == ([], [])
    assert short.structured_output.expedited == 1 and len(q) == 2
    assert len(mgr.waits) == 1 and mgr.waits[0][0] == 2


def test_python_work_of_a_compile_runs_on_the_normal_thread(pools):
    def name() -> str:
        return threading.current_thread().name

    # from an idle-class thread: on the normal one; from the normal one: there (no deadlock)
    assert (
        pools.idle.submit(pools.run_holding_gil, name)
        .result(30)
        .startswith(comp_mod.NORMAL_THREAD_NAME)
    )
    assert (
        pools.normal.submit(pools.run_holding_gil, name)
        .result(30)
        .startswith(comp_mod.NORMAL_THREAD_NAME)
    )
    with pytest.raises(ZeroDivisionError):  # its error reaches the caller
        pools.run_holding_gil(lambda: 1 / 0)
    pools.shutdown()
    assert pools.run_holding_gil(name) == threading.current_thread().name  # shut down: here


class Named:
    """Records the name of the thread that frees it."""

    def __init__(self, freed: list):
        self.freed = freed

    def __del__(self):
        self.freed.append(threading.current_thread().name)


def test_release_frees_on_the_normal_thread(pools):
    freed: list[str] = []
    pools.release([Named(freed)])
    pools.normal.submit(lambda: None).result(30)  # after the release's task
    assert len(freed) == 1 and freed[0].startswith(comp_mod.NORMAL_THREAD_NAME)
    pools.shutdown()
    pools.release([Named(freed)])  # shut down: freed here
    assert freed[1] == threading.current_thread().name


@pytest.fixture
def no_cyclic_gc():
    """Python's cyclic collector off: what is freed is freed by reference counting, where its
    last reference goes."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_a_settled_compilation_is_freed_where_its_last_reference_goes(pools, no_cyclic_gc):
    """Once every run has settled (a single run; one expedited after its result, which runs
    nothing; one whose expedited run was still queued and is cancelled), the compilation is in
    no reference cycle: released, it and its result are freed on the normal-priority thread,
    not whenever the cyclic collector runs, on any thread (its runs' callbacks kept it)."""
    block = threading.Event()
    pools.normal.submit(block.wait, 30)  # the expedited run of `cancelled` queues behind it
    freed: list[str] = []
    plain = Compilation(pools, lambda: [Named(freed)], lambda r: r[0])
    held = Held()
    raced = Compilation(pools, held, lambda r: Named(freed))
    assert held.started.acquire(timeout=30)
    cancelled = Compilation(pools, lambda: ["x"], lambda r: Named(freed))
    cancelled.expedite()  # queued on the normal thread, then cancelled by the idle run's result
    held.release["idle"].set()
    for c in (plain, raced, cancelled):
        c.result(30)
    block.set()
    raced.expedite()  # after the result: nothing runs
    pools.normal.submit(lambda: None).result(30)
    assert held.where[1:] == [] and freed == []
    pools.release([plain, raced, cancelled])
    del plain, raced, cancelled, c
    pools.normal.submit(lambda: None).result(30)
    assert len(freed) == 3 and all(f.startswith(comp_mod.NORMAL_THREAD_NAME) for f in freed)


class StallAfterResult:
    """Stands in for a pool: each run's thread stalls, after the run's result is set and its
    first done callback has run, until `go` is set, as an idle-class thread starved by the
    steps' threads (on 2 busy cores, for as long as they keep both)."""

    def __init__(self, pool):
        self.pool = pool
        self.go = threading.Event()

    def submit(self, fn, *args):
        run = self.pool.submit(fn, *args)
        add = run.add_done_callback

        def add_then_stall(callback):
            add(callback)
            add(lambda _: self.go.wait(30))

        run.add_done_callback = add_then_stall
        return run

    def shutdown(self, **kw):
        self.go.set()
        self.pool.shutdown(**kw)


def test_a_stalled_run_thread_holds_nothing_of_a_settled_compilation(pools, no_cyclic_gc):
    """Once a compilation's result is out, the thread that ran it holds no reference to it or
    its result: released while that thread is stalled (an idle-class thread waiting for a
    core), both are freed on the normal-priority thread. They were held by the stalled thread
    (its run's callback was bound to the compilation, and its result list held the matcher),
    and freed there when it went on: in CI, the grammar of an ended request was freed on the
    idle-class thread."""
    gate = threading.Event()
    pools.idle.submit(gate.wait, 30)  # the run is queued, so the stall is in place before it
    pools.idle = StallAfterResult(pools.idle)
    freed: list[str] = []
    c = Compilation(pools, lambda: [Named(freed)], lambda r: r[0])
    weakref.finalize(c, lambda: freed.append("compilation: " + threading.current_thread().name))
    gate.set()
    assert isinstance(c.result(30), Named)
    pools.release([c])
    del c
    pools.normal.submit(lambda: None).result(30)
    pools.idle.go.set()
    assert len(freed) == 2, freed
    assert all(comp_mod.NORMAL_THREAD_NAME in f for f in freed), freed


@linux
def test_a_compilation_dropped_before_it_settles_is_cancelled_and_freed_off_the_run(pools):
    """Dropped while its run compiles (its request aborted, the cache evicted it): a run still
    queued never starts, and the running one's result is freed on the normal-priority thread,
    not on the idle-class thread that ran it."""
    held, ran = Held(), []
    running = Compilation(pools, held, lambda r: r)
    assert held.started.acquire(timeout=30)
    queued = Compilation(pools, lambda: ran.append(1) or ["x"], lambda r: r)
    del running, queued
    held.release["idle"].set()
    pools.idle.submit(lambda: None).result(30)  # after the runs (and their callbacks)
    pools.normal.submit(lambda: None).result(30)  # after the release's task
    assert ran == [] and held.freed == [os.SCHED_OTHER]
