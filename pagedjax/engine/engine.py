"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time.

    add_request -> Scheduler (which requests, how many tokens) -> KVCacheManager (blocks)
    -> ModelRunner (padded arrays, one compiled step: model, attention, sampler)
    -> sampled ids -> Scheduler.update_from_output (stop checks, freeing)
    -> IncrementalDetokenizer (text, stop strings) -> RequestOutput

A request with n > 1 is fanned out into n child sequences ("{i}_{id}"): the first computes
the prompt, the others fork its blocks (copy-on-write, see `Scheduler`); their outputs are
gathered into one `RequestOutput` with n `CompletionOutput`s. A child of a seeded request
draws with seed + i.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable

import jax

from pagedjax.config import EngineArgs, EngineConfig
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.metrics import StatLogger
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.runner import ModelRunner
from pagedjax.engine.scheduler import Scheduler
from pagedjax.inputs import PromptType, parse_prompt
from pagedjax.models import loader
from pagedjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Fields whose non-default values the sampler cannot honour yet.
_UNSUPPORTED_SAMPLING = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "prompt_logprobs": None,
}


@dataclasses.dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    index: int
    sent_tokens: int = 0  # output tokens already reported (output_kind DELTA)


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestMetrics


class LLMEngine:
    """The synchronous engine. Build it with `from_engine_args` (or `LLM`)."""

    def __init__(self, config: EngineConfig, use_tqdm: bool = True):
        self.config = config
        mc, cc = config.model_config, config.cache_config
        _setup_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        source = loader.ModelSource(mc.source_kind, mc.source_path)
        if source.kind == "gguf":
            source = loader.converted_gguf_source(source, mc.download_dir)
        self.tokenizer = (
            None if mc.skip_tokenizer_init else loader.load_tokenizer(source, mc.tokenizer)
        )
        params = loader.load_params(
            source,
            mc.arch,
            mc.dtype,
            quantization=mc.quantization,
            kv_cache_dtype=cc.kv_cache_dtype,
        )
        load_s = time.perf_counter() - t0
        self.runner = ModelRunner(config, params)
        num_blocks = self.runner.determine_num_blocks()
        num_host_blocks = 0
        if config.scheduler_config.preemption_mode == "swap":
            num_host_blocks = int(cc.swap_space * 2**30) // self.runner.bytes_per_block()
        self.runner.allocate_kv_cache(num_blocks, num_host_blocks)
        usable_tokens = (num_blocks - 1) * cc.block_size
        logger.info(
            "model %s loaded in %.1f s (%s, quantization %s, %s); KV cache (%s): %d blocks of "
            "%d tokens (%d tokens, %.2f GiB); maximum concurrency for %d tokens per request: "
            "%.2fx",
            mc.served_model_name,
            load_s,
            mc.dtype,
            mc.quantization,
            jax.default_backend(),
            self.runner.kv_dtype.name,
            num_blocks,
            cc.block_size,
            usable_tokens,
            num_blocks * self.runner.bytes_per_block() / 2**30,
            mc.max_model_len,
            usable_tokens / mc.max_model_len,
        )
        if usable_tokens < mc.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests "
                "stop early (finish_reason 'length')",
                usable_tokens,
                mc.max_model_len,
            )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, num_host_blocks
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.compile_seconds = self.runner.warmup(use_tqdm=use_tqdm)
        self.eos_token_id = self._eos_token_id()
        self._rng = random.Random(mc.seed)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}
        self.stat_logger = StatLogger(enabled=config.log_stats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, use_tqdm: bool = True) -> LLMEngine:
        return cls(args.create_engine_config(), use_tqdm=use_tqdm)

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None and self.config.model_config.arch.eos_token_ids:
            eos = self.config.model_config.arch.eos_token_ids[0]
        return eos

    def get_tokenizer(self):
        return self.tokenizer

    # ----------------------------------------------------------------- requests

    def _validate(self, prompt: PromptType, params: SamplingParams):
        text, ids, salt = parse_prompt(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("prompts must be token ids when skip_tokenizer_init is set")
            if text == "":
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer(text).input_ids
        mc = self.config.model_config
        if params.truncate_prompt_tokens is not None:
            k = (
                mc.max_model_len
                if params.truncate_prompt_tokens == -1
                else params.truncate_prompt_tokens
            )
            ids = ids[-k:]
        if not ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        if len(ids) > mc.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_model_len={mc.max_model_len}"
            )
        vocab = mc.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
        for field, default in _UNSUPPORTED_SAMPLING.items():
            if getattr(params, field) != default:
                raise ValueError(f"{field} is not supported yet (only {default!r})")
        if params.logprobs:
            raise ValueError("logprobs > 0 is not supported yet (0 returns the sampled token's)")
        return text, ids, salt

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or a TextPrompt / TokensPrompt dict.
            params: SamplingParams (default: vLLM's defaults).
            arrival_time: seconds since the epoch (default: now).
            priority: smaller is served earlier under scheduling_policy="priority".

        Raises:
            ValueError: empty or too long prompt, token ids outside the vocabulary, an
                unsupported sampling option, a duplicate id, or a prompt that could never
                fit the KV cache. Nothing is queued then, and other requests are unaffected.
        """
        params = params if params is not None else SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, salt = self._validate(prompt, params)
        params = params.clone()
        room = self.config.model_config.max_model_len - len(ids)
        params.max_tokens = max(1, min(params.max_tokens or room, room)) if room > 0 else 1
        arrival = time.time() if arrival_time is None else arrival_time
        children: list[_Child] = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            req = Request(
                child_id,
                ids,
                params,
                self.eos_token_id,
                seed=seed,
                arrival_time=arrival,
                priority=priority,
                cache_salt=salt,
            )
            children.append(_Child(req, IncrementalDetokenizer(self.tokenizer, ids, params), i))
        added: list[Request] = []
        try:
            for c in children:
                # Samples after the first share its prompt blocks once it has computed them.
                self.scheduler.add_request(c.request, fork_of=added[0] if added else None)
                added.append(c.request)
        except ValueError:
            self.scheduler.finish_requests(
                [r.request_id for r in added], RequestStatus.FINISHED_ABORTED
            )
            raise
        self._parents[request_id] = _Parent(
            request_id, text, ids, params, children, RequestMetrics(arrival_time=arrival)
        )
        for c in children:
            self._child_to_parent[c.request.request_id] = request_id
        self.stat_logger.on_request_added(len(ids))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts requests wherever they are; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for cid in child_ids:
                self._child_to_parent.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs it produced (see output_kind)."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        sampled = self.runner.execute(so) if so.total_num_scheduled_tokens else {}
        progressed = self.scheduler.update_from_output(so, sampled)
        now = time.time()
        touched: dict[str, _Parent] = {}
        for req in progressed:
            parent_id = self._child_to_parent.get(req.request_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            child = next(c for c in parent.children if c.request is req)
            new_tokens = req.output_token_ids[len(child.detokenizer.token_ids) :]
            stop = child.detokenizer.update(new_tokens)
            if stop is not None and not req.is_finished:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop
            elif req.is_finished:
                child.detokenizer.flush()
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            touched[parent_id] = parent
        outputs = []
        for parent in touched.values():
            finished = all(c.request.is_finished for c in parent.children)
            if finished:
                parent.metrics.finished_time = now
                del self._parents[parent.request_id]
                for c in parent.children:
                    self._child_to_parent.pop(c.request.request_id, None)
            if finished or parent.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(parent, finished))
        self.stat_logger.on_step(
            so.total_num_scheduled_tokens,
            len(sampled),
            time.perf_counter() - t0,
            self.scheduler.stats(),
        )
        return outputs

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for c in parent.children:
            r = c.request
            done = r.is_finished
            token_ids = list(r.output_token_ids)
            if delta:
                token_ids = token_ids[c.sent_tokens :]
                c.sent_tokens = r.num_output_tokens
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.detokenizer.get_text(done, delta),
                    token_ids=token_ids,
                    cumulative_logprob=float(sum(r.output_logprobs)),
                    finish_reason=r.status.finish_reason if done else None,
                    stop_reason=r.stop_reason,
                )
            )
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=parent.metrics,
        )


def _setup_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` ("" leaves it off)."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
