"""The draft model of speculative decoding (method "draft_model"): its params, its paged KV
cache and its compiled proposal call.

The draft has its own KV cache array, [L_draft, num_blocks, block_size, K_draft, H_draft],
with as many blocks as the target's, and shares the target's block tables: block b of a
request holds the target's K/V in the target cache and the draft's K/V of the same tokens in
the draft cache. So the scheduler and the prefix cache need nothing new: a prefix-cache hit
is a hit in both caches, copy-on-write copies both (`copy_blocks`), and a freed block is
rewritten in both by its next owner. (Swapping would have to carry both: the draft model
needs preemption_mode="recompute".)

After each target step, `propose` runs one compiled call per token bucket:
    1. the draft over the step's whole flat batch (same tokens, positions, slots), which
       writes its K/V wherever the target wrote;
    2. for every sequence that drew tokens, k greedy decode steps (`lax.fori_loop`) from its
       last kept token: each writes that token's K/V at its position and proposes the argmax.
The k proposals go back to the scheduler for the request's next step, where the target
verifies them. Proposals are greedy, so q is a point mass (see `ops.rejection_sampler`), and
the proposal K/V written past a request's computed tokens is rewritten by the next step
before anything reads it. Proposals that would cross into a block not yet allocated write
into the null block (lower quality proposals only; the target's output is unaffected).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.config import EngineConfig
from pagedjax.executor.input_batch import PackedLayout
from pagedjax.executor.step_executables import abstract
from pagedjax.models import loader, registry
from pagedjax.ops import cpu_gguf, cpu_linear, cpu_quant, sampling
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.fused_projections import fuse_projections
from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_bytes_per_block, kv_cache_shape
from pagedjax.sharding.rules import ShardingPlan


def load_draft(config: EngineConfig, mesh) -> tuple[dict[str, Any], ShardingPlan]:
    """The draft's params on `mesh` (the target replica's), and its sharding plan."""
    mc = config.speculative_config.draft_model_config
    source = loader.ModelSource(mc.source_kind, mc.source_path)
    if source.kind == "gguf" and mc.quantization != "gguf":  # dequantized: the conversion
        source = loader.converted_gguf_source(source, mc.download_dir)
    model = registry.get_model(mc.arch.architecture)
    plan = ShardingPlan(mesh, model.logical_unit_counts(mc.arch))
    params = loader.load_params(
        source,
        mc.arch,
        mc.dtype,
        sharding_for=plan.sharding_for(model.param_logical_axes(mc.arch)),
        quantization=mc.quantization,
    )
    if mc.linear_backend == "cpu":  # as the target's (`executor.model_loading.load_model`)
        params = cpu_quant.use_native(cpu_gguf.use_native(cpu_linear.pack_params(params)))
        params = fuse_projections(params)
    return params, plan


def draft_bytes_per_block(config: EngineConfig, block_size: int, dtype) -> int:
    a = config.speculative_config.draft_model_config.arch
    return kv_cache_bytes_per_block(
        a.num_hidden_layers, block_size, a.num_key_value_heads, a.head_dim, dtype
    )


def init_draft_cache(config: EngineConfig, num_blocks: int, block_size: int, dtype, sharding):
    a = config.speculative_config.draft_model_config.arch
    shape = kv_cache_shape(
        a.num_hidden_layers, num_blocks, block_size, a.num_key_value_heads, a.head_dim
    )
    return init_kv_cache(shape, dtype, sharding)


def propose(
    params,
    kv_cache,
    packed,
    token_ids,
    kept,
    *,
    layout: PackedLayout,
    cfg,
    backend: str,
    tile: int,
    chunk_pages: int,
    block_size: int,
):
    """The draft's pass over a step and its k proposals per sequence.

    Args:
        params, kv_cache: the draft's (the cache is donated).
        packed: the step's packed int32 buffer (`layout`, with speculation fields).
        token_ids: [R] int32 the target's draws of the step; kept: [R] bool which are kept.
        layout, cfg (the draft's architecture), backend, tile, chunk_pages, block_size:
            static.

    Returns:
        (proposals [S, K] int32, kv_cache); rows of sequences that drew nothing are junk.
    """
    model = registry.get_model(cfg.architecture)
    a = layout.unpack(packed)
    md = AttentionMetadata.from_arrays(a, query_tile_size=tile, kv_chunk_pages=chunk_pages)
    _, kv_cache = model.forward(
        params, kv_cache, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
    )
    R, S, K = layout.num_rows, layout.num_seqs, layout.spec_width
    first = a["first_row"]  # [S]
    num_kept = jax.ops.segment_sum(kept.astype(jnp.int32), a["row_start"], num_segments=R)
    last_row = first + num_kept[first] - 1  # [S] the row of each sequence's last kept draw
    valid = (a["seq_lens"] > 0) & (a["counts"][first] != 0)  # [S] the sequence drew
    x0 = jnp.where(valid, token_ids[last_row], 0)  # [S]
    pos0 = jnp.where(valid, a["positions"][a["logits_indices"][last_row]] + 1, 0)  # [S]
    tables = a["block_tables"]  # [S, B]
    B = tables.shape[1]
    zeros1 = jnp.zeros((1,), jnp.int32)

    def body(j, carry):
        kv, x, out = carry
        pos = jnp.where(valid, pos0 + j, 0)  # [S]
        col = jnp.minimum(pos // block_size, B - 1)
        block = jnp.where(pos // block_size < B, tables[jnp.arange(S), col], 0)
        dmd = AttentionMetadata(
            slot_mapping=jnp.where(valid, block * block_size + pos % block_size, 0),
            positions=pos,
            seq_lens=pos + 1,
            query_start_loc=jnp.arange(S + 1, dtype=jnp.int32),
            block_tables=jnp.where(valid[:, None], tables, 0),
            last_token_index=jnp.arange(S, dtype=jnp.int32),
            tile_seq=zeros1,
            tile_q_start=zeros1,
            tile_q_len=zeros1,
            tile_kv_len=zeros1,
            num_tiles=jnp.zeros((), jnp.int32),
            query_tile_size=tile,
            kv_chunk_pages=chunk_pages,
        )
        h, kv = model.forward(params, kv, x, pos, dmd, cfg=cfg, attention_backend=backend)
        nxt = sampling.argmax(model.compute_logits(params, h, cfg=cfg))
        return kv, nxt, out.at[:, j].set(nxt)

    out = jnp.zeros((S, K), jnp.int32)
    kv_cache, _, out = jax.lax.fori_loop(0, K, body, (kv_cache, x0, out))
    return out, kv_cache


class DraftRunner:
    """The draft's params, KV cache and compiled `propose` calls (one per token bucket),
    beside a `ModelRunner` whose block ids, buckets and packed buffers it shares.

    Args:
        config: the engine config (speculative_config.method == "draft_model").
        mesh: the target replica's mesh.
        block_size, kv_dtype: the target cache's.
        static: the target step's static arguments (backend, tile, chunk_pages).
    """

    def __init__(self, config: EngineConfig, mesh, block_size: int, kv_dtype, static: dict):
        self.config = config
        self.cfg = config.speculative_config.draft_model_config.arch
        self.params, self.plan = load_draft(config, mesh)
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.static = {k: static[k] for k in ("backend", "tile", "chunk_pages")}
        self.kv_cache = None
        self._exes: dict[int, Any] = {}
        self._layouts: dict[int, PackedLayout] = {}
        self._copy = None
        self._propose = jax.jit(
            propose,
            static_argnames=("layout", "cfg", "backend", "tile", "chunk_pages", "block_size"),
            donate_argnames=("kv_cache",),
        )

    def bytes_per_block(self) -> int:
        return draft_bytes_per_block(self.config, self.block_size, self.kv_dtype)

    def allocate(self, num_blocks: int) -> None:
        self.kv_cache = init_draft_cache(
            self.config, num_blocks, self.block_size, self.kv_dtype, self.plan.kv_cache()
        )

    def warmup(self, layouts: dict[int, PackedLayout], copy_fn, ids_spec, lazy=False) -> None:
        """Compiles `propose` for every bucket's layout (`lazy`: each at its first `run`)
        and the block copy of the cache."""
        self._layouts = layouts
        kv_spec = abstract(self.kv_cache)
        for key in () if lazy else layouts:
            self._compile(key)
        self._copy = jax.jit(copy_fn, donate_argnums=0).lower(kv_spec, ids_spec, ids_spec).compile()

    def _compile(self, key: int) -> Any:
        rep = self.plan.replicated()
        layout = self._layouts[key]
        R = layout.num_rows
        self._exes[key] = exe = self._propose.lower(
            self.params,
            abstract(self.kv_cache),
            jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((R,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((R,), jnp.bool_, sharding=rep),
            layout=layout,
            cfg=self.cfg,
            block_size=self.block_size,
            **self.static,
        ).compile()
        return exe

    def copy_blocks(self, src, dst) -> None:
        self.kv_cache = self._copy(self.kv_cache, src, dst)

    def run(self, key: int, packed, token_ids, kept):
        """Dispatches the bucket's `propose`; returns the [S, K] proposals (on the device)."""
        exe = self._exes.get(key) or self._compile(key)
        out, self.kv_cache = exe(self.params, self.kv_cache, packed, token_ids, kept)
        return out
