"""The model runner: owns the params and the KV cache, turns `SchedulerOutput`s into steps.

It keeps a small state per request in the batch (its token ids and block table, mirrored
from the scheduler's outputs), builds each step's padded inputs with `BatchBuilder`, and
calls one ahead-of-time compiled executable per token bucket:

    step(params, kv_cache, packed) -> (token_ids [S], logprobs [S], kv_cache)

`packed` is the step's single int32 host buffer (see `engine.input_batch`); the KV cache is
donated so that it is updated in place. Every bucket is compiled at warm-up; a step whose
shape has no executable raises instead of compiling (after warm-up a compile is a bug), and
`compile_count()` counts every XLA compilation of the process, so tests can assert none happen.

The host buffer of a bucket is reused by the next step of that bucket; this is safe because
`execute` waits for the step's sampled tokens before returning.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from pagedjax.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from pagedjax.engine.input_batch import BatchBuilder, PackedLayout, SeqInput
from pagedjax.engine.scheduler import SchedulerOutput
from pagedjax.models import llama
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import (
    KVCache,
    init_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_jnp_dtype,
    kv_cache_shape,
)
from pagedjax.ops.sampling import SamplingMetadata, sample

logger = logging.getLogger(__name__)

BLOCK_OP_BATCH = 16  # block copies / swaps run in padded groups of this many blocks
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


@dataclasses.dataclass
class _RequestState:
    token_ids: np.ndarray  # [max_model_len + 1] int32, the first num_tokens valid
    num_tokens: int
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int


def _step(
    params,
    kv_cache,
    packed,
    *,
    layout: PackedLayout,
    cfg,
    backend: str,
    tile: int,
    chunk_pages: int,
):
    a = layout.unpack(packed)
    md = AttentionMetadata(
        slot_mapping=a["slot_mapping"],
        positions=a["positions"],
        seq_lens=a["seq_lens"],
        query_start_loc=a["query_start_loc"],
        block_tables=a["block_tables"],
        last_token_index=a["last_token_index"],
        tile_seq=a["tile_seq"],
        tile_q_start=a["tile_q_start"],
        tile_q_len=a["tile_q_len"],
        tile_kv_len=a["tile_kv_len"],
        num_tiles=a["num_tiles"],
        query_tile_size=tile,
        kv_chunk_pages=chunk_pages,
    )
    hidden, kv_cache = llama.forward(
        params, kv_cache, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
    )  # [T, D]
    logits = llama.compute_logits(params, hidden[a["logits_indices"]])  # [S, V]
    f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    sm = SamplingMetadata(
        temperature=f32(a["temperature"]),
        top_p=f32(a["top_p"]),
        top_k=a["top_k"],
        seed=a["seed"],
        token_index=a["token_index"],
    )
    token_ids, logprobs = sample(logits, sm)
    return token_ids, logprobs, kv_cache


def _copy_blocks(kv_cache, src, dst):
    """kv[:, dst] = kv[:, src] for K and V. src, dst: [BLOCK_OP_BATCH] int32."""
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_cache)


def _gather_blocks(kv_cache, ids):
    """[2, L, BLOCK_OP_BATCH, block_size, K, H]: the blocks `ids` of K and V."""
    return jnp.stack([c[:, ids] for c in kv_cache])


def _scatter_blocks(kv_cache, ids, data):
    """kv[:, ids] = data (as returned by `_gather_blocks`)."""
    return tuple(c.at[:, ids].set(d) for c, d in zip(kv_cache, data, strict=True))


class ModelRunner:
    """Params, KV cache and compiled steps of one model replica.

    Args:
        config: the engine config.
        params: the model's params pytree (on the device).
    """

    def __init__(self, config: EngineConfig, params: dict[str, Any]):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.arch = mc.arch
        self.params = params
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.dtype = jnp.dtype(mc.dtype)
        self.kv_dtype = kv_cache_jnp_dtype(cc.kv_cache_dtype, mc.dtype)  # float8 for "fp8"
        chunk_pages = max(1, KV_CHUNK_TOKENS // cc.block_size)
        self.builder = BatchBuilder(
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs,
            max_model_len=mc.max_model_len,
            block_size=cc.block_size,
            query_tile_size=QUERY_TILE_SIZE,
            kv_chunk_pages=chunk_pages,
        )
        self._jit_step = jax.jit(
            _step,
            static_argnames=("layout", "cfg", "backend", "tile", "chunk_pages"),
            donate_argnames=("kv_cache",),
        )
        self._static = dict(
            cfg=self.arch,
            backend=mc.attention_backend,
            tile=QUERY_TILE_SIZE,
            chunk_pages=chunk_pages,
        )
        self.num_blocks = 0
        self.kv_cache: KVCache | None = None
        self._executables: dict[int, Any] = {}
        self._block_ops: dict[str, Any] = {}
        self.host_cache: np.ndarray | None = None  # [2, L, num_host_blocks, bs, K, H]
        self.num_host_blocks = 0
        self.requests: dict[str, _RequestState] = {}

    # ----------------------------------------------------------------- memory

    def bytes_per_block(self) -> int:
        a = self.arch
        return kv_cache_bytes_per_block(
            a.num_hidden_layers, self.block_size, a.num_key_value_heads, a.head_dim, self.kv_dtype
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
        weights = sum(x.nbytes for x in jax.tree.leaves(self.params))
        activations = self._activation_bytes()
        free = budget - weights - activations
        if free < 2 * per_block:
            raise ValueError(
                f"no room for the KV cache: {budget} bytes allowed "
                f"(gpu_memory_utilization={cc.gpu_memory_utilization}), weights take {weights}, "
                f"the largest step's activations {activations}"
            )
        return free // per_block

    def _activation_bytes(self) -> int:
        """Temporary bytes of the largest bucket's step, from XLA's memory analysis."""
        layout = self.builder.layout(self.builder.buckets[-1])
        a = self.arch
        shape = kv_cache_shape(
            a.num_hidden_layers, 2, self.block_size, a.num_key_value_heads, a.head_dim
        )
        kv_spec = (jax.ShapeDtypeStruct(shape, self.kv_dtype),) * 2
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        compiled = self._jit_step.lower(
            self.params, kv_spec, packed, layout=layout, **self._static
        ).compile()
        analysis = compiled.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocates the device KV cache, and the host pool for swapping (allocated lazily by
        the OS: untouched pages cost nothing)."""
        a = self.arch
        self.num_blocks = num_blocks
        shape = kv_cache_shape(
            a.num_hidden_layers, num_blocks, self.block_size, a.num_key_value_heads, a.head_dim
        )
        self.kv_cache = init_kv_cache(shape, self.kv_dtype)
        self.num_host_blocks = num_host_blocks
        if num_host_blocks:
            host_shape = (2, a.num_hidden_layers, num_host_blocks + 1, *shape[2:])
            self.host_cache = np.zeros(host_shape, self.kv_dtype)

    # ----------------------------------------------------------------- compilation

    def warmup(self, use_tqdm: bool = True) -> float:
        """Compiles the step for every token bucket. Returns the seconds it took."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        t0 = time.perf_counter()
        buckets = self.builder.buckets
        kv_spec = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.kv_cache)
        for T in tqdm(buckets, desc="Compiling step buckets", disable=not use_tqdm, leave=False):
            layout = self.builder.layout(T)
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
            self._executables[T] = self._jit_step.lower(
                self.params, kv_spec, packed, layout=layout, **self._static
            ).compile()
        ids = jax.ShapeDtypeStruct((BLOCK_OP_BATCH,), jnp.int32)
        self._block_ops["copy"] = (
            jax.jit(_copy_blocks, donate_argnums=0).lower(kv_spec, ids, ids).compile()
        )
        if self.num_host_blocks:
            gather = jax.jit(_gather_blocks).lower(kv_spec, ids)
            data = jax.ShapeDtypeStruct(gather.out_info.shape, gather.out_info.dtype)
            self._block_ops["gather"] = gather.compile()
            self._block_ops["scatter"] = (
                jax.jit(_scatter_blocks, donate_argnums=0).lower(kv_spec, ids, data).compile()
            )
        seconds = time.perf_counter() - t0
        logger.info("compiled %d step buckets %s in %.1f s", len(buckets), buckets, seconds)
        return seconds

    # ----------------------------------------------------------------- steps

    def _apply_block_ops(self, so: SchedulerOutput) -> None:
        """Swap-outs, then swap-ins, then copies: each reads the blocks before the step."""
        B = BLOCK_OP_BATCH
        for i in range(0, len(so.blocks_to_swap_out), B):
            pairs = so.blocks_to_swap_out[i : i + B]
            ids = np.zeros(B, np.int32)
            ids[: len(pairs)] = [d for d, _ in pairs]
            data = np.asarray(self._block_ops["gather"](self.kv_cache, ids))
            self.host_cache[:, :, [h for _, h in pairs]] = data[:, :, : len(pairs)]
        for i in range(0, len(so.blocks_to_swap_in), B):
            pairs = so.blocks_to_swap_in[i : i + B]
            ids = np.zeros(B, np.int32)
            ids[: len(pairs)] = [d for _, d in pairs]
            data = np.zeros(
                self.host_cache.shape[:2] + (B,) + self.host_cache.shape[3:], self.host_cache.dtype
            )
            data[:, :, : len(pairs)] = self.host_cache[:, :, [h for h, _ in pairs]]
            self.kv_cache = self._block_ops["scatter"](self.kv_cache, ids, data)
        for i in range(0, len(so.blocks_to_copy), B):
            pairs = so.blocks_to_copy[i : i + B]
            src, dst = np.zeros(B, np.int32), np.zeros(B, np.int32)
            src[: len(pairs)] = [a for a, _ in pairs]
            dst[: len(pairs)] = [b for _, b in pairs]
            self.kv_cache = self._block_ops["copy"](self.kv_cache, src, dst)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            req = new.request
            p = req.sampling_params
            token_ids = np.zeros(self.max_model_len + 1, np.int32)
            token_ids[: len(new.token_ids)] = new.token_ids
            greedy = p.is_greedy
            self.requests[new.req_id] = _RequestState(
                token_ids=token_ids,
                num_tokens=len(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                temperature=0.0 if greedy else p.temperature,
                top_p=1.0 if greedy else p.top_p,
                top_k=0 if greedy else p.top_k,
                seed=req.seed,
            )
        for cached in so.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            for index, block in cached.replaced_block_ids:
                st.block_ids[index] = block
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def execute(self, so: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Runs one step. Returns request id -> (sampled token, logprob) for every request
        whose scheduled tokens reached its last known token."""
        self._update_states(so)
        self._apply_block_ops(so)
        if so.total_num_scheduled_tokens == 0:
            return {}
        seqs, ids = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            start = st.num_computed_tokens
            seqs.append(
                SeqInput(
                    token_ids=st.token_ids[start : start + n],
                    start=start,
                    block_ids=np.asarray(st.block_ids, np.int32),
                    temperature=st.temperature,
                    top_p=st.top_p,
                    top_k=st.top_k,
                    seed=st.seed,
                    token_index=st.num_tokens - st.num_prompt_tokens,
                )
            )
            ids.append(req_id)
        layout, packed = self.builder.build(seqs)
        exe = self._executables.get(layout.num_tokens)
        if exe is None:
            raise RuntimeError(f"no compiled step for {layout.num_tokens} tokens; warm up first")
        token_ids, logprobs, self.kv_cache = exe(self.params, self.kv_cache, packed)
        token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
        out = {}
        for i, (req_id, n) in enumerate(zip(ids, so.num_scheduled_tokens.values(), strict=True)):
            st = self.requests[req_id]
            st.num_computed_tokens += n
            if st.num_computed_tokens == st.num_tokens:
                tok = int(token_ids[i])
                st.token_ids[st.num_tokens] = tok
                st.num_tokens += 1
                out[req_id] = (tok, float(logprobs[i]))
        return out
