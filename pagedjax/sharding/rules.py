"""Sharding rules, declared once: logical axis names -> mesh axes.

Models name the logical axes of their arrays (`models.llama.param_logical_axes`); this module
alone maps them onto the mesh of a replica:

    "q_heads", "kv_heads", "mlp", "vocab"  ->  "tensor"   (Megatron-style tensor parallelism:
        column-parallel q/k/v, gate and up; row-parallel o and down; vocab-parallel embedding
        and LM head; Shoeybi et al., 2019)
    "moe_mlp"                               ->  "tensor"   (each expert's MLP columns, as a
        dense MLP's: a mixture-of-experts model without expert parallelism)
    "expert"                                ->  "tensor"   (whole experts by index: expert
        parallelism, `sharding.expert`; a model names this axis only when it is on)
    "layers"                                ->  "pipeline" (each stage holds its layers)
    "embed", anything else                  ->  replicated

A dimension whose size the mesh axis does not divide stays replicated on that axis; in
particular the KV cache is replicated over "tensor" when there are fewer KV heads than the
tensor-parallel size (or they do not divide evenly). Query heads are split only when the
number of heads is a multiple of the tensor size, so that no head is cut in two.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pagedjax.sharding.mesh import PIPELINE, TENSOR

logger = logging.getLogger(__name__)

RULES = {
    "q_heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "moe_mlp": TENSOR,
    "expert": TENSOR,
    "vocab": TENSOR,
    "layers": PIPELINE,
}

# Logical axes of the KV cache arrays [L, num_blocks, block_size, K, H].
KV_CACHE_AXES = ("layers", None, None, "kv_heads", None)


class ShardingPlan:
    """Shardings of one replica's params, KV cache and replicated arrays.

    Args:
        mesh: the replica's ("pipeline", "tensor") mesh.
        unit_sizes: logical axis -> the size of its indivisible unit count (e.g. "q_heads"
            -> number of query heads); a mesh axis must divide the count to shard the axis.
    """

    def __init__(self, mesh: Mesh, unit_counts: dict[str, int]):
        self.mesh = mesh
        self.unit_counts = unit_counts

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        """The PartitionSpec of an array with these logical axes."""
        axes = []
        for name in logical:
            mesh_axis = RULES.get(name) if name else None
            if mesh_axis is not None:
                size = self.mesh.shape[mesh_axis]
                if size == 1 or self.unit_counts.get(name, 0) % size:
                    mesh_axis = None
            axes.append(mesh_axis)
        while axes and axes[-1] is None:
            axes.pop()
        return PartitionSpec(*axes)

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def kv_cache(self) -> NamedSharding:
        return self.sharding(KV_CACHE_AXES)

    def sharding_for(self, logical: dict[str, Any]) -> Callable[..., Any]:
        """The sharding of each parameter, by its path in the params pytree.

        Returns `fn(name, leaf=None, ndim=None)`: for "layers/q_proj" (a float weight) the
        sharding of its logical axes; with `leaf` a `QuantizedWeight`, a QuantizedWeight of
        the shardings of its fields; for a field path "layers/q_proj/scales" of rank `ndim`,
        that field's sharding. A quantized weight splits only its output columns: qweight
        [L, in(/8), out] and the scales / zeros [L, (G,) out] over the out axis; its input
        rows (packed, grouped or permuted) stay whole, so a row-parallel quantized layer is
        replicated; a quantized expert stack [L, E, in, out] keeps its expert axis's split
        (scales [L, E, out]). Paths with no logical axes (KV-cache scales) are replicated.
        """
        from pagedjax.ops.quant import QuantizedWeight

        def axes_of(path: list[str]):
            axes: Any = logical
            for part in path:
                axes = axes.get(part) if isinstance(axes, dict) else None
            return axes

        def field(axes, name: str, ndim: int):
            if axes is None:
                return self.replicated()
            lead, out = tuple(axes[:-2]), axes[-1]  # (layers,) or (layers, expert)
            if name in ("qweight", "scales", "zeros"):
                return self.sharding(lead + (None,) * (ndim - len(lead) - 1) + (out,))
            return self.sharding(lead + (None,) * (ndim - len(lead)))  # perm, input_scale

        def fn(name: str, leaf: Any = None, ndim: int | None = None):
            path = name.split("/")
            if isinstance(leaf, QuantizedWeight):
                axes = axes_of(path)
                return jax.tree.map(
                    lambda f, x: field(axes, f, x.ndim),
                    QuantizedWeight(
                        qweight="qweight",
                        scales="scales",
                        zeros=None if leaf.zeros is None else "zeros",
                        perm=None if leaf.perm is None else "perm",
                        input_scale=None if leaf.input_scale is None else "input_scale",
                        method=leaf.method,
                        in_features=leaf.in_features,
                    ),
                    leaf,
                )
            axes = axes_of(path)
            if axes is None and len(path) == 3 and ndim is not None:  # a quantized field
                return field(axes_of(path[:2]), path[2], ndim)
            return self.sharding(axes) if axes is not None else self.replicated()

        return fn


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays of a pytree (device id as a string)."""
    import jax

    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def max_device_bytes(tree: Any) -> int:
    """Bytes of a pytree's arrays on the device holding the most of them: its share of each
    sharded array (a tensor-parallel split, a pipeline stage, num_experts / TP whole experts
    under expert parallelism), what an accelerator's KV budget loses to the weights."""
    return max(per_device_bytes(tree).values(), default=0)
