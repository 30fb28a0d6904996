"""The block pool and the per-request block tables, with automatic prefix caching.

Plain Python (no jax): block ids and counts only. Block 0 is the reserved null block; it is
never handed out. Every other block is, at any time, either held (ref_cnt > 0, by one or more
requests) or in the free queue. A free block may still carry the hash of the tokens it holds:
it stays findable by the prefix cache until it is handed out again, and the free queue hands
out the least recently freed block first (LRU eviction).

Prefix-cache key of a full block (after vLLM's automatic prefix caching):
    hash_i = sha256(hash_{i-1} || token ids of block i || extra keys)
with hash_{-1} a fixed seed and the extra keys a request's cache salt. A request reuses
its longest run of leading full blocks whose hashes are cached, but always leaves at least its
last token to compute, so the step has logits to sample from.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

import numpy as np

from pagedjax.engine.request import Request

NULL_BLOCK_ID = 0
_ROOT_HASH = hashlib.sha256(b"pagedjax-prefix-cache").digest()


def hash_block(parent: bytes | None, token_ids, extra: str | None = None) -> bytes:
    """Prefix-cache hash of one full block (see module docstring)."""
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra.encode())
    return h.digest()


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since start: requests looked up, prompt tokens queried, tokens hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class BlockPool:
    """Blocks 1..num_blocks-1, their ref counts, hashes, the free queue and the hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (first = least recently freed). Insertion-ordered dict
        # as a linked list: O(1) pop-front, append and removal of a cache hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks)
        )
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Takes n blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.block_hash[block_id] = None

    def touch(self, block_ids: list[int]) -> None:
        """Takes another reference to each block (a prefix hit, or a shared block)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference to each block; blocks that reach 0 join the free queue's tail,
        in the order given (callers pass a request's blocks last-first, so that its prefix is
        evicted last)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise AssertionError(f"block {b} freed more often than taken")
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id] = block_hash
        self.cached.setdefault(block_hash, block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def num_free_after_touch(self, block_ids: list[int]) -> int:
        """Free blocks left if `block_ids` (cache hits) were taken."""
        return self.num_free_blocks - sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only possible when no block is held. Returns success."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, the prefix-cache lookups, copy-on-write of
    shared blocks, and a host pool for swapped-out requests.

    Copy-on-write: a block may be held by several requests (prefix-cache hits, or `fork` for
    the n samples of one prompt). A block held by more than one request is never written:
    when a request is about to write into such a block (its partly filled last block),
    `allocate_slots` gives it a fresh block and records the copy (source, destination) in
    `pending_copies`, which the runner performs before the step.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host_pool = BlockPool(num_host_blocks + 1, False) if num_host_blocks else None
        self.req_blocks: dict[str, list[int]] = {}
        self.req_host_blocks: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.replaced: dict[str, list[tuple[int, int]]] = {}
        self.stats = PrefixCacheStats()

    # ----------------------------------------------------------------- queries

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes), len(tokens) // bs):
            parent = request.block_hashes[i - 1] if i else None
            request.block_hashes.append(
                hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt)
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Leading full blocks of the request already cached, and the tokens they hold.

        At most `num_tokens - 1` tokens are reused, so at least one token is computed. A
        request that wants prompt logprobs reuses nothing.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ----------------------------------------------------------------- changes

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Gives the request blocks for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`) to take
        first; the request's `num_computed_tokens` must not include them yet.

        Returns:
            The ids of the blocks appended to the request's table (hits excluded), or None if
            the pool cannot provide them (nothing is changed then). A copy-on-write replaces
            an entry of the table instead; `take_replaced` reports it.
        """
        computed = list(new_computed_blocks or [])
        held = self.req_blocks.get(request.request_id, [])
        start = request.num_computed_tokens + len(computed) * self.block_size
        total_tokens = start + num_new_tokens
        need = max(self.blocks_needed(total_tokens) - len(held) - len(computed), 0)
        # The block the first new token lands in, if it is held already and shared.
        first = start // self.block_size
        cow = first < len(held) and self.pool.ref_cnt[held[first]] > 1
        if need + cow > self.pool.num_free_after_touch(computed):
            return None
        if computed:
            self.pool.touch(computed)
        new = self.pool.allocate(need + cow)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if cow:
            copy = new.pop()
            self.pending_copies.append((blocks[first], copy))
            self.replaced.setdefault(request.request_id, []).append((first, copy))
            self.pool.free([blocks[first]])
            blocks[first] = copy
        blocks.extend(computed)
        blocks.extend(new)
        self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        self._update_block_hashes(request)
        for i in range(min(num_tokens // self.block_size, len(request.block_hashes))):
            self.pool.cache_block(blocks[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Releases every block the request holds (its tail first, to be evicted first),
        on the device and, if it is swapped out, on the host."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))
        self.replaced.pop(request.request_id, None)
        host = self.req_host_blocks.pop(request.request_id, None)
        if host:
            self.host_pool.free(host)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Lets `child` share the parent's blocks that hold its first `num_tokens` tokens."""
        blocks = self.req_blocks.get(parent.request_id, [])[: self.blocks_needed(num_tokens)]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies to perform before the next step."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_replaced(self, request_id: str) -> list[tuple[int, int]]:
        """(index in the block table, new block id) entries replaced by copy-on-write."""
        return self.replaced.pop(request_id, [])

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the request's blocks to the host pool.

        Returns:
            (device block, host block) pairs to copy before the next step, or None if the
            host pool has no room (nothing changes then).
        """
        blocks = self.req_blocks.get(request.request_id, [])
        if self.host_pool is None or len(blocks) > self.host_pool.num_free_blocks:
            return None
        host = self.host_pool.allocate(len(blocks))
        self.pool.free(list(reversed(self.req_blocks.pop(request.request_id))))
        self.req_host_blocks[request.request_id] = host
        return list(zip(blocks, host, strict=True))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Brings a swapped-out request back, with room for `num_new_tokens` more tokens.

        Returns:
            (host block, device block) pairs to copy before the next step, or None if the
            device pool has no room (nothing changes then).
        """
        host = self.req_host_blocks[request.request_id]
        need = max(self.blocks_needed(request.num_computed_tokens + num_new_tokens), len(host))
        if need > self.pool.num_free_blocks:
            return None
        device = self.pool.allocate(need)
        del self.req_host_blocks[request.request_id]
        self.host_pool.free(host)
        self.req_blocks[request.request_id] = device
        self._cache_full_blocks(request, device, request.num_computed_tokens + num_new_tokens)
        return list(zip(host, device, strict=False))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash; only while no request holds a block. Returns
        whether it did."""
        return self.pool.reset_prefix_cache()
