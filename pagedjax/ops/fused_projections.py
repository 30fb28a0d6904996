"""Projections that read the same input fused into one weight, for the native CPU kernels.

q_proj, k_proj and v_proj all multiply a layer's normed hidden states, as do gate_proj and
up_proj: concatenated along their output columns (`qkv_proj` [in, N*H + 2*K*H],
`gate_up_proj` [in, 2*F]) they are one kernel call each instead of three and two. A native
call has a fixed cost (work handed to the thread pool and collected, the step's thunk) that is
most of a small projection's time in a single-sequence decode step: on the default model the
k and v projections (192 outputs) took 11 us each next to 25 us for q (576). The model splits
the fused output back (`models.layers.attention`, `models.layers.gated_mlp`).

Only stacks that the native kernels read in place are fused (`fuse_projections`): native GGUF
blocks of one format (rows concatenated: row n of a GGUF weight is output n) and packed
float32 panels (`cpu_linear.PackedWeight`, whose parts before the last fill whole 16-column
panels). Every output column is computed by the same operations as before, whatever the other
columns of its call, so the result is the same bits as the separate calls. `split_projections`
undoes it (for a running engine's params written as a checkpoint).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from pagedjax.ops import cpu_linear
from pagedjax.ops.gguf_quant import GGUFWeight

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# Axis 1 of [L, N, row_bytes] blocks and of [L, P, K, 16] panels: the outputs. One jitted
# function for every load, so that an engine loaded again with the same shapes compiles nothing.
_concat_columns = jax.jit(lambda *a: jnp.concatenate(a, axis=1))


def _concat(parts: list) -> GGUFWeight | cpu_linear.PackedWeight | None:
    """The parts as one weight of their output columns in order, or None where they do not
    fuse (a part missing, kinds or formats that differ, a stack not read in place)."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if all(isinstance(p, GGUFWeight) for p in parts):
        same = {(p.qtype, p.in_features, p.native, p.activations, p.blocks.shape[0]) for p in parts}
        if len(same) != 1 or not first.native or first.blocks.ndim != 3:
            return None
        blocks = _concat_columns(*(p.blocks for p in parts))
        return first.replace(blocks=jax.block_until_ready(blocks))
    if all(isinstance(p, cpu_linear.PackedWeight) for p in parts):
        same = {(p.max_rows, p.panels.shape[0], p.panels.shape[2]) for p in parts}
        if len(same) != 1 or first.panels.ndim != 4:
            return None
        if any(p.n % cpu_linear.PANEL for p in parts[:-1]):  # a part ending mid-panel
            return None
        panels = _concat_columns(*(p.panels for p in parts))
        return cpu_linear.PackedWeight(
            jax.block_until_ready(panels), sum(p.n for p in parts), first.max_rows
        )
    return None


def fuse_projections(params: dict) -> dict:
    """The params pytree with each group of `FUSED` in params["layers"] replaced by its fused
    weight where its parts fuse (see the module docstring), else unchanged. Each group is
    concatenated on its own, so the extra memory at any time is one group's."""
    layers = dict(params["layers"])
    for name, part_names in FUSED.items():
        fused = _concat([layers.get(p) for p in part_names])
        if fused is not None:
            for p in part_names:
                del layers[p]
            layers[name] = fused
    return {**params, "layers": layers}


def _split(w, sizes: list[int]):
    """A fused weight (or its unpacked [L, in, out] array) -> its parts of `sizes` columns."""
    bounds = list(itertools.accumulate(sizes))[:-1]
    if isinstance(w, GGUFWeight):
        return [w.replace(blocks=b) for b in jnp.split(w.blocks, bounds, axis=1)]
    if isinstance(w, cpu_linear.PackedWeight):
        panels = jnp.split(w.panels, [b // cpu_linear.PANEL for b in bounds], axis=1)
        return [
            cpu_linear.PackedWeight(p, n, w.max_rows) for p, n in zip(panels, sizes, strict=True)
        ]
    return jnp.split(w, bounds, axis=-1)


def split_projections(params: dict, cfg) -> dict:
    """`fuse_projections` undone: qkv_proj and gate_up_proj of params["layers"] back into
    their parts (q: num_attention_heads * head_dim columns, k and v: num_key_value_heads *
    head_dim each; gate and up: half each), for an architecture config `cfg`."""
    layers = dict(params["layers"])
    heads, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, part_names in FUSED.items():
        w = layers.pop(name, None)
        if w is None:
            continue
        n = w.shape[-1]
        sizes = [heads, kv, kv] if name == "qkv_proj" else [n // 2, n // 2]
        layers.update(zip(part_names, _split(w, sizes), strict=True))
    return {**params, "layers": layers}
