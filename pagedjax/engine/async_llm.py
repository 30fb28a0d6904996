"""AsyncLLM: the engine for the server, driven by a background thread off the event loop.

    event loop (FastAPI handlers)              engine thread
    add_requests() --("add", ...)-->  commands  --> LLMEngine.add_request   (ack or ValueError)
    RequestStream.abort() --("abort", id)-->    --> LLMEngine.abort_request (blocks freed)
                                                    LLMEngine.step() -> RequestOutputs (DELTA)
    RequestStream (asyncio.Queue) <--call_soon_threadsafe-- per-request outputs, metrics

The `LLMEngine` is not thread-safe, so only the engine thread touches it; the event loop
talks to it through a command queue and gets each request's outputs through that request's
own `asyncio.Queue`. The thread sleeps on the command queue while no request is unfinished,
and otherwise drains the commands between two steps, so a new request waits at most one step
to be admitted. The engine always runs requests with `output_kind=DELTA`; each stream turns
the deltas into what its caller asked for (DELTA, CUMULATIVE or FINAL_ONLY), and the thread
records the Prometheus metrics from them (see `pagedjax.engine.prometheus`).

Failure isolation: a `ValueError` from `add_request` (bad prompt or parameters) reaches the
caller of `add_requests` and queues nothing. If a step raises, the requests then in flight
fail with `EngineError` and are aborted (their blocks freed); the engine keeps serving new
requests. Only if the engine cannot even abort them does it stop (`errored`, and every
stream and later call gets `EngineDeadError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedjax.engine.dp_engine import DataParallelEngine, create_engine
from pagedjax.engine.engine import LLMEngine
from pagedjax.engine.prometheus import PrometheusStatLogger
from pagedjax.engine.scheduler import SchedulerStats
from pagedjax.engine_args import EngineArgs
from pagedjax.inputs import PromptType
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An internal failure while running a request (not the caller's mistake)."""


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can run any more."""


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of one unfinished request (times from time.monotonic())."""

    stream: RequestStream
    arrival: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


