"""`StructuredOutputManager`: grammar compilation off the step path and the step's bitmask.

Compilation: the first request with a given constraint starts its grammar's compilation
(`compilation.Compilation`: on a thread pool in Linux's idle scheduling class, so that it takes
only CPU time the steps leave; expedited to a normal-priority thread when its request has
waited too long, see `compilation`); llguidance drops the GIL while it compiles, once it has
read the grammar text (see `grammar` for a large schema's, whose repeated subschemas are
first shared through `$defs` on the normal-priority thread: `shared_subschemas`). Later
requests with an equal constraint (the same `grammar.grammar_text`, built once per request
when it is validated) share the cached compilation (an LRU of `CACHE_SIZE` grammars). A
request waits in the scheduler until its grammar is ready (vLLM's WAITING_FOR_FSM), so a
slow grammar delays only itself.

The llguidance tokenizer (the engine's Hugging Face tokenizer, as `llguidance.LLTokenizer`)
is built once per engine, on the normal-priority thread (its conversion holds the GIL
throughout, 0.4 s of the 0.65 s it takes for the default model's 49,152 tokens: a starved
holder of the GIL would stall the engine thread), when the manager is created during the
engine's warm-up (built at the first constrained request, it stalled the running streams'
next step by those 0.4 s).

Bitmask: each step, `fill_bitmask` gives the scheduled rows a [rows, ceil(V / 32)] int32 mask
(bit j of word w allows token 32 w + j; llguidance's layout); unconstrained rows and rows that
sample nothing this step (a prefill chunk that is not the last) are all ones. llguidance sets
EOS's bit only where the grammar may end.

Timings, for the metrics: each compilation's and each step fill's duration (seconds) is kept
until `take_timings` drains them (at most `TIMINGS_KEPT` of each), and `stats` keeps totals.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.structured_output.compilation import Compilation, CompilePools, wait_any
from pagedjax.structured_output.grammar import INLINE_JSON, compile_error_message, grammar_text
from pagedjax.structured_output.request import StructuredOutputRequest
from pagedjax.structured_output.shared_subschemas import shared_form

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
TIMINGS_KEPT = 4096  # undrained durations kept per kind
# Fewer constrained rows than this are filled one by one on the scheduler thread: llguidance's
# parallel executor wakes its threads for each call, which cost more than it saved for 8 rows
# on 2 busy cores (15 ms per step against about 0.3 ms per uncached row).
PARALLEL_FILL_MIN_ROWS = 16


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
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        max_workers: int | None = None,
    ):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.width = bitmask_width(vocab_size)
        workers = max_workers or min(4, max(1, (os.cpu_count() or 2) // 2))
        self._pools = CompilePools(workers)
        # built now, while the engine warms up, at normal priority (see the docstring)
        self._tokenizer = self._pools.normal.submit(self._build_tokenizer)
        self._executor: llg.LLExecutor | None = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.RLock()
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

    def _compile(self, text: str) -> list:
        """On a pool's thread: [the grammar's matcher (perhaps in error), its seconds, the
        compile error's message or None]. The message is made here, not by `_finish` on the
        engine thread: for a large schema it compiles the schema again."""
        tokenizer = self._tokenizer.result()
        t0 = time.perf_counter()
        compiled = text
        if text.startswith(INLINE_JSON):  # a large schema: its repeated subschemas shared
            compiled = self._pools.run_holding_gil(shared_form, text)
        matcher = llg.LLMatcher(tokenizer, compiled, log_level=0)
        dt = time.perf_counter() - t0
        error = compile_error_message(text, matcher.get_error()) if matcher.is_error() else None
        return [matcher, dt, error]

    def _finish(self, compiled: list) -> llg.LLMatcher:
        """The first compile to finish (`Compilation.poll`, on the engine thread): counted, and
        its matcher or its error."""
        matcher, dt, error = compiled
        with self._lock:
            self._compile_s.append(dt)
            self.stats["compiles"] += 1
            self.stats["compile_s"] += dt
        if error is not None:
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
            comp = self._cache.get(key)
            if comp is None or (comp.future.done() and comp.future.exception() is not None):
                comp = Compilation(
                    self._pools,
                    functools.partial(self._compile, text),
                    self._finish,
                )
                self._cache[key] = comp
                while len(self._cache) > CACHE_SIZE:  # the oldest freed off this thread
                    self._pools.release([self._cache.popitem(last=False)[1]])
            else:
                self._cache.move_to_end(key)
        return StructuredOutputRequest(so.kind, comp)

    def release(self, request: StructuredOutputRequest) -> None:
        """Lets go of an ended sequence's grammar on the normal-priority thread: where the
        cache has evicted its grammar, the sequence held the last references, and freeing them
        on the engine thread would stall the steps (`StructuredOutputRequest.release`)."""
        self._pools.release(request.release())

    def wait_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Blocks until one of `requests`' grammars is ready or `timeout` seconds pass (the
        scheduler calls it only when nothing else can run)."""
        wait_any([r.compilation for r in requests], timeout)

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
        self._pools.shutdown()
