"""One glibc malloc arena per thread: the engine's thread never shares its heap with a worker's.

glibc gives each thread that allocates a malloc arena (a heap with its own lock and free
lists) until there are `M_ARENA_MAX` of them (by default 8 per core: 16 on 2 cores); after
that, a new thread shares an existing one, chosen round-robin starting with the main thread's. The
engine's process has about 20 threads once XLA has started (its thread pools, the server's
event loop, the inputs and grammar threads), so on a small machine the grammar compile thread
shared the engine thread's arena. llguidance's compile of a large schema allocates and frees
millions of small blocks there, and the engine thread's next large allocation then waited on
the arena's lock and consolidated the blocks the compile had freed: a step's input packing
took 4-24 ms instead of 0.5 ms (2 cores, a 400-object schema; see the "Structured outputs"
section of benchmarks/README.md).

`raise_arena_limit` raises glibc's limit to at least `ARENAS_MIN` (glibc's own default on
machines with 8 cores or more), so that every thread has an arena of its own. It must run
before the process's 9th arena exists, because glibc fixes the limit then: `pagedjax` calls it
on import, which is early enough unless jax has already started its backend. It does nothing
where the C library is not glibc, or where the operator chose a limit (`MALLOC_ARENA_MAX`, or
`glibc.malloc.arena_max` in `GLIBC_TUNABLES`). An arena costs address space (64 MiB reserved
per arena), not memory, until a thread uses it.
"""

from __future__ import annotations

import ctypes
import os

ARENAS_MIN = 64  # the least arena limit set (glibc's default is 8 per core)
M_ARENA_MAX = -8  # mallopt's parameter number (glibc malloc.h)


def raise_arena_limit() -> int:
    """Raises glibc's malloc arena limit to max(ARENAS_MIN, 8 per CPU).

    Returns:
        The limit set, or 0 where nothing was set (not glibc, an operator's setting, or
        mallopt refused).
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return 0
    except (AttributeError, ValueError, OSError):  # not glibc (or not a POSIX system)
        return 0
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return 0
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return 0
    limit = max(ARENAS_MIN, 8 * (os.cpu_count() or 1))
    return limit if mallopt(M_ARENA_MAX, limit) == 1 else 0
