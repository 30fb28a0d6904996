"""The n > 1 samples of one prompt: who waits for whom, and the fork of their blocks.

The first sample (the parent) prefills the prompt alone; its siblings are held here. Once
the parent has computed the prompt, each sibling takes the parent's blocks (shared,
ref-counted by the `KVCacheManager`) and computes only the last prompt token itself, in its
own copy of the partly filled last block (copy-on-write, done by the block manager when the
sibling first writes). If the parent ends before its prompt is computed, the next sibling
becomes the parent of the rest. Plain Python, no jax.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedjax.engine.kv_cache_manager import KVCacheManager
from pagedjax.engine.request import Request


class ForkGroups:
    """Siblings waiting for their parent's prompt, by parent id."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[Request]] = {}

    def hold(self, child: Request, parent: Request) -> None:
        """Holds `child` until `parent` has computed its prompt."""
        self._waiting.setdefault(parent.request_id, []).append(child)

    def has_siblings(self, parent: Request) -> bool:
        return parent.request_id in self._waiting

    def fork(self, parent: Request, kv: KVCacheManager) -> list[Request]:
        """The parent has computed its prompt: its siblings share those blocks (all but the
        last prompt token's) and are returned, to be queued at the front of waiting."""
        shared = parent.num_prompt_tokens - 1
        children = self._waiting.pop(parent.request_id, [])
        for child in children:
            kv.fork(parent, child, shared)
            child.num_computed_tokens = shared
        return children

    def take_siblings(self, parent: Request) -> list[Request]:
        """Forgets and returns the siblings held for `parent` (they end with it)."""
        return self._waiting.pop(parent.request_id, [])

    def parent_ended(self, parent: Request) -> Request | None:
        """The parent ended before forking: returns the sibling that takes its place (to be
        queued), which then holds the others; None if it had no siblings."""
        siblings = self._waiting.pop(parent.request_id, None)
        if not siblings:
            return None
        head, rest = siblings[0], siblings[1:]
        if rest:
            self._waiting[head.request_id] = rest
        return head

    def discard(self, reqs: Iterable[Request]) -> None:
        """Forgets held siblings that ended (aborted) while waiting."""
        gone = {id(r) for r in reqs}
        for parent_id in list(self._waiting):
            kept = [r for r in self._waiting[parent_id] if id(r) not in gone]
            if kept:
                self._waiting[parent_id] = kept
            else:
                del self._waiting[parent_id]
