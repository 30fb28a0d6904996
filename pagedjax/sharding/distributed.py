"""Several processes (hosts) as one JAX program: `jax.distributed.initialize`.

With num_processes > 1 every process runs the same engine on the same requests (JAX's
multi-controller model): each holds the shards of its own devices, the compiled steps run
their collectives across processes, and the scheduler, being deterministic, makes the same
decisions everywhere. On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (once; later calls do nothing).

    Must run before anything else touches a JAX backend.

    Raises:
        ValueError: num_processes > 1 without a coordinator address.
    """
    if num_processes <= 1 or jax.distributed.is_initialized():
        return
    if not coordinator_address:
        raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    logger.info(
        "process %d of %d joined %s; %d devices in all, %d here",
        process_id,
        num_processes,
        coordinator_address,
        jax.device_count(),
        jax.local_device_count(),
    )
