"""CPUs reserved for the engine's host-side work: `PAGEDJAX_CPU_NUM_OF_RESERVED_CPU`.

The operator's knob named after vLLM's `VLLM_CPU_NUM_OF_RESERVED_CPU`: with N > 0, the last N
CPUs the process may run on are kept from the steps' threads (XLA's thread pool and the native
CPU kernels, which size themselves to the CPUs they may run on) and given to the grammar
compile threads of structured outputs (`structured_output.compilation`), so that a large
grammar compiles on a core of its own instead of in the gaps of the steps. Unset or 0: nothing
is reserved, and the compile threads run on any CPU in Linux's idle scheduling class.

`import pagedjax` narrows the importing thread's CPU affinity to the CPUs not reserved
(`apply`); on Linux a thread's affinity is inherited by the threads it creates, so XLA's
threads and every later thread of the process (the server's, the engine's) run there. It must
happen before jax starts its CPU backend: in a process where jax already ran a computation
before `import pagedjax`, XLA keeps the threads it has. Linux only (elsewhere it does nothing).
The reserved CPUs are passed to child processes in `RESERVED_LIST_ENV`, so that a worker
process (which inherits the narrowed affinity) reserves the same CPUs, not N more.

Measured on 2 cores (8 streams, a new 400-object schema; benchmarks/README.md, "The compile
in the idle scheduling class"): with 1 reserved, no gap between the streams' tokens while the
grammar compiled exceeded two step times (the largest a median 1.35 steps, against 2.0-2.1 with
nothing reserved), and the grammar was ready after 0.7-0.9 s instead of 1.6-2.8 s; but the steps
on the one core left took 1.5x as long (75 against 49 ms), so the largest gap was about 100 ms
either way. It pays where cores are many and one is a small part of them.
"""

from __future__ import annotations

import os

ENV = "PAGEDJAX_CPU_NUM_OF_RESERVED_CPU"
RESERVED_LIST_ENV = "PAGEDJAX_RESERVED_CPUS"  # set by `apply` for child processes: "3" or "2,3"

_reserved: frozenset[int] = frozenset()  # set by `apply`


def split(value: str | None, cpus: set[int]) -> tuple[frozenset[int], frozenset[int]]:
    """Splits `cpus` into (not reserved, reserved) for the value of `ENV`.

    Args:
        value: the variable's value (None or "": nothing reserved).
        cpus: the CPUs the process may run on.

    Returns:
        The CPUs left to the steps, and the last `int(value)` CPUs (in number order).

    Raises:
        ValueError: naming `ENV`, where the value is not a whole number >= 0, or leaves the
            steps no CPU.
    """
    if value is None or not value.strip():
        return frozenset(cpus), frozenset()
    n = int(value) if value.strip().isdecimal() else -1
    if n < 0:
        raise ValueError(f"{ENV}={value!r}: expected a whole number of CPUs >= 0")
    if n >= len(cpus):
        raise ValueError(
            f"{ENV}={n} leaves the steps no CPU: this process may run on {len(cpus)} "
            f"({sorted(cpus)})"
        )
    order = sorted(cpus)
    return frozenset(order[: len(order) - n]), frozenset(order[len(order) - n :])


def apply() -> frozenset[int]:
    """Reads `ENV`; where it reserves CPUs, narrows this thread's affinity to the others and
    records the reserved ones (`reserved`, and `RESERVED_LIST_ENV` for child processes, whose
    reservation it then reuses). Returns the reserved CPUs (empty: none).

    Raises:
        ValueError: from `split`.
    """
    global _reserved
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    cpus = os.sched_getaffinity(0)
    inherited = os.environ.get(RESERVED_LIST_ENV, "")
    reserved = frozenset(int(c) for c in inherited.split(",") if c.strip().isdecimal())
    if inherited and os.environ.get(ENV) and reserved and cpus - reserved:
        steps = frozenset(cpus - reserved)  # a child of a process that reserved them
    else:
        steps, reserved = split(os.environ.get(ENV), cpus)
    if reserved:
        os.sched_setaffinity(0, steps)
        os.environ[RESERVED_LIST_ENV] = ",".join(map(str, sorted(reserved)))
    _reserved = reserved
    return reserved


def reserved() -> frozenset[int]:
    """The CPUs `apply` reserved (empty: none)."""
    return _reserved


def pin_to_reserved() -> bool:
    """Moves the calling thread onto the reserved CPUs, if any. Returns whether it did."""
    if not _reserved:
        return False
    try:
        os.sched_setaffinity(0, _reserved)
    except OSError:  # a cpuset that no longer holds them: stay where inherited
        return False
    return True