class RequestStream:
    """The outputs of one request, as an async iterator of `RequestOutput`.

    Iteration ends after the finished output; it raises `EngineError` if the request failed
    inside the engine. `abort()` (also called when the consumer stops early) frees the
    request's blocks; it is idempotent.
    """

    def __init__(self, request_id: str, output_kind: RequestOutputKind, engine: AsyncLLM):
        self.request_id = request_id
        self.output_kind = output_kind
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._acc: RequestOutput | None = None  # the outputs so far (CUMULATIVE, FINAL_ONLY)

    def _put(self, item: RequestOutput | BaseException) -> None:  # event loop thread
        self._queue.put_nowait(item)

    def _merge(self, delta: RequestOutput) -> RequestOutput | None:
        """Folds an engine delta into what the caller asked for; None when nothing is due."""
        if self.output_kind == RequestOutputKind.DELTA:
            return delta
        if self._acc is None:
            self._acc = dataclasses.replace(delta, outputs=[_copy(o) for o in delta.outputs])
        else:
            by_index = {o.index: o for o in self._acc.outputs}
            for d in delta.outputs:
                acc = by_index.get(d.index)
                if acc is None:
                    self._acc.outputs.append(_copy(d))
                    continue
                acc.text += d.text
                acc.token_ids = acc.token_ids + list(d.token_ids)
                if d.logprobs is not None:
                    acc.logprobs = (acc.logprobs or []) + list(d.logprobs)
                acc.cumulative_logprob = d.cumulative_logprob
                acc.finish_reason, acc.stop_reason = d.finish_reason, d.stop_reason
            self._acc.finished = delta.finished
            self._acc.num_cached_tokens = delta.num_cached_tokens
            self._acc.metrics = delta.metrics
            if delta.prompt_logprobs is not None:
                self._acc.prompt_logprobs = delta.prompt_logprobs
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not delta.finished:
            return None
        out = self._acc
        return dataclasses.replace(out, outputs=[_copy(o) for o in out.outputs])

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                out = self._merge(item)
                if out is not None:
                    yield out
        finally:
            if not self.finished:  # the consumer stopped early (e.g. the client went away)
                self.abort()

    def abort(self) -> None:
        """Aborts the request if it is still running (thread-safe, never blocks)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def _copy(o: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(
        o,
        token_ids=list(o.token_ids),
        logprobs=list(o.logprobs) if o.logprobs is not None else None,
    )


class AsyncLLM:
    """An `LLMEngine` run by a background thread, for many concurrent asyncio clients.

    Args:
        engine: the engine to drive, an LLMEngine or data-parallel replicas of it (the
            AsyncLLM owns it from now on).
        stat_logger: where metrics go (default: a `PrometheusStatLogger` for the model).

    Build it with `AsyncLLM.from_engine_args(args)`; call `shutdown()` when done.
    """

    def __init__(
        self,
        engine: LLMEngine | DataParallelEngine,
        stat_logger: PrometheusStatLogger | None = None,
    ):
        self.engine = engine
        self.model_config = engine.config.model_config
        self._replicas = list(getattr(engine, "replicas", [engine]))
        self.metrics = stat_logger or PrometheusStatLogger(
            self.model_config.served_model_name,
            cache_info={
                "block_size": engine.config.cache_config.block_size,
                "num_gpu_blocks": sum(
                    r.kv_cache_manager.pool.num_usable_blocks for r in self._replicas
                ),
                "enable_prefix_caching": engine.config.cache_config.enable_prefix_caching,
            },
        )
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._record_stats()
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, use_tqdm: bool = False) -> AsyncLLM:
        """An engine (data-parallel replicas when data_parallel_size > 1) behind a thread.

        Raises:
            ValueError: an invalid engine argument, or the "ray" executor (not served yet).
        """
        if args.distributed_executor_backend == "ray":
            raise ValueError("distributed_executor_backend='ray' is not supported by the server")
        return cls(create_engine(args.create_engine_config(), use_tqdm=use_tqdm))

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine thread has stopped for good (health checks fail)."""
        return self._dead is not None or not self._thread.is_alive()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    # ----------------------------------------------------------- event-loop API

    async def add_requests(
        self,
        requests: Sequence[tuple[str, PromptType, SamplingParams]],
        priority: int = 0,
    ) -> list[RequestStream]:
        """Queues several requests at once: all of them, or none.

        Args:
            requests: (request id, prompt, SamplingParams) triples; ids unique among
                unfinished requests. Each params' output_kind says what its stream yields.
            priority: smaller is served earlier under scheduling_policy="priority".

        Returns:
            One `RequestStream` per request, in order.

        Raises:
            ValueError: a bad prompt or parameter (the message names the request's position
                when there are several); no request of the call is queued then.
            EngineDeadError: the engine has stopped.
        """
        if self.errored or self._stopping:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, p.output_kind, self) for rid, _, p in requests]
        ack: asyncio.Future[None] = loop.create_future()
        self._commands.put(("add", list(requests), priority, streams, loop, ack))
        try:
            await ack
        except asyncio.CancelledError:
            for s in streams:  # queued behind the add, so it finds the requests
                s.abort()
            raise
        return streams

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLM.generate`: yields the request's outputs (see output_kind); the
        request is aborted if the caller stops iterating early. Raises as `add_requests`."""
        (stream,) = await self.add_requests([(request_id, prompt, sampling_params)], priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Aborts a request wherever it is; its blocks are freed (thread-safe, non-blocking)."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts what is still running and stops the engine thread."""
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c[0] == "stop" for c in commands):
                    break
                for c in commands:
                    self._handle(c)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._record_stats()
            self._fail_all(EngineDeadError("the server is shutting down"))
        except BaseException as e:  # a failure of the engine as a whole
            logger.exception("engine thread failed")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"), abort=False)

    def _handle(self, command: tuple) -> None:
        if command[0] == "abort":
            rid = command[1]
            self._loops.pop(rid, None)
            if self._live.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self.metrics.record_finished("abort", None, 0, 0)
            return
        _, requests, priority, streams, loop, ack = command
        added: list[str] = []
        try:
            for i, (rid, prompt, params) in enumerate(requests):
                engine_params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
                try:
                    self.engine.add_request(rid, prompt, engine_params, priority=priority)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}" if len(requests) > 1 else str(e)) from e
                added.append(rid)
        except Exception as e:
            self.engine.abort_request(added)
            _call(loop, _set_exception, ack, e)
            return
        now = time.monotonic()
        for stream in streams:
            self._live[stream.request_id] = _Live(stream, now)
            self._loops[stream.request_id] = loop
        _call(loop, _set_result, ack, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception(
                "engine step failed; failing the %d requests in flight", len(self._live)
            )
            self._fail_all(EngineError(f"internal error while running the request: {e!r}"))
            return
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._record_output(live, out, now)
            loop = self._loops[out.request_id]
            if out.finished:
                del self._live[out.request_id]
                del self._loops[out.request_id]
            _call(loop, live.stream._put, out)

    def _record_output(self, live: _Live, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(o.token_ids) for o in out.outputs)
        if new_tokens:
            if live.first_token_time is None:
                live.first_token_time = now
                live.num_prompt_tokens = len(out.prompt_token_ids)
                self.metrics.record_first_token(now - live.arrival, live.num_prompt_tokens)
            else:
                self.metrics.record_inter_token(now - live.last_token_time)
            live.last_token_time = now
            live.num_generation_tokens += new_tokens
            self.metrics.record_generation_tokens(new_tokens)
        if out.finished:
            self.metrics.record_finished(
                out.outputs[0].finish_reason or "stop",
                now - live.arrival,
                len(out.prompt_token_ids),
                live.num_generation_tokens,
            )

    def _fail_all(self, error: BaseException, abort: bool = True) -> None:
        live, self._live = self._live, {}
        loops, self._loops = self._loops, {}
        if abort and live:
            try:
                self.engine.abort_request(list(live))
            except Exception as e:
                logger.exception("could not abort the failed requests; stopping the engine")
                self._dead = e
        for rid, entry in live.items():
            _call(loops[rid], entry.stream._put, error)

    def _record_stats(self) -> None:
        """Scheduler stats summed over the replicas (KV usage: held / usable blocks)."""
        stats = [r.scheduler.stats() for r in self._replicas]
        pools = [r.kv_cache_manager.pool for r in self._replicas]
        total = SchedulerStats(
            **{
                f.name: sum(getattr(x, f.name) for x in stats)
                for f in dataclasses.fields(SchedulerStats)
                if f.name != "kv_cache_usage"
            }
        )
        usable = sum(p.num_usable_blocks for p in pools)
        free = sum(p.num_free_blocks for p in pools)
        total.kv_cache_usage = 1.0 - free / usable if usable else 0.0
        self.metrics.record_scheduler_stats(total, free)


def _call(loop: asyncio.AbstractEventLoop, fn, *args: Any) -> None:
    """Runs fn(*args) on the event loop; drops it if that loop has closed meanwhile."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
