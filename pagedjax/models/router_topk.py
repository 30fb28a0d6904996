"""The router's top-k with torch's choice among tied values, so that tied router
probabilities pick the experts Hugging Face's `torch.topk` picks.

Which of several equal values `torch.topk` returns is not "the lowest index": on CPU (ATen's
`topk_impl_loop`), for k * 64 > n it runs `std::nth_element` on (value, index) pairs ordered
by value, descending, and keeps the first k; libstdc++'s `nth_element` is an introselect
(median-of-three pivot moved to the front, Hoare-style unguarded partition, insertion sort of
the last <= 3 elements), and the tied pairs end up wherever its swaps leave them. For three
tied experts 1, 2, 3 at the boundary of a top-2, torch picks 1 and 3.

`topk_like_torch` computes the top k (`top_k`; ties: the lower index) and, only when some row
has a tie across the boundary (the k-th and (k+1)-th largest values equal), replays that
introselect for every row (`lax.cond`: the common step pays one comparison). Limits: the
replay follows the nth_element path only; for k * 64 <= n (e.g. 128 experts, top-1) torch
uses a heap-based partial sort instead, whose tie order is not replayed (lowest index
there), nor is introselect's depth-limit fallback (never reached in a 2,483-case comparison
with torch over 4 to 128 experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _swap(v, ix, i, j):
    vi, vj, xi, xj = v[i], v[j], ix[i], ix[j]
    return v.at[i].set(vj).at[j].set(vi), ix.at[i].set(xj).at[j].set(xi)


def _partition(v, ix, first, last):
    """libstdc++'s `__unguarded_partition_pivot` on [first, last) (pivot moved to first)."""
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    gt = lambda p, q: v[p] > v[q]  # noqa: E731  (the comparator: descending by value)
    pick = jnp.where(
        gt(a, b),
        jnp.where(gt(b, c), b, jnp.where(gt(a, c), c, a)),
        jnp.where(gt(a, c), a, jnp.where(gt(b, c), c, b)),
    )
    v, ix = _swap(v, ix, first, pick)

    def body(state):
        v, ix, lo, hi, _ = state
        # Unguarded in libstdc++ (the median of three stops both scans); bounded here too,
        # because under vmap the rows already done keep running the loop body.
        lo = jax.lax.while_loop(lambda p: (p < last - 1) & (v[p] > v[first]), lambda p: p + 1, lo)
        hi = jax.lax.while_loop(lambda p: (p > first) & (v[first] > v[p]), lambda p: p - 1, hi - 1)
        go = lo < hi
        v2, ix2 = _swap(v, ix, lo, hi)
        v, ix = jnp.where(go, v2, v), jnp.where(go, ix2, ix)
        return v, ix, jnp.where(go, lo + 1, lo), hi, ~go

    v, ix, lo, _, _ = jax.lax.while_loop(
        lambda s: ~s[4], body, (v, ix, first + 1, last, jnp.bool_(False))
    )
    return v, ix, lo


def _insert(v, ix, i, first, last):
    """One step of `__insertion_sort` over [first, last): element i moved left past every
    smaller value (a no-op when i >= last)."""

    def cond(s):
        v, _, j, val, _ = s
        return (j > first) & (val > v[j - 1])

    def shift(s):
        v, ix, j, val, x = s
        return v.at[j].set(v[j - 1]), ix.at[j].set(ix[j - 1]), j - 1, val, x

    i = jnp.minimum(i, v.shape[0] - 1)
    live = i < last
    v2, ix2, j, val, x = jax.lax.while_loop(cond, shift, (v, ix, i, v[i], ix[i]))
    v2, ix2 = v2.at[j].set(val), ix2.at[j].set(x)
    return jnp.where(live, v2, v), jnp.where(live, ix2, ix)


def _nth_element_row(values: jax.Array, k: int) -> jax.Array:
    """The indices in the first k places after libstdc++'s nth_element(nth = k - 1) of one
    row [n] under "greater value first"."""
    n = values.shape[0]
    nth = k - 1
    ix = jnp.arange(n, dtype=jnp.int32)

    def body(s):
        v, ix, first, last = s
        v, ix, cut = _partition(v, ix, first, last)
        return v, ix, jnp.where(cut <= nth, cut, first), jnp.where(cut <= nth, last, cut)

    v, ix, first, last = jax.lax.while_loop(
        lambda s: s[3] - s[2] > 3, body, (values, ix, jnp.int32(0), jnp.int32(n))
    )
    for step in (1, 2):  # insertion sort of the last <= 3 elements
        v, ix = _insert(v, ix, first + step, first, last)
    return ix[:k]


SMALL_K = 8  # up to this many values per row, `top_k` takes them one at a time


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of rows without NaN: (values [T, k], indices [T, k] int32), in
    descending order, equal values by ascending index. For k <= SMALL_K it takes the k
    values one at a time (each a row max, then the least index not taken that holds it):
    XLA's CPU top_k took 3.1 ms on [512, 32] router probabilities (k = 3) against 0.5 ms on
    [512, 8] (benchmarks/moe.py's block, 2 cores)."""
    if k > SMALL_K:
        top, ids = jax.lax.top_k(values, k)
        return top, ids.astype(jnp.int32)
    n = values.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    taken = jnp.zeros(values.shape, bool)
    tops, ids = [], []
    for _ in range(k):
        free = jnp.where(taken, -jnp.inf, values)
        top = jnp.max(free, axis=-1, keepdims=True)
        idx = jnp.min(jnp.where((free == top) & ~taken, iota, n), axis=-1, keepdims=True)
        idx = jnp.minimum(idx, n - 1)
        taken = taken | (iota == idx)
        tops.append(top)
        ids.append(idx)
    return jnp.concatenate(tops, axis=-1), jnp.concatenate(ids, axis=-1)


def topk_like_torch(values: jax.Array, k: int) -> jax.Array:
    """The indices [T, k] int32 of the k largest of each row of values [T, n], the same set
    as `torch.topk` on CPU picks among ties (module docstring), in descending value order.
    """
    n = values.shape[-1]
    top, ids = top_k(values, min(k + 1, n))
    if k >= n or k * 64 <= n:
        return ids[:, :k].astype(jnp.int32)
    tied = jnp.any(top[:, k - 1] == top[:, k])

    def replay(values):
        picked = jax.vmap(lambda row: _nth_element_row(row, k))(values)  # [T, k]
        order = jnp.argsort(-jnp.take_along_axis(values, picked, axis=-1), axis=-1, stable=True)
        return jnp.take_along_axis(picked, order, axis=-1)

    return jax.lax.cond(tied, replay, lambda v: ids[:, :k].astype(jnp.int32), values)
