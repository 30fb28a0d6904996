"""`StructuredOutputManager`: grammar compilation off the step path and the step's bitmask.

Compilation: the first request with a given constraint submits its grammar to a thread pool
(llguidance drops the GIL while it compiles, once it has read the grammar text: see
`grammar` for a large schema's); later requests with an equal constraint (the same
`grammar.grammar_text`, built once per request when it is validated) share the cached future
(an LRU of `CACHE_SIZE` grammars). The llguidance tokenizer (the engine's Hugging Face
tokenizer, as `llguidance.LLTokenizer`) is built once per engine, on the pool, when the
manager is created (during the engine's warm-up: the conversion holds the GIL, so built at
the first constrained request it stalled the running streams for its 0.4 s). A request
waits in the scheduler until its grammar is ready (vLLM's WAITING_FOR_FSM), so a slow
grammar delays only itself. The pool's threads run at a lower CPU priority (nice +
`WORKER_NICENESS`, Linux) so that, where cores are few, a long compilation takes less CPU
from the steps' threads. (Not SCHED_IDLE: a compile thread of that class, starved while it
holds the GIL, stalled the engine thread; on 2 cores busy with 8 streams their slowest step
while a 400-object schema compiled was 3.9-5.5x the median step, against 1.8-2.3x at nice
+ 10 or + 19. What remains is in the steps' device phase, their host phases unchanged: the
compile shares the two cores and the memory bus with XLA's threads, not the GIL. Measured
before `pagedjax.malloc_arenas`; since, SCHED_IDLE with the kernels keeping every core gave a
median largest gap of 1.97-1.98 steps over 6 runs, as leaving a core did, 1.90-2.08, but the
grammar was ready after 1.4-1.5 s instead of 0.34-0.45 s.) So while a
grammar compiles, the manager reports how many do (`on_compiling`), and the engine has the
native CPU kernels leave that many cores to them (`ModelRunner.leave_cores`): the compile
has a core of its own and the steps run on the others. On 2 cores (8 streams, a 400-object
schema, 16 runs each way) the grammar was ready in 0.41-0.51 s instead of 0.70-0.83 s and the
streams lost 30-45 % less step time in all. Served, their largest gap while it compiles is
now a median 1.84 step times (18 runs; a step on the one core left takes 1.4-1.9x), after two
stalls of the engine thread were removed: the compile thread sharing its malloc arena
(`pagedjax.malloc_arenas`) and llguidance parsing a large schema under the GIL (`grammar`)
(benchmarks/README.md, "Structured outputs").

Bitmask: each step, `fill_bitmask` gives the scheduled rows a [rows, ceil(V / 32)] int32 mask
(bit j of word w allows token 32 w + j; llguidance's layout); unconstrained rows and rows that
sample nothing this step (a prefill chunk that is not the last) are all ones. llguidance sets
EOS's bit only where the grammar may end.

Timings, for the metrics: each compilation's and each step fill's duration (seconds) is kept
until `take_timings` drains them (at most `TIMINGS_KEPT` of each), and `stats` keeps totals.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.structured_output.grammar import compile_error_message, grammar_text
from pagedjax.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
TIMINGS_KEPT = 4096  # undrained durations kept per kind
WORKER_NICENESS = 10  # added to the compile threads' nice value
# Fewer constrained rows than this are filled one by one on the scheduler thread: llguidance's
# parallel executor wakes its threads for each call, which cost more than it saved for 8 rows
# on 2 busy cores (15 ms per step against about 0.3 ms per uncached row).
PARALLEL_FILL_MIN_ROWS = 16


def _lower_priority() -> None:
    """Thread initializer: this thread yields the CPU to the engine's (Linux: per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Compiles constraints and fills token bitmasks for one engine.

    Args:
        tokenizer: the engine's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        eos_token_id: the token that ends a sequence (allowed where the grammar may end).
        max_workers: compile threads (default: half the CPUs, 1 to 4).
        on_compiling: called with the number of grammars the pool compiles (those submitted
            and not done, at most its threads) whenever it changes, from the time a grammar is
            submitted; the engine uses it to leave them cores (`ModelRunner.leave_cores`).
            Called under the manager's lock; must be quick and must not raise.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        max_workers: int | None = None,
        on_compiling: Callable[[int], None] | None = None,
    ):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.width = bitmask_width(vocab_size)
        workers = max_workers or min(4, max(1, (os.cpu_count() or 2) // 2))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, "pagedjax-grammar", initializer=_lower_priority
        )
        # built now, on the pool, while the engine warms up: llguidance's conversion of a
        # Hugging Face tokenizer holds the GIL throughout (0.4 s of the 0.65 s it takes for
        # the default model's 49,152 tokens), so built at the first constrained request it
        # stalled every running stream's next step by that much
        self._tokenizer = self._pool.submit(self._build_tokenizer)
        self._executor: llg.LLExecutor | None = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.on_compiling = on_compiling
        self._workers = workers
        self._pending = 0  # grammars submitted to the pool and not done
        self._compile_s: collections.deque = collections.deque(maxlen=TIMINGS_KEPT)
        self._fill_s: collections.deque = collections.deque(maxlen=TIMINGS_KEPT)
        # totals since start: grammars compiled, their seconds, bitmask fills, their seconds
        self.stats = {"compiles": 0, "compile_s": 0.0, "fills": 0, "fill_s": 0.0}

    # ----------------------------------------------------------------- compilation

    def _build_tokenizer(self) -> llg.LLTokenizer:
        import llguidance.hf

        t0 = time.perf_counter()
        tok = llguidance.hf.from_tokenizer(
            self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
        )
        logger.info(
            "structured outputs: llguidance tokenizer built in %.2f s", time.perf_counter() - t0
        )
        return tok

    def _count_compiling(self, delta: int) -> None:
        """Counts grammars submitted and not yet done; tells `on_compiling` how many of them
        the pool runs (at most its threads). Call under `_lock`."""
        self._pending += delta
        if self.on_compiling is not None:
            self.on_compiling(min(self._pending, self._workers))

    def _cancelled(self, fut: concurrent.futures.Future) -> None:
        """Done callback: a compile cancelled before it ran is no longer counted."""
        if fut.cancelled():
            with self._lock:
                self._count_compiling(-1)

    def _compile(self, text: str) -> llg.LLMatcher:
        try:
            tokenizer = self._tokenizer.result()
            t0 = time.perf_counter()
            matcher = llg.LLMatcher(tokenizer, text, log_level=0)
            dt = time.perf_counter() - t0
        finally:  # before the future is done: the step that takes the request has every core
            with self._lock:
                self._count_compiling(-1)
        with self._lock:
            self._compile_s.append(dt)
            self.stats["compiles"] += 1
            self.stats["compile_s"] += dt
        if matcher.is_error():
            error = compile_error_message(text, matcher.get_error())
            raise ValueError(f"the grammar does not compile: {error}")
        return matcher

    def new_request(
        self, so: StructuredOutputsParams, text: str | None = None
    ) -> StructuredOutputRequest:
        """The state of one sequence under `so`; its grammar compiles on the pool (or comes
        from the cache). Call once per sequence (each of n samples has its own matcher).
        `text`: `so`'s `grammar_text`, when the caller has it (the engine's input checks
        built it); None: built here."""
        text = grammar_text(so) if text is None else text
        key = (so.kind, text)
        with self._lock:
            fut = self._cache.get(key)
            submitted = fut is None or (fut.done() and fut.exception() is not None)
            if submitted:
                # counted from now, so that the step that follows already leaves the compile
                # its core (not from when the pool's thread starts it, mid-step)
                self._count_compiling(1)
                fut = self._pool.submit(self._compile, text)
                self._cache[key] = fut
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if submitted:  # outside the lock: a future already done runs its callback here
            fut.add_done_callback(self._cancelled)
        return StructuredOutputRequest(so.kind, fut)

    def wait_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Blocks until one of `requests`' grammars is ready or `timeout` seconds pass (the
        scheduler calls it only when nothing else can run)."""
        concurrent.futures.wait(
            [r.compiled for r in requests],
            timeout=timeout,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    # ----------------------------------------------------------------- bitmasks

    def fill_bitmask(self, rows: list[StructuredOutputRequest | None]) -> np.ndarray:
        """[len(rows), ceil(V / 32)] int32: each constrained row's allowed next tokens, -1
        (all allowed) for None rows."""
        t0 = time.perf_counter()
        mask = np.full((len(rows), self.width), -1, np.int32)
        work = [(r.get_matcher(), i) for i, r in enumerate(rows) if r is not None]
        if len(work) < PARALLEL_FILL_MIN_ROWS:
            for matcher, i in work:
                llg_np.fill_next_token_bitmask(matcher, mask, i)
        else:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            llg_np.fill_next_token_bitmask_par(self._executor, work, mask)
        dt = time.perf_counter() - t0
        self._fill_s.append(dt)
        self.stats["fills"] += 1
        self.stats["fill_s"] += dt
        return mask

    def take_timings(self) -> tuple[list[float], list[float]]:
        """The compile and fill durations (seconds) recorded since the last call."""
        with self._lock:
            compiles = list(self._compile_s)
            self._compile_s.clear()
        fills = list(self._fill_s)
        self._fill_s.clear()
        return compiles, fills

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
