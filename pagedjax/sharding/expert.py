"""Expert parallelism: the experts of a mixture-of-experts layer split by index over the
devices of the "tensor" axis (vLLM's `enable_expert_parallel`).

The expert stacks [E, ...] of a layer are sharded on their expert axis (`rules.RULES`:
"expert" -> "tensor"), so device j holds experts j E/P .. (j + 1) E/P - 1, whole. The hidden
states reaching the MLP are replicated over "tensor" (attention stays tensor-parallel, its
o_proj ends in an all-reduce), so every device already has every token: the dispatch is each
device taking the (token, expert) assignments of its own experts (`models.moe_layer.moe_block`
with its `expert_offset`), and the return is one all-reduce (`psum`) of the partial outputs
over "tensor". With attention replicated per device instead (data-parallel attention), the
same exchange would be an all-gather before and a reduce-scatter after.

`shard_map` makes only "tensor" manual; it runs inside the pipeline's `shard_map` too (which
makes "pipeline" manual), reading the mesh from the context (`jax.sharding.get_abstract_mesh`;
`mesh_context` sets it around a step without pipeline parallelism).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from pagedjax.sharding.mesh import TENSOR


def expert_parallel_size() -> int:
    """The size of the "tensor" axis of the context mesh (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or TENSOR not in mesh.axis_names:
        return 1
    return mesh.shape[TENSOR]


def mesh_context(mesh) -> contextlib.AbstractContextManager:
    """A context in which `mesh` is the abstract mesh that `expert_parallel` reads (no-op
    for None)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def expert_parallel(
    block: Callable[..., jax.Array],
    experts: dict[str, Any],
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    **kwargs: Any,
) -> jax.Array:
    """`block(experts, x, expert_ids, expert_weights, expert_offset=..., **kwargs)` on each
    device of "tensor" with its own experts, the partial outputs summed over "tensor".

    Args:
        experts: the layer's expert stacks, each leaf [E, ...] (sharded on E over "tensor").
        x: [T, D]; expert_ids, expert_weights: [T, k] (replicated).

    Returns:
        [T, D], replicated over "tensor".
    """
    P = expert_parallel_size()
    if P == 1:
        return block(experts, x, expert_ids, expert_weights, **kwargs)
    num_local = jax.tree.leaves(experts)[0].shape[0] // P

    def local(experts, x, ids, weights):
        offset = jax.lax.axis_index(TENSOR) * num_local
        y = block(experts, x, ids, weights, expert_offset=offset, **kwargs)
        return jax.lax.psum(y, TENSOR)

    fn = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(
            jax.tree.map(lambda _: PartitionSpec(TENSOR), experts),
            PartitionSpec(),
            PartitionSpec(),
            PartitionSpec(),
        ),
        out_specs=PartitionSpec(),
        axis_names={TENSOR},
        check_vma=False,
    )
    return fn(experts, x, expert_ids, expert_weights)
