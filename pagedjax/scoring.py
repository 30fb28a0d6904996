"""Log-likelihood of a text under the model: every position's next-token log-probability.

For perplexity (`benchmarks/quality.py`) and tests. It runs the model's `forward` (the
registry's for the architecture) directly, not the sampler: one sequence, prefilled in chunks
through a paged KV cache of its own (the engine's layout and dtype, a float8 one included),
the LM head applied to every position.

It sits above both `models` and `engine` (it packs its chunks with the engine's
`input_batch.BatchBuilder`), so that the model package never imports the engine.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.models import registry
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_jnp_dtype, kv_cache_shape


@functools.partial(
    jax.jit,
    static_argnames=("layout", "cfg", "backend", "tile", "chunk_pages"),
    donate_argnames=("kv_cache",),
)
def _chunk_logprobs(params, kv_cache, packed, targets, *, layout, cfg, backend, tile, chunk_pages):
    """Log-probabilities [T] float32 of `targets` [T] after each token of one packed chunk."""
    a = layout.unpack(packed)
    md = AttentionMetadata.from_arrays(a, query_tile_size=tile, kv_chunk_pages=chunk_pages)
    model = registry.get_model(cfg.architecture)
    hidden, kv_cache = model.forward(
        params, kv_cache, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
    )  # [T, D]
    logits = model.compute_logits(params, hidden, cfg=cfg)  # [T, V] float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], kv_cache


def token_logprobs(
    params: dict[str, Any],
    cfg: DecoderArchConfig,
    token_ids: list[int] | np.ndarray,
    *,
    kv_cache_dtype: str = "auto",
    chunk_size: int = 256,
    block_size: int = 16,
    attention_backend: str = "xla",
) -> np.ndarray:
    """log p(token_ids[i + 1] | token_ids[: i + 1]) for every i, as float64 [n - 1].

    Args:
        params, cfg: a model's params pytree (float or quantized) and its architecture.
        token_ids: [n] the text, n >= 2 and at most the model's context.
        kv_cache_dtype: "auto" (the params' dtype) or a float8 name of `ops.kv_cache`.
        chunk_size: tokens per prefill chunk (a multiple of 16).
        block_size: KV block size; attention_backend: "xla", "cpu" or "reference".

    Raises:
        ValueError: fewer than 2 tokens, or more than `max_position_embeddings`.

    Perplexity is exp(-mean(token_logprobs(...))).
    """
    ids = np.asarray(token_ids, np.int32)
    n = len(ids)
    if not 2 <= n <= cfg.max_position_embeddings:
        raise ValueError(
            f"need 2 to {cfg.max_position_embeddings} tokens (the model's context), got {n}"
        )
    chunk_pages = max(1, 32 // block_size)
    builder = BatchBuilder(
        max_num_batched_tokens=chunk_size,
        max_num_seqs=1,
        max_model_len=n,
        block_size=block_size,
        query_tile_size=32,
        kv_chunk_pages=chunk_pages,
    )
    num_blocks = math.ceil(n / block_size) + 1  # + the null block 0
    dtype = kv_cache_jnp_dtype(kv_cache_dtype, params["embed_tokens"].dtype)
    shape = kv_cache_shape(
        cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim
    )
    kv = init_kv_cache(shape, dtype)
    block_ids = np.arange(1, num_blocks, dtype=np.int32)
    out = []
    for start in range(0, n - 1, chunk_size):
        chunk = ids[start : min(start + chunk_size, n - 1)]  # the last token predicts nothing
        layout, packed = builder.build([SeqInput(chunk, start, block_ids)])
        targets = np.zeros(layout.num_tokens, np.int32)
        targets[: len(chunk)] = ids[start + 1 : start + 1 + len(chunk)]
        lp, kv = _chunk_logprobs(
            params,
            kv,
            packed.copy(),
            targets,
            layout=layout,
            cfg=cfg,
            backend=attention_backend,
            tile=32,
            chunk_pages=chunk_pages,
        )
        out.append(np.asarray(lp)[: len(chunk)])
    return np.concatenate(out).astype(np.float64)


def perplexity(logprobs: np.ndarray) -> float:
    """exp of the mean negative log-likelihood per token."""
    return float(np.exp(-np.mean(logprobs)))
