"""Pipeline parallelism: the decoder layers split into stages, micro-batches flowing through.

The stacked layer axis of every weight and of the KV cache is sharded over the "pipeline"
mesh axis, so stage s holds its layers and their KV cache. The split is vLLM's even one or
the user's (`sharding.stages`); stages of unequal size hold stacks padded to the largest
stage (`pad_stage_params`: stage s's layers first, zeros after them), and each stage runs
only its own layers: it hands the model's `decoder_layers` its stack with a
`models.layers.REAL_LAYERS` mask, which `scan_layers` (the one layer loop every family
uses) reads, and its first layer's model index as `layer_offset`, so per-layer windows and
RoPE tables stay right. No model module knows about padding. A step's flat
batch is cut (on the host, `BatchBuilder.build_step(seqs, num_microbatches)`) into M
micro-batches of equal token count; a sequence cut in two is simply a prefill in two chunks,
the second attending to the first's K/V, which the same stage wrote one tick earlier.

The schedule is GPipe's (Huang et al., 2019) for a forward pass only: at tick t, stage s runs
micro-batch t - s, so after the first P - 1 ticks all stages work at once; the activations
move to the next stage with a collective permute. `shard_map` makes only the "pipeline" axis
manual; the "tensor" axis stays automatic, so tensor parallelism inside a stage is GSPMD's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from pagedjax.models import registry
from pagedjax.models.layers import REAL_LAYERS
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.quant import QuantizedWeight
from pagedjax.sharding.mesh import PIPELINE
from pagedjax.sharding.stages import StageLayout


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
    stages: StageLayout | None = None,
):
    """The decoder layers over M micro-batches, stage by stage.

    Args:
        layers: the stacked layer weights, layer axis sharded over "pipeline" (padded to
            P x stages.stage_size rows when the stages are uneven, `pad_stage_params`).
        kv_cache: (k, v), each [Lp, num_blocks, block_size, K, H], Lp (the stacks' rows)
            sharded over "pipeline".
        h: [M, Tm, D] embedded micro-batches.
        metadata: the attention metadata fields of every micro-batch, each with a leading M
            axis (`METADATA_FIELDS`).
        stages: the layers of each stage; None: an even split of the stacks' rows.

    Returns:
        h [M, Tm, D] after the last stage (replicated), and the updated cache.
    """
    num_stages = mesh.shape[PIPELINE]
    M = h.shape[0]
    ring = [(i, (i + 1) % num_stages) for i in range(num_stages)]

    def stage(layers, kv, h, metadata):
        s = jax.lax.axis_index(PIPELINE)
        num_local = jax.tree.leaves(layers)[0].shape[0]  # this stage's rows
        offset = s * num_local  # the model index of this stage's first layer
        if stages is not None and not stages.is_even:
            offset = jnp.asarray(stages.starts, jnp.int32)[s]
            num_real = jnp.asarray(stages.sizes, jnp.int32)[s]
            layers = {**layers, REAL_LAYERS: jnp.arange(num_local) < num_real}  # [Ls]

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
                layer_offset=offset,
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


def pad_stage_params(
    params: dict[str, Any], stages: StageLayout, sharding_for: Callable[..., Any]
) -> dict[str, Any]:
    """The params with every stacked layer weight [L, ...] padded to the stage layout's rows
    [P x stage_size, ...] (model layer l at row `stages.padded_rows()[l]`, zeros elsewhere)
    and placed with its final sharding, one stack at a time (each input stack is freed once
    its padded copy exists).

    Args:
        params: the model's params pytree, stacks of L rows (on the replica's devices).
        stages: the stage layout.
        sharding_for: `ShardingPlan.sharding_for` of a plan whose "layers" unit count is
            `stages.padded_num_layers` (the layer axis split over "pipeline").
    """
    rows = np.asarray(stages.padded_rows(), np.int32)

    def pad(x):  # [L, ...] -> [P * stage_size, ...]
        return jnp.zeros((stages.padded_num_layers, *x.shape[1:]), x.dtype).at[rows].set(x)

    layers = {}
    for name, w in params["layers"].items():
        path = "layers/" + name
        target = sharding_for(path, w) if isinstance(w, QuantizedWeight) else sharding_for(path)
        layers[name] = jax.jit(lambda w: jax.tree.map(pad, w), out_shardings=target)(w)
        for leaf in jax.tree.leaves(w):
            leaf.delete()
    return {**params, "layers": layers}
