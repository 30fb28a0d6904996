"""The mixture-of-experts MLP block: the router, the grouping of tokens by expert, and the
grouped matmul over the chosen experts only.

Router (Hugging Face's `MixtralTopKRouter` / `Qwen3MoeTopKRouter`): logits = x @ router
[T, E], probabilities = softmax(logits) in float32, the top-k experts of each token
(among tied probabilities the experts `torch.topk` picks: `models.router_topk`), their
probabilities renormalised to sum to 1 when `norm_topk_prob` (always for Mixtral, whose
top-k-of-logits-then-softmax is the same number). Each token's output is the weighted sum
of its k experts' SwiGLU MLPs.

Grouped matmul (as in MegaBlocks, Gale et al., 2022): the T*k (token, expert) assignments are
sorted by expert and laid out in tiles of m rows, each group padded to whole tiles so that
every tile belongs to one expert; tile t then multiplies by its expert's weight
(`ops.linear.expert_linear`). With G non-empty groups (at most min(E, T*k)) the layout has at
most ceil((T*k + G*(m-1)) / m) tiles; m is picked so that G*(m-1) <= T*k / 2, so the rows
computed are at most 1.5 x T*k (plus one tile): the FLOPs follow top-k, not the number of
experts. (`jax.lax.ragged_dot`, on XLA's CPU backend, computes every expert over every row:
FLOPs x E / k; see benchmarks/moe.py.)

Expert parallelism (`sharding.expert`) runs `moe_block` on each device with its own slice of
the experts (`expert_offset`): assignments to other devices' experts go to a last, dropped
group, and the partial outputs are summed over the devices.

Dimensions: T tokens, D hidden, E experts (E_l held here), k experts per token, Fe the
expert MLP size, A = T*k assignments, m rows per tile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.models.layers import _ACTIVATIONS
from pagedjax.models.router_topk import topk_like_torch
from pagedjax.ops.linear import expert_linear, linear

MAX_TILE_ROWS = 64


def route(
    x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """The top-k experts of each token and their weights.

    Args:
        x: [T, D] normed hidden states.
        router: [D, E] the router (HF's `gate.weight`, transposed).
        top_k: experts per token (`num_experts_per_tok`).
        norm_topk_prob: renormalise the k probabilities to sum to 1.

    Returns:
        (expert ids [T, k] int32, in descending probability, tied ones as torch.topk;
        weights [T, k] in x's dtype).
    """
    logits = linear(x, router).astype(jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    ids = topk_like_torch(probs, top_k)  # [T, k]
    top = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), top.astype(x.dtype)


def tile_rows(num_assignments: int, num_groups: int) -> tuple[int, int]:
    """(m rows per tile, n_tiles) for A assignments in `num_groups` groups: m the largest
    power of two (<= MAX_TILE_ROWS) with G * (m - 1) <= A / 2, where G = min(groups, A)."""
    A = num_assignments
    G = min(num_groups, A)
    m = 1
    while m * 2 <= MAX_TILE_ROWS and G * (m * 2 - 1) * 2 <= A:
        m *= 2
    return m, -(-(A + G * (m - 1)) // m)


def group_layout(group: jax.Array, num_groups: int, m: int, n_tiles: int):
    """Sorts assignments by group and places them in tiles of m rows, each group starting a
    fresh tile.

    Args:
        group: [A] int32 in [0, num_groups), each assignment's group.

    Returns:
        (order [A]: the assignments sorted by group (stable),
         dest [A]: the padded row of each sorted assignment, < n_tiles * m,
         tile_group [n_tiles]: the group of each tile, clipped to num_groups - 1 past the end).
    """
    A = group.shape[0]
    order = jnp.argsort(group, stable=True)  # [A]
    sorted_group = group[order]
    counts = jnp.zeros((num_groups,), jnp.int32).at[group].add(1)  # [G]
    padded = (counts + m - 1) // m * m
    start = jnp.cumsum(counts) - counts
    padded_start = jnp.cumsum(padded) - padded
    rank = jnp.arange(A, dtype=jnp.int32) - start[sorted_group]
    dest = padded_start[sorted_group] + rank  # [A]
    padded_end = jnp.cumsum(padded)  # [G]
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * m
    tile_group = jnp.searchsorted(padded_end, tile_start, side="right")
    return order, dest, jnp.minimum(tile_group, num_groups - 1).astype(jnp.int32)


def moe_block(
    w: Mapping[str, Any],
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    *,
    activation: str = "silu",
    expert_offset: jax.Array | int = 0,
) -> jax.Array:
    """The experts' part of the MoE MLP over the experts held in `w`.

    Args:
        w: experts_gate, experts_up [E_l, D, Fe], experts_down [E_l, Fe, D] (plain or
            quantized stacks): experts expert_offset .. expert_offset + E_l - 1.
        x: [T, D] normed hidden states.
        expert_ids, expert_weights: [T, k] from `route`.
        activation: Hugging Face's `hidden_act`.
        expert_offset: the first expert held here (expert parallelism), else 0.

    Returns:
        [T, D] in x's dtype: sum over the token's experts held here of
        weight * down(act(gate(x)) * up(x)).
    """
    T, D = x.shape
    k = expert_ids.shape[-1]
    E_l = w["experts_gate"].shape[0]
    A = T * k
    local = expert_ids.reshape(A) - expert_offset  # [A]
    held = (local >= 0) & (local < E_l)
    group = jnp.where(held, local, E_l)  # the last group: experts held elsewhere
    m, n_tiles = tile_rows(A, E_l + 1)
    order, dest, tile_group = group_layout(group, E_l + 1, m, n_tiles)
    token = order // k  # [A] the token of each sorted assignment
    weight = jnp.where(held, expert_weights.reshape(A), 0).astype(x.dtype)[order]
    rows = jnp.zeros((n_tiles * m, D), x.dtype).at[dest].set(x[token])
    rows = rows.reshape(n_tiles, m, D)
    act = _ACTIVATIONS[activation]
    # tile_group E_l: assignments held elsewhere, dropped below (their weight is 0)
    gate = expert_linear(rows, w["experts_gate"], tile_group)  # [n_tiles, m, Fe]
    up = expert_linear(rows, w["experts_up"], tile_group)
    y = expert_linear(act(gate) * up, w["experts_down"], tile_group)  # [n_tiles, m, D]
    y = y.reshape(n_tiles * m, D)[dest] * weight[:, None]  # [A, D]
    return jnp.zeros((T, D), x.dtype).at[token].add(y)
