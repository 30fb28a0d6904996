"""AsyncLLM: the engine for the server, driven by a background thread off the event loop.

    event loop (FastAPI handlers)  inputs thread              engine thread
    add_requests() --> InputProcessor.process --("add", ...)--> LLMEngine.add_processed
                                                 commands       (ack or ValueError)
    RequestStream.abort() --("abort", id)-->    --> LLMEngine.abort_request (blocks freed)
                                                    LLMEngine.step() -> RequestOutputs
    RequestStream (asyncio.Queue) <--call_soon_threadsafe-- per-request outputs, metrics

A request is checked and tokenized (`InputProcessor.process`, with its own copy of the
tokenizer) on one worker thread of its own before it reaches the engine thread, so a long
prompt or a large JSON schema (checked and turned into grammar text) costs the running
requests' steps nothing on the engine thread (only the GIL, while Python code runs).
The `LLMEngine` is not thread-safe, so only the engine thread touches it; the event loop
talks to it through a command queue and gets each request's outputs through that request's
own `asyncio.Queue`. The thread sleeps on the command queue while no request is unfinished,
and otherwise drains the commands between two steps, so a new request waits at most one step
to be admitted. The engine runs each request in its caller's `output_kind` (DELTA,
CUMULATIVE or FINAL_ONLY: the engine builds all three) and the stream yields the engine's
outputs as they are. The thread records the Prometheus metrics from them and from the
schedulers' stats (`pagedjax.engine.request_metrics`).

Failure isolation: a `ValueError` from `add_request` (bad prompt or parameters; an
`InvalidInputError` names the field at fault) reaches the caller of `add_requests` and queues
nothing. If a step raises, the requests then in flight
fail with `EngineError` and are aborted (their blocks freed); the engine keeps serving new
requests. Only if the engine cannot even abort them does it stop (`errored`, and every
stream and later call gets `EngineDeadError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from pagedjax.engine.dp_engine import DataParallelEngine
from pagedjax.engine.engine import LLMEngine
from pagedjax.engine.factory import create_engine
from pagedjax.engine.input_processor import InputProcessor, ProcessedInput
from pagedjax.engine.prometheus import PrometheusStatLogger
from pagedjax.engine.request_metrics import (
    LiveRequest,
    prometheus_for,
    record_iteration_tokens,
    record_output,
    record_scheduler_stats,
)
from pagedjax.engine_args import EngineArgs
from pagedjax.errors import InvalidInputError
from pagedjax.inputs import PromptType
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An internal failure while running a request (not the caller's mistake)."""


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can run any more."""


class RequestStream:
    """The outputs of one request, as an async iterator of `RequestOutput`, exactly as the
    engine built them for the request's `output_kind` (DELTA: what is new since the last
    output; CUMULATIVE: everything so far; FINAL_ONLY: one output, when it finishes).

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

    def _put(self, item: RequestOutput | BaseException) -> None:  # event loop thread
        self._queue.put_nowait(item)

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
                yield item
        finally:
            if not self.finished:  # the consumer stopped early (e.g. the client went away)
                self.abort()

    def abort(self) -> None:
        """Aborts the request if it is still running (thread-safe, never blocks)."""
        if not self.finished:
            self.finished = True
            self._engine.abort_nowait(self.request_id)


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
        self._last_timings: dict[int, Any] = {}  # replica -> its last step's counted timing
        self.metrics = stat_logger or prometheus_for(engine)
        tokenizer = engine.tokenizer
        try:  # its own copy: the engine thread detokenizes with the engine's meanwhile
            tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
            logger.warning("the tokenizer cannot be copied; the inputs thread shares it")
        self._input_processor = InputProcessor(self.model_config, tokenizer)
        self._inputs = concurrent.futures.ThreadPoolExecutor(1, "pagedjax-inputs")
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._live: dict[str, LiveRequest] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        record_scheduler_stats(self.metrics, self._replicas)
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
        return cls(create_engine(args, use_tqdm=use_tqdm))

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
        check_max_tokens: bool = False,
    ) -> list[RequestStream]:
        """Queues several requests at once: all of them, or none.

        Args:
            requests: (request id, prompt, SamplingParams) triples; ids unique among
                unfinished requests. Each params' output_kind says what its stream yields;
                the engine truncates and validates the prompt (truncate_prompt_tokens).
            priority: smaller is served earlier under scheduling_policy="priority".
            check_max_tokens: refuse a request whose prompt (after truncation) plus its
                max_tokens exceeds max_model_len, instead of capping max_tokens (the OpenAI
                protocol's rule; see `LLMEngine.add_request`).

        Returns:
            One `RequestStream` per request, in order.

        Raises:
            InvalidInputError: the engine refused a field (`param` names it); a ValueError.
            ValueError: another bad prompt or parameter. With several requests the message
                names the request's position ("prompt i: ..."); no request of the call is
                queued then.
            EngineDeadError: the engine has stopped.
        """
        if self.errored or self._stopping:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        inputs = await loop.run_in_executor(
            self._inputs, self._process_inputs, list(requests), check_max_tokens
        )
        if self.errored or self._stopping:  # stopped while the inputs were checked
            raise EngineDeadError("the engine is not running")
        streams = [RequestStream(rid, p.output_kind, self) for rid, _, p in requests]
        ack: asyncio.Future[None] = loop.create_future()
        self._commands.put(("add", inputs, priority, streams, loop, ack))
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
        check_max_tokens: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLM.generate`: yields the request's outputs (see output_kind); the
        request is aborted if the caller stops iterating early. Raises as `add_requests`."""
        (stream,) = await self.add_requests(
            [(request_id, prompt, sampling_params)], priority, check_max_tokens
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """vLLM's `AsyncLLM.abort`: aborts requests wherever they are; their blocks are freed
        and each one's stream ends with a last output whose running samples have
        finish_reason "abort" (unknown or finished ids are ignored)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.abort_nowait(rid)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` from any thread, without an event loop (never blocks): the engine thread
        aborts the request between two steps."""
        self._commands.put(("abort", request_id))

    def _process_inputs(
        self, requests: list[tuple[str, PromptType, SamplingParams]], check_max_tokens: bool
    ) -> list[tuple[str, ProcessedInput]]:
        """The inputs thread: each request checked and tokenized (raises as `add_requests`)."""
        out = []
        for i, (rid, prompt, params) in enumerate(requests):
            try:
                inp = self._input_processor.process(
                    prompt, params if params is not None else SamplingParams(), check_max_tokens
                )
            except ValueError as e:
                if len(requests) > 1:
                    raise _at_position(e, i) from e
                raise
            out.append((rid, inp))
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts what is still running and stops the engine thread."""
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._inputs.shutdown(wait=False, cancel_futures=True)

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
                record_scheduler_stats(self.metrics, self._replicas)
            self._fail_all(EngineDeadError("the server is shutting down"))
        except BaseException as e:  # a failure of the engine as a whole
            logger.exception("engine thread failed")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"), abort=False)

    def _handle(self, command: tuple) -> None:
        if command[0] == "abort":
            rid = command[1]
            loop = self._loops.pop(rid, None)
            live = self._live.pop(rid, None)
            if live is not None:
                outputs = self.engine.abort_request(rid) or ()
                self.metrics.record_finished("abort", None, 0, 0)
                # its last output ends the stream of a consumer still iterating (an abort
                # from elsewhere); a stream aborted by its own consumer ignores it
                for out in outputs:
                    _call(loop, live.stream._put, out)
            return
        _, requests, priority, streams, loop, ack = command
        added: list[str] = []
        try:
            for i, (rid, inp) in enumerate(requests):
                try:
                    self.engine.add_processed(rid, inp, priority=priority)
                except ValueError as e:
                    if len(requests) > 1:
                        raise _at_position(e, i) from e
                    raise
                added.append(rid)
        except Exception as e:
            self.engine.abort_request(added)
            _call(loop, _set_exception, ack, e)
            return
        now = time.monotonic()
        params = {rid: inp.params for rid, inp in requests}
        for stream in streams:
            p = params.get(stream.request_id)
            self._live[stream.request_id] = LiveRequest(
                stream,
                now,
                stream.output_kind,
                n=p.n if p is not None else None,
                max_tokens=p.max_tokens if p is not None else None,
            )
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
        self._record_iteration_tokens()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            record_output(self.metrics, live, out, now)
            loop = self._loops[out.request_id]
            if out.finished:
                del self._live[out.request_id]
                del self._loops[out.request_id]
            _call(loop, live.stream._put, out)

    def _record_iteration_tokens(self) -> None:
        record_iteration_tokens(self.metrics, self._replicas, self._last_timings)

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


# vLLM's other name for its asynchronous engine (`from vllm import AsyncLLMEngine`)
AsyncLLMEngine = AsyncLLM


def _at_position(e: ValueError, i: int) -> ValueError:
    """The same refusal, its message naming the request's position in the call."""
    if isinstance(e, InvalidInputError):
        return InvalidInputError(f"prompt {i}: {e}", param=e.param)
    return ValueError(f"prompt {i}: {e}")


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
