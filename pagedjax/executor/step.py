"""The pure device functions the runner compiles: the engine step and the small block and
sampling-state operations around it.

    step(params, kv_cache, sampling_state, packed, bitmask) ->
        (StepOutput, kv_cache, sampling_state)

`packed` is the step's one int32 host buffer (`executor.input_batch.PackedLayout`); `bitmask`
the structured-output token bitmask of the sampler rows (`ops.bitmask`; applied only when the
packed flag `use_bitmask` is set, otherwise a device-resident array of ones); the KV cache
and the sampling state are donated so that they are updated in place. Logits never leave the
device: the sampler runs inside the step and only ids, logprobs and the requested top-k
alternatives come back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.executor.input_batch import PackedLayout
from pagedjax.models import registry
from pagedjax.ops.attention import METADATA_FIELDS, AttentionMetadata
from pagedjax.ops.prompt_logprobs import prompt_logprobs
from pagedjax.ops.rejection_sampler import accepted_rows
from pagedjax.ops.sampling import (
    SAMPLE_BLOCK_ROWS,
    SamplerOutput,
    SamplingMetadata,
    count_sampled,
    largest_divisor,
    sample,
)
from pagedjax.sharding.expert import mesh_context
from pagedjax.sharding.pipeline import pipeline_decoder

PROMPT_LOGPROBS_CHUNK = 128  # positions per inner step of the prompt-logprobs computation
LOGITS_ROW_BLOCK = 64  # rows per LM-head block when a step has more rows than this


@struct.dataclass
class StepOutput:
    """What a step returns to the host.

    sampled: the `SamplerOutput` of the R sampler rows (S, or more with speculation).
    prompt_*: per flat token [T] (and [T, k]), the logprob, rank and top-k alternatives of the
    prompt token it predicts (zeros unless the step had prompt-logprob targets).
    kept: [R] bool, the row's draw is an output token (all True without speculation; with
    it, `ops.rejection_sampler.accepted_rows`).
    """

    sampled: SamplerOutput
    kept: jax.Array
    prompt_logprob: jax.Array
    prompt_rank: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array


def step(
    params,
    kv_cache,
    sampling_state,
    packed,
    bitmask,
    *,
    layout: PackedLayout,
    cfg,
    backend: str,
    tile: int,
    chunk_pages: int,
    max_logprobs: int,
    mesh=None,
    num_microbatches: int = 0,
    stages=None,
    sample_block_rows: int = SAMPLE_BLOCK_ROWS,
):
    """One engine step: the model over the flat batch, logits of each sequence's last token,
    the structured-output `bitmask` ([rows, ceil(V / 32)] int32, one row per sampler row;
    applied when a micro-batch sets `use_bitmask`), the sampler, and (when asked) prompt
    logprobs.

    With `num_microbatches` M > 0 (pipeline parallelism), `packed` is [M, layout.size], one
    micro-batch per row, run through `sharding.pipeline.pipeline_decoder` on `mesh`; the
    sampler then sees the M x S rows of all micro-batches, and prompt logprobs the M x T
    tokens, in micro-batch order; `stages` (a `sharding.stages.StageLayout`, or None for an
    even split) says which layers each stage runs. Without pipeline parallelism, `mesh` (or
    None) is the context mesh of the model (expert parallelism reads it). The model is the
    registry's for `cfg.architecture`. `sample_block_rows`: rows per block of the sampler's
    and prompt logprobs' [rows, V] work (`ops.sampling.by_row_blocks`; 0: all at once).
    """
    model = registry.get_model(cfg.architecture)
    if num_microbatches:
        parts = [layout.unpack(packed[m]) for m in range(num_microbatches)]
        md = {k: jnp.stack([a[k] for a in parts]) for k in METADATA_FIELDS}
        h = params["embed_tokens"][jnp.stack([a["input_ids"] for a in parts])]  # [M, Tm, D]
        h, kv_cache = pipeline_decoder(
            params["layers"],
            kv_cache,
            h,
            md,
            mesh=mesh,
            cfg=cfg,
            attention_backend=backend,
            tile=tile,
            chunk_pages=chunk_pages,
            stages=stages,
        )
        hidden = model.final_norm(params, h, cfg)  # [M, Tm, D]
        rows = jnp.concatenate([hidden[m][a["logits_indices"]] for m, a in enumerate(parts)])
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [M * Tm, D]
    else:
        parts = [layout.unpack(packed)]
        a = parts[0]
        md = AttentionMetadata.from_arrays(a, query_tile_size=tile, kv_chunk_pages=chunk_pages)
        with mesh_context(mesh):  # the mesh expert parallelism reads (`sharding.expert`)
            hidden, kv_cache = model.forward(
                params,
                kv_cache,
                a["input_ids"],
                a["positions"],
                md,
                cfg=cfg,
                attention_backend=backend,
            )  # [T, D]
        rows = hidden[a["logits_indices"]]  # [S, D]

    def cat(name):
        return jnp.concatenate([a[name] for a in parts])

    f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    sm = SamplingMetadata(
        temperature=f32(cat("temperature")),
        top_p=f32(cat("top_p")),
        top_k=cat("top_k"),
        min_p=f32(cat("min_p")),
        seed_lo=cat("seed_lo"),
        seed_hi=cat("seed_hi"),
        token_index=cat("token_index"),
        repetition_penalty=f32(cat("repetition_penalty")),
        presence_penalty=f32(cat("presence_penalty")),
        frequency_penalty=f32(cat("frequency_penalty")),
        use_bias=cat("use_bias") != 0,
        slot=cat("slot"),
        banned=cat("banned"),
        counts=cat("counts") != 0,
    )
    want_logprobs = jnp.any(jnp.stack([a["want_logprobs"] for a in parts]) != 0)
    want_prompt = jnp.any(jnp.stack([a["want_prompt"] for a in parts]) != 0)
    use_bitmask = jnp.any(jnp.stack([a["use_bitmask"] for a in parts]) != 0)
    prior = parts[0]["prior_drafts"] if layout.spec_width else None

    def sample_rows(logits, sm, prior, bitmask):
        return sample(
            logits,
            sm,
            sampling_state,
            max_logprobs=max_logprobs,
            want_logprobs=want_logprobs,
            prior_tokens=prior,
            bitmask=bitmask,
            use_bitmask=use_bitmask,
            block_rows=sample_block_rows,
        )

    if num_microbatches:  # [M * S, V]: rows of M parts interleave
        sampled = sample_rows(model.compute_logits(params, rows, cfg=cfg), sm, prior, bitmask)
    else:
        # The real rows come first.
        real = parts[0]["num_rows"] if layout.spec_width else jnp.sum(parts[0]["seq_lens"] > 0)
        head = functools.partial(model.compute_logits, params, cfg=cfg)
        sampled = _sample_in_row_blocks(head, sample_rows, rows, real, (sm, prior, bitmask))
    if layout.spec_width:  # verify the proposals; only kept draws reach the counts
        a = parts[0]
        kept = accepted_rows(sampled.token_ids, a["draft_token"], a["row_start"])
        sm = sm.replace(counts=sm.counts & kept)
    else:
        kept = jnp.ones(sampled.token_ids.shape, jnp.bool_)
    sampling_state = count_sampled(sampling_state, sm, sampled.token_ids)
    T, k = hidden.shape[0], max_logprobs

    def with_prompt():
        return prompt_logprobs(
            functools.partial(model.compute_logits, params, cfg=cfg),
            hidden,
            cat("prompt_targets"),
            max_logprobs=k,
            chunk=largest_divisor(T, PROMPT_LOGPROBS_CHUNK),
            block_rows=sample_block_rows,
        )

    def without():
        return (
            jnp.zeros((T,), jnp.float32),
            jnp.zeros((T,), jnp.int32),
            jnp.zeros((T, k), jnp.int32),
            jnp.zeros((T, k), jnp.float32),
        )

    plp, prank, pids, plps = jax.lax.cond(want_prompt, with_prompt, without)
    return StepOutput(sampled, kept, plp, prank, pids, plps), kv_cache, sampling_state


def _sample_in_row_blocks(head, sample_rows, rows, num_rows, per_row):
    """LM head and sampler of the first `num_rows` of `rows` [S, D], LOGITS_ROW_BLOCK rows at
    a time up to num_rows when S is larger: a prefill step of a few long prompts has a large S
    but few rows to sample, and a block's [LOGITS_ROW_BLOCK, V] logits are all the logits the
    step holds at once (an [S, V] array of 256 rows is 50 MB of temporaries that XLA's CPU
    client would map afresh every step; see `ops.sampling`).

    Args:
        head: hidden [B, D], num_rows -> logits [B, V] float32 (`model.compute_logits`).
        sample_rows: logits [B, V], *per_row -> a `SamplerOutput` of B rows.
        rows: [S, D] the sampler rows' final hidden states.
        num_rows: scalar int32, the real rows (which come first).
        per_row: a pytree of arrays (None allowed) with S rows on their leading axis, passed
            to `sample_rows` block by block.

    Returns:
        The `SamplerOutput` of the S rows. Rows past num_rows hold the sampler's draws from
        what the head gives for them, or zeros in a block wholly past num_rows.
    """
    S = rows.shape[0]
    R = LOGITS_ROW_BLOCK
    if S <= R:
        return sample_rows(head(rows, num_rows), *per_row)
    pad = -(-S // R) * R - S

    def padded(a):
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))

    rows, per_row = padded(rows), jax.tree.map(padded, per_row)

    def block(b, out):
        x = jax.lax.dynamic_slice_in_dim(rows, b * R, R)
        args = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, b * R, R), per_row)
        got = sample_rows(head(x, num_rows - b * R), *args)
        return jax.tree.map(
            lambda o, g: jax.lax.dynamic_update_slice_in_dim(o, g, b * R, axis=0), out, got
        )

    shapes = jax.eval_shape(
        lambda: sample_rows(head(rows[:R], R), *jax.tree.map(lambda a: a[:R], per_row))
    )
    out = jax.tree.map(lambda t: jnp.zeros((S + pad, *t.shape[1:]), t.dtype), shapes)
    out = jax.lax.fori_loop(0, (num_rows + R - 1) // R, block, out)
    return jax.tree.map(lambda a: a[:S], out)


def copy_blocks(kv_cache, src, dst):
    """kv[:, dst] = kv[:, src] for K and V. src, dst: [N] int32."""
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_cache)


def gather_blocks(kv_cache, ids):
    """[2, L, N, block_size, K, H]: the blocks `ids` of K and V."""
    return jnp.stack([c[:, ids] for c in kv_cache])


def scatter_blocks(kv_cache, ids, data):
    """kv[:, ids] = data (as returned by `gather_blocks`)."""
    return tuple(c.at[:, ids].set(d) for c, d in zip(kv_cache, data, strict=True))
