"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time.

    add_request -> InputProcessor (validation, tokenization) -> add_processed -> Request
    -> Scheduler
    step: Scheduler.schedule (which requests, how many tokens; KVCacheManager blocks)
    -> SchedulerOutput -> ModelRunner.execute (one compiled step: model, attention, sampler)
    -> ModelRunnerOutput -> Scheduler.update_from_output (tokens appended, text and stop
    checks, freeing) -> OutputProcessor (logprobs, RequestOutputs)

A request with n > 1 is fanned out into n child sequences ("{i}_{id}"): the first computes
the prompt, the others fork its blocks (copy-on-write, see `Scheduler`); their outputs are
gathered into one `RequestOutput` with n `CompletionOutput`s. A child of a seeded request
draws with seed + i.

A request with `structured_outputs` is validated when added (`InputProcessor`); each of its
sequences gets its own grammar state from the `StructuredOutputManager` (made on the first
such request), whose grammar compiles on a worker pool while other requests run.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable

from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.input_processor import InputProcessor, ProcessedInput
from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.metrics import StatLogger
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.engine.request import Request, RequestStatus
from pagedjax.engine.scheduler import Scheduler
from pagedjax.engine.spec_decode import Speculator
from pagedjax.engine_args import EngineArgs
from pagedjax.errors import InvalidInputError
from pagedjax.executor.model_loading import load_model
from pagedjax.executor.model_runner import ModelRunner
from pagedjax.inputs import PromptType
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.structured_output import StructuredOutputManager

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
        loaded = load_model(config, devices)
        self.tokenizer, self.plan = loaded.tokenizer, loaded.plan
        self.runner = ModelRunner(config, loaded.params, self.plan)
        num_blocks = self.runner.determine_num_blocks()
        num_host_blocks = 0
        if config.scheduler_config.preemption_mode == "swap":
            num_host_blocks = int(cc.swap_space * 2**30) // self.runner.bytes_per_block()
        self.runner.allocate_kv_cache(num_blocks, num_host_blocks)
        usable_tokens = (num_blocks - 1) * cc.block_size
        logger.info(
            "model %s loaded in %.1f s (%s, quantization %s, %s); KV cache (%s): %d blocks of "
            "%d tokens and 1 null block (%d tokens, %.2f GiB); maximum concurrency for %d "
            "tokens per request: %.2fx",
            mc.served_model_name,
            loaded.load_s,
            mc.dtype,
            mc.quantization,
            self.runner.platform,
            self.runner.kv_dtype.name,
            num_blocks - 1,  # as vllm:cache_config_info's num_gpu_blocks counts them
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
        spec = config.speculative_config
        self.speculator = None if spec is None else Speculator(spec, mc.max_model_len)
        self.structured_output: StructuredOutputManager | None = None
        if self.tokenizer is not None:
            self.structured_output = StructuredOutputManager(
                self.tokenizer, mc.arch.vocab_size, self._eos_token_id()
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.kv_cache_manager,
            self.structured_output,
            speculator=self.speculator,
        )
        self.compile_seconds = self.runner.warmup(use_tqdm=use_tqdm)
        self.eos_token_id = self._eos_token_id()
        self._rng = random.Random(mc.seed)
        self.input_processor = InputProcessor(mc, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLogger(enabled=config.log_stats)
        self.last_step_timing: StepTiming | None = None  # see `StepTiming`

    def _log_layout(self) -> None:
        """Mesh shape, the layers of each pipeline stage, and the bytes of params and KV cache
        on each device."""
        self.layout = self.runner.layout()
        mc = self.config.model_config
        logger.info(
            "layout: mesh %s, stage layers %s; per device: params %s MiB, KV cache %s MiB; "
            "attention %s, linear %s, cpu kernels %s",
            self.layout["mesh"],
            self.layout.get("stage_layers"),
            {d: round(b / 2**20, 1) for d, b in self.layout["param_bytes_per_device"].items()},
            {d: round(b / 2**20, 1) for d, b in self.layout["kv_cache_bytes_per_device"].items()},
            mc.attention_backend,
            mc.linear_backend,
            mc.cpu_kernel_isa,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, use_tqdm: bool = True) -> LLMEngine:
        return cls(args.create_engine_config(), use_tqdm=use_tqdm)

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None and self.config.model_config.arch.eos_token_ids:
            eos = self.config.model_config.arch.eos_token_ids[0]
        return eos

    @property
    def model_config(self) -> ModelConfig:
        """The model's resolved configuration (`config.model_config`: max_model_len,
        served_model_name, dtype, ...), where vLLM scripts read it."""
        return self.config.model_config

    def get_model_config(self) -> ModelConfig:
        """`model_config`, as vLLM's `LLMEngine.get_model_config()`."""
        return self.config.model_config

    def get_tokenizer(self):
        return self.tokenizer

    # ----------------------------------------------------------------- requests

    def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The token ids of a prompt (tokenized if given as text).

        Raises:
            InvalidInputError: a malformed or empty prompt, or text without a tokenizer.
        """
        return self.input_processor.prompt_token_ids(prompt)

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
            check_max_tokens: refuse (OpenAI's rule) a prompt that leaves no room for output
                or an explicit max_tokens that does not fit after it, instead of capping
                max_tokens to the room left.

        Raises:
            InvalidInputError (a ValueError naming the field as `param`): empty or too long
                prompt, token ids outside the vocabulary, an unsupported sampling option, a
                non-zero priority without scheduling_policy="priority".
            ValueError: a duplicate id, or a prompt that could never fit the KV cache.
            Nothing is queued then, and other requests are unaffected.
        """
        params = params if params is not None else SamplingParams()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        inp = self.input_processor.process(prompt, params, check_max_tokens)
        self.add_processed(request_id, inp, arrival_time, priority)

    def add_processed(
        self,
        request_id: str,
        inp: ProcessedInput,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request already checked by an `InputProcessor` of this engine's model
        (`add_request` without the checks and the tokenization: the server runs those off the
        engine's thread, see `AsyncLLM`). `inp.params` are the request's parameters.

        Raises:
            InvalidInputError: a non-zero priority while scheduling_policy is not "priority"
                (vLLM refuses it too: it would be ignored).
            ValueError: a duplicate id, or a prompt that could never fit the KV cache; nothing
                is queued then.
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        policy = self.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise InvalidInputError(
                f"priority {priority} needs scheduling_policy='priority' (the engine runs "
                f"{policy!r})",
                "priority",
            )
        params = inp.params
        arrival = time.time() if arrival_time is None else arrival_time
        requests: list[Request] = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            requests.append(
                Request(
                    child_id,
                    inp.prompt_token_ids,
                    params,
                    self.eos_token_id,
                    seed=seed,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=inp.cache_salt,
                    bad_words_token_ids=inp.bad_words_token_ids,
                    detokenizer=IncrementalDetokenizer(
                        self.tokenizer, inp.prompt_token_ids, params
                    ),
                    structured_output=(
                        None
                        if params.structured_outputs is None
                        else self.structured_output.new_request(
                            params.structured_outputs, inp.grammar_text
                        )
                    ),
                )
            )
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
        self.output_processor.add(
            request_id, inp.text, inp.prompt_token_ids, params, requests, arrival
        )
        self.stat_logger.on_request_added(len(inp.prompt_token_ids))

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Aborts requests wherever they are; their blocks are freed at once.

        Returns each aborted request's last output (`finished`, in its `output_kind`; the
        samples still running end with finish_reason "abort"), which vLLM's output
        processor hands to an aborted request's stream; nothing for an unknown or finished
        id."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            parent = self.output_processor.remove(rid)
            if parent is not None:
                self.scheduler.finish_requests(
                    [c.request.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED
                )
                outputs.append(self.output_processor.final_output(parent))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache (vLLM's `reset_prefix_cache`); only while no request
        holds blocks. Returns whether it did."""
        return self.scheduler.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs it produced (see output_kind)."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.output_processor.mark_scheduled((r.req_id for r in so.scheduled_new_reqs), time.time())
        t1 = time.perf_counter()
        result = self.runner.execute(so)
        t2 = time.perf_counter()
        progressed = self.scheduler.update_from_output(
            so, result.sampled, result.spec_tokens, result.draft_token_ids
        )
        outputs = self.output_processor.build(self.output_processor.update(progressed, result))
        t3 = time.perf_counter()
        self.last_step_timing = StepTiming(
            num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_seqs=len(so.scheduled),
            bucket=result.bucket,
            schedule_s=t1 - t0,
            prepare_s=result.prepare_s,
            device_s=result.device_s,
            update_s=(t2 - t1 - result.prepare_s - result.device_s) + (t3 - t2),
            total_s=t3 - t0,
        )
        spec = self.speculator.stats if self.speculator is not None else None
        drawn = len(result.sampled) + sum(len(t) for t in result.spec_tokens.values())
        self.stat_logger.on_step(
            so.total_num_scheduled_tokens, drawn, t3 - t0, self.scheduler.stats(), spec
        )
        return outputs
