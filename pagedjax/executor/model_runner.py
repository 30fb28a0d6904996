"""The model runner: owns the params, the KV cache and the sampling state; runs the steps.

It keeps, per request in the batch, only row bookkeeping (its `RequestSpec`, block table and
slot of the device `SamplingState`); the scheduler owns the request's tokens and progress and
sends each step's token ids and counts (`engine.interface`). It builds each step's padded
inputs with `BatchBuilder`, and calls one ahead-of-time compiled executable per token
bucket (`executor.step_executables`). Every bucket is compiled at warm-up (unless
`enforce_eager`, where each compiles at its first step); after warm-up a compile is a bug,
and `compile_count()` counts every XLA compilation of the process, so tests can assert none
happen.

Its side operations (KV block copies and swaps, fills of sampling-state rows for requests
entering the batch) are compiled in `executor.runner_ops`.

A step whose scheduler output carries a structured-output `grammar_bitmask` sends it with the
packed inputs, each row at its sampler row, and sets the packed `use_bitmask` flag; any other
step passes a device-resident all-ones bitmask of its bucket (no transfer) and the flag off.

The host buffer of a bucket is reused by the next step of that bucket; this is safe because
`execute` waits for the step's sampled tokens before returning.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from pagedjax.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from pagedjax.engine.interface import (
    ModelRunnerOutput,
    PromptLogprobs,
    SampledToken,
    SchedulerOutput,
)
from pagedjax.executor import step as step_fn
from pagedjax.executor.draft_model import DraftRunner
from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.executor.model_loading import stage_layout
from pagedjax.executor.request_state import RequestState, bias_row
from pagedjax.executor.runner_ops import BLOCK_OP_BATCH, RunnerOps
from pagedjax.executor.step_executables import StepExecutables
from pagedjax.ops.kv_cache import (
    KVCache,
    init_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_jnp_dtype,
    kv_cache_shape,
)
from pagedjax.ops.sampling import init_sampling_state
from pagedjax.sharding.rules import ShardingPlan, max_device_bytes, per_device_bytes

logger = logging.getLogger(__name__)

QUERY_TILE_SIZE = 32  # query tokens per prefill tile of the XLA attention path
KV_CHUNK_TOKENS = 32  # KV tokens per inner step of the XLA attention path (fastest on CPU)

_compile_events = 0


def _count_compiles(event: str, duration: float, **_: Any) -> None:
    global _compile_events
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_events += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_count() -> int:
    """Number of XLA backend compilations in this process so far."""
    return _compile_events


class ModelRunner:
    """Params, KV cache, sampling state and compiled steps of one model replica.

    Args:
        config: the engine config.
        params: the model's params pytree (on the device).
    """

    def __init__(self, config: EngineConfig, params: dict[str, Any], plan: ShardingPlan):
        self.config = config
        self.plan = plan
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.arch = mc.arch
        self.params = params
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.max_logprobs = mc.max_logprobs
        self.dtype = jnp.dtype(mc.dtype)
        self.kv_dtype = kv_cache_jnp_dtype(cc.kv_cache_dtype, mc.dtype)  # float8 for "fp8"
        chunk_pages = max(1, KV_CHUNK_TOKENS // cc.block_size)
        self.num_slots = sc.max_num_seqs + 1  # the last one is the scratch slot of padding
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.builder = BatchBuilder(
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs,
            max_model_len=mc.max_model_len,
            block_size=cc.block_size,
            query_tile_size=QUERY_TILE_SIZE,
            kv_chunk_pages=chunk_pages,
            scratch_slot=self.num_slots - 1,
            num_speculative_tokens=self.num_speculative_tokens,
            sizes=sc.cuda_graph_sizes,
        )
        pp = config.parallel_config.pipeline_parallel_size
        self.num_microbatches = pp if pp > 1 else 0  # one micro-batch per stage
        self.stages = stage_layout(config)
        # Layer rows of the KV cache: L, or P x the largest stage for uneven stages (the
        # smaller stages' padding rows are allocated, never written).
        self.num_cache_layers = self.stages.padded_num_layers
        self._static = dict(
            cfg=self.arch,
            backend=mc.attention_backend,
            tile=QUERY_TILE_SIZE,
            chunk_pages=chunk_pages,
            max_logprobs=self.max_logprobs,
            stages=self.stages if pp > 1 else None,
        )
        self.steps = StepExecutables(
            self.builder, plan, self._static, self.num_microbatches, mc.enforce_eager
        )
        self.num_blocks = 0
        self.kv_cache: KVCache | None = None
        self.sampling_state = jax.jit(
            init_sampling_state, static_argnums=(0, 1), out_shardings=plan.replicated()
        )(self.num_slots, self.arch.vocab_size)
        self._no_bitmask: dict[int, jax.Array] = {}  # per bucket: all ones, on the device
        self.ops = RunnerOps(plan, self.arch.vocab_size, scratch_slot=self.num_slots - 1)
        self.host_cache: np.ndarray | None = None  # [2, L, num_host_blocks + 1, bs, K, H]
        self.num_host_blocks = 0
        self.requests: dict[str, RequestState] = {}
        self._free_slots = list(range(self.num_slots - 2, -1, -1))
        self.draft: DraftRunner | None = None  # speculative decoding's draft model
        if spec is not None and spec.method == "draft_model":
            self.draft = DraftRunner(config, plan.mesh, cc.block_size, self.kv_dtype, self._static)

    # ----------------------------------------------------------------- memory

    def bytes_per_block(self) -> int:
        """KV bytes of one block over all the cache's layer rows (`num_cache_layers`), and of
        the draft model's cache (speculative decoding)."""
        a = self.arch
        draft = self.draft.bytes_per_block() if self.draft is not None else 0
        return draft + kv_cache_bytes_per_block(
            self.num_cache_layers, self.block_size, a.num_key_value_heads, a.head_dim, self.kv_dtype
        )

    def determine_num_blocks(self) -> int:
        """Blocks the KV cache gets (block 0, the null block, included).

        `num_gpu_blocks_override` wins, then `kv_cache_memory_bytes`; on CPU the default is
        4 GiB capped to what max_num_seqs sequences of max_model_len tokens need; on an
        accelerator, `gpu_memory_utilization` of device memory minus what the weights and
        the largest step's activations (XLA's memory analysis of its executable) take.
        """
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self.bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            return max(2, cc.kv_cache_memory_bytes // per_block)
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            need = sc.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1
            return max(2, min(need, CPU_DEFAULT_KV_CACHE_BYTES // per_block))
        budget = int(stats["bytes_limit"] * cc.gpu_memory_utilization)
        fixed = max_device_bytes(self.params)  # each device's share of the sharded weights
        fixed += sum(x.nbytes for x in jax.tree.leaves(self.sampling_state))
        activations = self._activation_bytes()
        free = budget - fixed - activations
        if free < 2 * per_block:
            raise ValueError(
                f"no room for the KV cache: {budget} bytes allowed "
                f"(gpu_memory_utilization={cc.gpu_memory_utilization}), weights and sampling "
                f"state take {fixed}, the largest step's activations {activations}"
            )
        return free // per_block

    def _step_bitmask(self, so: SchedulerOutput, batch):
        """The bitmask argument of a step: the scheduler's rows at their sampler rows (and
        the packed flag set), or the bucket's all-ones device array."""
        key = batch.layout.num_tokens
        if so.grammar_bitmask is None:
            ones = self._no_bitmask.get(key)
            if ones is None:
                shape = self.steps.bitmask_shape(batch.layout)
                ones = jax.device_put(np.full(shape, -1, np.int32), self.plan.replicated())
                self._no_bitmask[key] = ones
            return ones
        mask = np.full(self.steps.bitmask_shape(batch.layout), -1, np.int32)
        mask[batch.sample_rows] = so.grammar_bitmask
        flag = batch.layout.offsets["use_bitmask"][0]
        batch.buffer[..., flag] = 1
        return mask

    def _activation_bytes(self) -> int:
        """Temporary bytes of the largest bucket's step, from XLA's memory analysis."""
        a = self.arch
        shape = kv_cache_shape(
            self.num_cache_layers, 2, self.block_size, a.num_key_value_heads, a.head_dim
        )
        kv_spec = (jax.ShapeDtypeStruct(shape, self.kv_dtype, sharding=self.plan.kv_cache()),) * 2
        compiled = self.steps.lower(
            self.builder.buckets[-1], self.params, kv_spec, self.sampling_state
        ).compile()
        return int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) or 0)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocates the device KV cache, and the host pool for swapping (allocated lazily by
        the OS: untouched pages cost nothing)."""
        a = self.arch
        self.num_blocks = num_blocks
        shape = kv_cache_shape(
            self.num_cache_layers, num_blocks, self.block_size, a.num_key_value_heads, a.head_dim
        )
        self.kv_cache = init_kv_cache(shape, self.kv_dtype, self.plan.kv_cache())
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        self.num_host_blocks = num_host_blocks
        if num_host_blocks:
            host_shape = (2, self.num_cache_layers, num_host_blocks + 1, *shape[2:])
            self.host_cache = np.zeros(host_shape, self.kv_dtype)

    @property
    def platform(self) -> str:
        """The devices' platform ("cpu", "gpu", ...)."""
        return self.plan.mesh.devices.flat[0].platform

    def layout(self) -> dict[str, Any]:
        """The mesh shape, its devices, the decoder layers of each pipeline stage, and the
        bytes of params and KV cache on each device (device id as a string)."""
        mesh = self.plan.mesh
        return {
            "mesh": dict(mesh.shape),
            "devices": [str(d) for d in mesh.devices.flat],
            "stage_layers": list(self.stages.sizes),
            "param_bytes_per_device": per_device_bytes(self.params),
            "kv_cache_bytes_per_device": per_device_bytes(self.kv_cache),
        }

    # ----------------------------------------------------------------- compilation

    def warmup(self, use_tqdm: bool = True) -> float:
        """Compiles the step for every token bucket, and the block and sampling-state
        operations (under `enforce_eager` none of these: each compiles at its first use,
        `StepExecutables.get` and `RunnerOps.compiled`). Returns the seconds it took."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        t0 = time.perf_counter()
        buckets = self.builder.buckets
        eager = self.steps.enforce_eager
        bar = tqdm(
            buckets, desc="Compiling step buckets", disable=not use_tqdm or eager, leave=False
        )
        for T in () if eager else bar:
            self.steps.compile(T, self.params, self.kv_cache, self.sampling_state)
        if self.draft is not None:
            layouts = {self.steps.layout_key(T): self.builder.layout(T) for T in buckets}
            ids = jax.ShapeDtypeStruct(
                (BLOCK_OP_BATCH,), jnp.int32, sharding=self.plan.replicated()
            )
            self.draft.warmup(layouts, step_fn.copy_blocks, ids, lazy=eager)
        ops = ("copy", "init_rows", "bias_rows") + (
            ("gather", "scatter") if self.num_host_blocks else ()
        )
        for name in () if eager else ops:
            self.ops.compiled(name, self.kv_cache, self.sampling_state)
        seconds = time.perf_counter() - t0
        if eager:
            logger.info("enforce_eager: step buckets %s compile at their first steps", buckets)
        else:
            logger.info(
                "%d step buckets %s ready in %.1f s (compiled, or read from the compilation cache)",
                len(buckets),
                buckets,
                seconds,
            )
        return seconds

    # ----------------------------------------------------------------- requests

    def _drop(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self._free_slots.append(st.slot)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._drop(req_id)
        inits, biases = [], []
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)
            st = RequestState.new(new, self._free_slots.pop())
            self.requests[new.req_id] = st
            if new.spec.has_penalties:
                inits.append((st, new.token_ids))
            if st.row["use_bias"]:
                biases.append((st.slot, bias_row(new.spec, self.arch.vocab_size)))
        for cached in so.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            for index, block in cached.replaced_block_ids:
                st.block_ids[index] = block
            st.block_ids.extend(cached.new_block_ids)
        if inits:
            self.sampling_state = self.ops.init_state_rows(self.sampling_state, inits)
        if biases:
            self.sampling_state = self.ops.set_bias_rows(self.sampling_state, biases)

    # ----------------------------------------------------------------- steps

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step. Returns the tokens sampled for every scheduled request that samples
        (`ScheduledSeq.samples`), and the prompt logprobs computed this step."""
        t0 = time.perf_counter()
        self._update_states(so)
        self.kv_cache = self.ops.apply_block_ops(so, self.kv_cache, self.host_cache, self.draft)
        if not so.scheduled:
            return ModelRunnerOutput({}, {}, prepare_s=time.perf_counter() - t0)
        seqs = [self.requests[s.req_id].seq_input(s) for s in so.scheduled]
        batch = self.builder.build_step(seqs, self.num_microbatches)
        exe = self.steps.get(
            batch.layout.num_tokens, self.params, self.kv_cache, self.sampling_state
        )
        bitmask = self._step_bitmask(so, batch)
        t1 = time.perf_counter()
        out, self.kv_cache, self.sampling_state = exe(
            self.params, self.kv_cache, self.sampling_state, batch.buffer, bitmask
        )
        s = out.sampled
        drafts = None
        if self.draft is not None:
            drafts = self.draft.run(batch.layout.num_tokens, batch.buffer, s.token_ids, out.kept)
        token_ids, logprobs = np.asarray(s.token_ids), np.asarray(s.logprobs)
        kept = np.asarray(out.kept) if self.num_speculative_tokens else None
        t2 = time.perf_counter()
        want_logprobs = any(x.want_logprobs for x in seqs)
        if want_logprobs:
            ranks, top_ids, top_lps = (np.asarray(x) for x in (s.ranks, s.top_ids, s.top_logprobs))
        result = ModelRunnerOutput({}, {}, t1 - t0, t2 - t1, batch.layout.num_tokens)
        for i, (sched, seq) in enumerate(zip(so.scheduled, seqs, strict=True)):
            spec = self.requests[sched.req_id].spec
            if seq.prompt_targets is not None:
                result.prompt_logprobs[sched.req_id] = self._prompt_logprobs(
                    out, batch.token_rows[i], seq, spec.prompt_logprobs
                )
            if not seq.counts:
                continue
            r0 = batch.sample_rows[i]
            run = [r0]
            if seq.num_draft:  # the kept rows: the first, then while proposals were accepted
                run += [r for r in range(r0 + 1, r0 + 1 + seq.num_draft) if kept[r]]
            toks = []
            for r in run:
                sampled = SampledToken(int(token_ids[r]), float(logprobs[r]))
                if spec.logprobs is not None and want_logprobs:
                    k = spec.logprobs
                    sampled.rank = int(ranks[r])
                    sampled.top = [
                        (int(a), float(b))
                        for a, b in zip(top_ids[r, :k], top_lps[r, :k], strict=True)
                    ]
                toks.append(sampled)
            result.sampled[sched.req_id] = toks[0]
            if seq.num_draft:
                result.spec_tokens[sched.req_id] = toks[1:]
        if drafts is not None:
            drafts = np.asarray(drafts)
            for i, sched in enumerate(so.scheduled):
                if sched.req_id in result.sampled:
                    result.draft_token_ids[sched.req_id] = tuple(drafts[i].tolist())
        return result

    def _prompt_logprobs(self, out, token_rows, seq: SeqInput, k: int) -> PromptLogprobs:
        valid = np.nonzero(seq.prompt_targets >= 0)[0]
        rows = token_rows[valid]
        lp = np.asarray(out.prompt_logprob)[rows]
        rk = np.asarray(out.prompt_rank)[rows]
        ids = np.asarray(out.prompt_top_ids)[rows, :k]
        lps = np.asarray(out.prompt_top_logprobs)[rows, :k]
        return PromptLogprobs(
            positions=[seq.start + int(j) + 1 for j in valid],
            logprobs=[float(x) for x in lp],
            ranks=[int(x) for x in rk],
            top=[
                [(int(a), float(b)) for a, b in zip(r_ids, r_lps, strict=True)]
                for r_ids, r_lps in zip(ids, lps, strict=True)
            ],
        )
