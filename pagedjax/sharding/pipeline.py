"""Pipeline parallelism: the decoder layers split into stages, micro-batches flowing through.

The stacked layer axis of every weight and of the KV cache is sharded over the "pipeline"
mesh axis, so stage s holds layers [s L / P, (s + 1) L / P) and their KV cache. A step's flat
batch is cut (on the host, `BatchBuilder.build_step(seqs, num_microbatches)`) into M
micro-batches of equal token count; a sequence cut in two is simply a prefill in two chunks,
the second attending to the first's K/V, which the same stage wrote one tick earlier.

The schedule is GPipe's (Huang et al., 2019) for a forward pass only: at tick t, stage s runs
micro-batch t - s, so after the first P - 1 ticks all stages work at once; the activations
move to the next stage with a collective permute. `shard_map` makes only the "pipeline" axis
manual; the "tensor" axis stays automatic, so tensor parallelism inside a stage is GSPMD's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from pagedjax.models import registry
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.sharding.mesh import PIPELINE


def pipeline_decoder(
    layers: dict[str, Any],
    kv_cache,
    h: jax.Array,
    metadata: dict[str, jax.Array],
    *,
    mesh: Mesh,
    cfg,
    attention_backend: str,
    tile: int,
    chunk_pages: int,
):
    """The decoder layers over M micro-batches, stage by stage.

    Args:
        layers: the stacked layer weights, layer axis sharded over "pipeline".
        kv_cache: (k, v), each [L, num_blocks, block_size, K, H], L sharded over "pipeline".
        h: [M, Tm, D] embedded micro-batches.
        metadata: the attention metadata fields of every micro-batch, each with a leading M
            axis (`METADATA_FIELDS`).

    Returns:
        h [M, Tm, D] after the last stage (replicated), and the updated cache.
    """
    num_stages = mesh.shape[PIPELINE]
    M = h.shape[0]
    ring = [(i, (i + 1) % num_stages) for i in range(num_stages)]

    def stage(layers, kv, h, metadata):
        s = jax.lax.axis_index(PIPELINE)
        num_local = jax.tree.leaves(layers)[0].shape[0]  # this stage's layers

        def run(m, x, kv):
            md = AttentionMetadata(
                **{k: v[m] for k, v in metadata.items()},
                query_tile_size=tile,
                kv_chunk_pages=chunk_pages,
            )
            return registry.get_model(cfg.architecture).decoder_layers(
                layers,
                kv,
                x,
                metadata["positions"][m],
                md,
                cfg=cfg,
                attention_backend=attention_backend,
                layer_offset=s * num_local,
            )

        def tick(t, carry):
            incoming, kv, out = carry
            m = t - s
            active = (m >= 0) & (m < M)
            mi = jnp.clip(m, 0, M - 1)
            x = jnp.where(s == 0, h[mi], incoming)  # [Tm, D]
            y, kv = jax.lax.cond(active, lambda x, kv: run(mi, x, kv), lambda x, kv: (x, kv), x, kv)
            out = jnp.where(active & (s == num_stages - 1), out.at[mi].set(y), out)
            return jax.lax.ppermute(y, PIPELINE, ring), kv, out

        init = (jnp.zeros_like(h[0]), kv, jnp.zeros_like(h))
        _, kv, out = jax.lax.fori_loop(0, M + num_stages - 1, tick, init)
        return jax.lax.psum(out, PIPELINE), kv  # only the last stage's `out` is not zero

    staged = PartitionSpec(PIPELINE)
    fn = jax.shard_map(
        stage,
        mesh=mesh,
        in_specs=(
            jax.tree.map(lambda _: staged, layers),
            (staged, staged),
            PartitionSpec(),
            PartitionSpec(),
        ),
        out_specs=(PartitionSpec(), (staged, staged)),
        axis_names={PIPELINE},
        check_vma=False,
    )
    return fn(layers, kv_cache, h, metadata)
