"""pagedjax.malloc_arenas: after `import pagedjax`, every thread has a glibc malloc arena of its
own, even once XLA's thread pools exist; an operator's MALLOC_ARENA_MAX is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, an unknown name, or None
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="glibc's malloc arenas")

THREADS = 40

# Imports pagedjax, starts jax's CPU backend (its thread pools), then holds THREADS threads
# alive at once, each with a 64 KiB block from its arena (below the mmap threshold), and
# prints the return of raise_arena_limit and the number of arenas glibc's malloc_stats lists.
CHILD = f"""
import ctypes, os, threading
import pagedjax
from pagedjax.malloc_arenas import raise_arena_limit
import jax.numpy as jnp
jnp.ones(4).block_until_ready()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier({THREADS} + 1)
def hold():
    p = libc.malloc(65536)
    barrier.wait()  # every thread holds its block
    barrier.wait()  # counted
    libc.free(p)
threads = [threading.Thread(target=hold) for _ in range({THREADS})]
for t in threads:
    t.start()
barrier.wait()
r, w = os.pipe()
saved = os.dup(2)
os.dup2(w, 2)
libc.malloc_stats()
os.dup2(saved, 2)
os.close(w)
stats = os.read(r, 1 << 20).decode()
barrier.wait()
for t in threads:
    t.join()
print(raise_arena_limit(), stats.count("Arena "))
"""


def _run(env_extra: dict[str, str]) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    env |= {"JAX_PLATFORMS": "cpu", **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    limit, arenas = out.stdout.split()[-2:]
    return int(limit), int(arenas)


def test_every_thread_has_its_own_arena():
    """On a machine with fewer than 5 cores glibc's default limit (8 per core) is below the
    threads alive here, which then shared arenas (16 on 2 cores before the change)."""
    limit, arenas = _run({})
    assert limit >= max(64, 8 * (os.cpu_count() or 1))
    assert arenas > THREADS  # the main thread's arena and one per held thread, at least


def test_an_operators_arena_limit_is_kept():
    limit, arenas = _run({"MALLOC_ARENA_MAX": "2"})
    assert limit == 0
    assert arenas <= 2
