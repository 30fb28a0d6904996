"""The pure device functions the runner compiles: the engine step and the small block and
sampling-state operations around it.

    step(params, kv_cache, sampling_state, packed) ->
        (StepOutput, kv_cache, sampling_state)

`packed` is the step's one int32 host buffer (`engine.input_batch.PackedLayout`); the KV cache
and the sampling state are donated so that they are updated in place. Logits never leave the
device: the sampler runs inside the step and only ids, logprobs and the requested top-k
alternatives come back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.engine.input_batch import PackedLayout
from pagedjax.models import llama
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.sampling import (
    SamplerOutput,
    SamplingMetadata,
    count_sampled,
    prompt_logprobs,
    sample,
)

PROMPT_LOGPROBS_CHUNK = 128  # positions per inner step of the prompt-logprobs computation


@struct.dataclass
class StepOutput:
    """What a step returns to the host.

    sampled: the `SamplerOutput` of the S rows. prompt_*: per flat token [T] (and [T, k]),
    the logprob, rank and top-k alternatives of the prompt token it predicts (zeros unless
    the step had prompt-logprob targets).
    """

    sampled: SamplerOutput
    prompt_logprob: jax.Array
    prompt_rank: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array


def step(
    params,
    kv_cache,
    sampling_state,
    packed,
    *,
    layout: PackedLayout,
    cfg,
    backend: str,
    tile: int,
    chunk_pages: int,
    max_logprobs: int,
):
    """One engine step: the model over the flat batch, logits of each sequence's last token,
    the sampler, and (when asked) prompt logprobs."""
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
        min_p=f32(a["min_p"]),
        seed=a["seed"],
        token_index=a["token_index"],
        repetition_penalty=f32(a["repetition_penalty"]),
        presence_penalty=f32(a["presence_penalty"]),
        frequency_penalty=f32(a["frequency_penalty"]),
        use_bias=a["use_bias"] != 0,
        slot=a["slot"],
        banned=a["banned"],
        counts=a["counts"] != 0,
    )
    sampled = sample(
        logits, sm, sampling_state, max_logprobs=max_logprobs, want_top=a["want_top"] != 0
    )
    sampling_state = count_sampled(sampling_state, sm, sampled.token_ids)
    T, k = hidden.shape[0], max_logprobs

    def with_prompt():
        return prompt_logprobs(
            functools.partial(llama.compute_logits, params),
            hidden,
            a["prompt_targets"],
            max_logprobs=k,
            chunk=_largest_divisor(T, PROMPT_LOGPROBS_CHUNK),
        )

    def without():
        return (
            jnp.zeros((T,), jnp.float32),
            jnp.zeros((T,), jnp.int32),
            jnp.zeros((T, k), jnp.int32),
            jnp.zeros((T, k), jnp.float32),
        )

    plp, prank, pids, plps = jax.lax.cond(a["want_prompt"] != 0, with_prompt, without)
    return StepOutput(sampled, plp, prank, pids, plps), kv_cache, sampling_state


def _largest_divisor(n: int, at_most: int) -> int:
    return max(c for c in range(1, min(n, at_most) + 1) if n % c == 0)


def copy_blocks(kv_cache, src, dst):
    """kv[:, dst] = kv[:, src] for K and V. src, dst: [N] int32."""
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_cache)


def gather_blocks(kv_cache, ids):
    """[2, L, N, block_size, K, H]: the blocks `ids` of K and V."""
    return jnp.stack([c[:, ids] for c in kv_cache])


def scatter_blocks(kv_cache, ids, data):
    """kv[:, ids] = data (as returned by `gather_blocks`)."""
    return tuple(c.at[:, ids].set(d) for c, d in zip(kv_cache, data, strict=True))
