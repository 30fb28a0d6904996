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
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.metrics import StatLogger
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.runner import ModelRunner
from pagedjax.engine.scheduler import Scheduler
from pagedjax.errors import InvalidInputError
from pagedjax.inputs import PromptType, parse_prompt
from pagedjax.models import llama, loader
from pagedjax.ops import cpu_linear
from pagedjax.ops.sampling import MAX_BANNED
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.sharding.mesh import device_grid, replica_mesh
from pagedjax.sharding.rules import ShardingPlan, per_device_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Where one `LLMEngine.step` spent its wall time, in seconds (`time.perf_counter`).

    schedule_s: `Scheduler.schedule`. prepare_s: the runner's host work before the device
    call (request states, block copies and swaps, the packed int32 input buffer). device_s:
    from the dispatch of the compiled step until its sampled ids and logprobs are on the host
    (compute and both transfers; the host waits). update_s: everything after (reading the
    sampled tokens into requests, scheduler update, stop checks, detokenization, building the
    outputs). total_s: the whole step. The host part of a step is total_s - device_s.
    """

    num_scheduled_tokens: int
    num_seqs: int
    bucket: int  # the compiled step's token count T (0: no device call)
    schedule_s: float
    prepare_s: float
    device_s: float
    update_s: float
    total_s: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class LLMEngine:
    """The synchronous engine. Build it with `from_engine_args` (or `LLM`)."""

    def __init__(self, config: EngineConfig, use_tqdm: bool = True, devices=None):
        """Loads the model and compiles its steps.

        Args:
            config: the engine config.
            use_tqdm: show the warm-up progress bar.
            devices: this replica's devices as a [pipeline, tensor] array (default: the first
                pipeline_parallel_size x tensor_parallel_size devices).
        """
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
        pc = config.parallel_config
        if devices is None:
            devices = device_grid(
                jax.devices(), 1, pc.pipeline_parallel_size, pc.tensor_parallel_size
            )[0]
        self.plan = ShardingPlan(replica_mesh(devices), llama.logical_unit_counts(mc.arch))
        logical = llama.param_logical_axes(mc.arch)

        def sharding_for(name: str):
            axes = logical
            for part in name.split("/"):
                axes = axes[part]
            return self.plan.sharding(axes)

        params = loader.load_params(
            source,
            mc.arch,
            mc.dtype,
            sharding_for=sharding_for,
            quantization=mc.quantization,
            kv_cache_dtype=cc.kv_cache_dtype,
        )
        params = jax.device_put(params, self.plan.param_shardings(params, logical))
        if mc.attention_backend == "cpu":  # the native matmul's panel layout, packed once
            params = cpu_linear.pack_params(params)
        load_s = time.perf_counter() - t0
        self.runner = ModelRunner(config, params, self.plan)
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
        self._log_layout()
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
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLogger(enabled=config.log_stats)
        self.last_step_timing: StepTiming | None = None  # see `StepTiming`

    def _log_layout(self) -> None:
        """Mesh shape and the bytes of params and KV cache on each device."""
        mesh = self.plan.mesh
        params = per_device_bytes(self.runner.params)
        kv = per_device_bytes(self.runner.kv_cache)
        self.layout = {
            "mesh": dict(mesh.shape),
            "devices": [str(d) for d in mesh.devices.flat],
            "param_bytes_per_device": params,
            "kv_cache_bytes_per_device": kv,
        }
        logger.info(
            "layout: mesh %s; per device: params %s MiB, KV cache %s MiB; attention %s",
            dict(mesh.shape),
            {d: round(b / 2**20, 1) for d, b in params.items()},
            {d: round(b / 2**20, 1) for d, b in kv.items()},
            self.config.model_config.attention_backend,
        )

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

    def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The token ids of a prompt (tokenized if given as text).

        Raises:
            ValueError: a malformed or empty prompt, or text without a tokenizer.
        """
        text, ids, _ = parse_prompt(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("prompts must be token ids when skip_tokenizer_init is set")
            if text == "":
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer(text).input_ids
        return ids

    def _validate(self, prompt: PromptType, params: SamplingParams):
        text, _, salt = parse_prompt(prompt)
        ids = self.prompt_token_ids(prompt)
        mc = self.config.model_config
        if params.truncate_prompt_tokens is not None:
            m, t = mc.max_model_len, params.truncate_prompt_tokens
            k = m if t == -1 else t
            if k == 0 or k > m:
                raise InvalidInputError(
                    f"truncate_prompt_tokens must be -1 or in [1, max_model_len={m}], got {t}",
                    "truncate_prompt_tokens",
                )
            ids = ids[-k:]
        if not ids:
            raise InvalidInputError("prompt must not be empty (it has 0 tokens)", "prompt")
        if len(ids) > mc.max_model_len:
            raise InvalidInputError(
                f"prompt has {len(ids)} tokens, more than max_model_len={mc.max_model_len}",
                "prompt",
            )
        vocab = mc.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})", "prompt"
            )
        self._validate_params(params)
        return text, ids, salt

    def _validate_params(self, params: SamplingParams) -> None:
        """Checks what SamplingParams cannot check alone (vocabulary, max_logprobs, ...)."""
        mc = self.config.model_config
        vocab = mc.arch.vocab_size
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > mc.max_logprobs:
                raise ValueError(f"{field} must be <= max_logprobs ({mc.max_logprobs}), got {k}")
        for field, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids),
        ):
            out = [t for t in ids if not 0 <= t < vocab]
            if out:
                raise ValueError(
                    f"{field} has token id {out[0]} outside the vocabulary [0, {vocab})"
                )
        if params.min_tokens and len(params.stop_token_ids) + 1 > MAX_BANNED:
            raise ValueError(
                f"with min_tokens, stop_token_ids may hold at most "
                f"{MAX_BANNED - 1} ids, got {len(params.stop_token_ids)}"
            )
        if (params.stop or params.bad_words) and self.tokenizer is None:
            field = "stop" if params.stop else "bad_words"
            raise ValueError(f"{field} needs a tokenizer (skip_tokenizer_init is set)")

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Token sequences of each bad word, with and without a leading space (as vLLM)."""
        if not params.bad_words:
            return None
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for prefix in ("", " "):
                ids = self.tokenizer(prefix + word.lstrip(), add_special_tokens=False).input_ids
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        check_max_tokens: bool = False,
    ) -> None:
        """Queues a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or a TextPrompt / TokensPrompt dict.
            params: SamplingParams (default: vLLM's defaults).
            arrival_time: seconds since the epoch (default: now).
            priority: smaller is served earlier under scheduling_policy="priority".
            check_max_tokens: refuse (InvalidInputError, param "max_tokens") a prompt (after
                truncation) plus max_tokens above max_model_len instead of capping max_tokens.

        Raises:
            InvalidInputError: a ValueError naming the field at fault (`param`).
            ValueError: empty or too long prompt, token ids outside the vocabulary, an
                unsupported sampling option, a duplicate id, or a prompt that could never
                fit the KV cache. Nothing is queued then, and other requests are unaffected.
        """
        params = params if params is not None else SamplingParams()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, salt = self._validate(prompt, params)
        m = self.config.model_config.max_model_len
        if check_max_tokens and params.max_tokens is not None and len(ids) + params.max_tokens > m:
            raise InvalidInputError(
                f"This model's maximum context length is {m} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.",
                "max_tokens",
            )
        params = params.clone()
        room = self.config.model_config.max_model_len - len(ids)
        params.max_tokens = max(1, min(params.max_tokens or room, room)) if room > 0 else 1
        arrival = time.time() if arrival_time is None else arrival_time
        bad_words = self._bad_words_token_ids(params)
        requests: list[Request] = []
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
            req.bad_words_token_ids = bad_words
            requests.append(req)
        added: list[Request] = []
        try:
            for r in requests:
                # Samples after the first share its prompt blocks once it has computed them.
                self.scheduler.add_request(r, fork_of=added[0] if added else None)
                added.append(r)
        except ValueError:
            self.scheduler.finish_requests(
                [r.request_id for r in added], RequestStatus.FINISHED_ABORTED
            )
            raise
        self.output_processor.add(request_id, text, ids, params, requests, arrival)
        self.stat_logger.on_request_added(len(ids))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts requests wherever they are; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self.output_processor.remove(rid)
            if parent is not None:
                self.scheduler.finish_requests(
                    [c.request.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED
                )

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs it produced (see output_kind)."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(so)
        t2 = time.perf_counter()
        progressed = self.scheduler.update_from_output(so, result.sampled)
        touched, stops = self.output_processor.update(progressed, result)
        for req, stop in stops:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stop
        outputs = self.output_processor.build(touched)
        t3 = time.perf_counter()
        self.last_step_timing = StepTiming(
            num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_seqs=len(so.num_scheduled_tokens),
            bucket=result.bucket,
            schedule_s=t1 - t0,
            prepare_s=result.prepare_s,
            device_s=result.device_s,
            update_s=(t2 - t1 - result.prepare_s - result.device_s) + (t3 - t2),
            total_s=t3 - t0,
        )
        self.stat_logger.on_step(
            so.total_num_scheduled_tokens, len(result.sampled), t3 - t0, self.scheduler.stats()
        )
        return outputs


def _setup_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` ("" leaves it off)."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
