"""The compiled step of every token bucket: `executor.step.step` lowered ahead of time for
the bucket's padded layout (`BatchBuilder`), and when it is compiled.

By default every bucket is compiled at warm-up, and a step whose shape has no executable is
a bug (`get` raises). With `enforce_eager=True` (vLLM's name for "skip the ahead-of-time
graph capture") start-up compiles no step: each bucket compiles the first time a step of
that size runs, and that step waits for it (seconds); later steps of the bucket reuse it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.executor import step as step_fn
from pagedjax.executor.input_batch import BatchBuilder
from pagedjax.ops.sampling import SAMPLE_BLOCK_ROWS
from pagedjax.sharding.rules import ShardingPlan

logger = logging.getLogger(__name__)

STATIC_ARGNAMES = (
    "layout",
    "cfg",
    "backend",
    "tile",
    "chunk_pages",
    "max_logprobs",
    "mesh",
    "num_microbatches",
    "stages",
    "sample_block_rows",
)


def abstract(tree):
    """`jax.ShapeDtypeStruct`s (with shardings) of a pytree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def sample_block_rows(mesh) -> int:
    """Rows per block of the sampler's [rows, V] work (`ops.sampling.by_row_blocks`): blocks
    keep a CPU step's temporaries small (`ops.sampling`); on several devices, whose
    vocabulary-sharded logits need collectives in every block, or an accelerator, all rows
    at once (0)."""
    devices = mesh.devices.flat
    one_cpu = mesh.devices.size == 1 and devices[0].platform == "cpu"
    return SAMPLE_BLOCK_ROWS if one_cpu else 0


class StepExecutables:
    """The step executables of one replica, keyed by the packed layout's token count.

    Args:
        builder: the replica's batch builder (its `buckets` and layouts).
        plan: the replica's sharding plan.
        static: the step's static arguments other than layout, mesh and num_microbatches
            (cfg, backend, tile, chunk_pages, max_logprobs, stages).
        num_microbatches: pipeline micro-batches per step (0: no pipeline parallelism).
        enforce_eager: compile each bucket when a step first needs it, not at warm-up.
    """

    def __init__(
        self,
        builder: BatchBuilder,
        plan: ShardingPlan,
        static: dict[str, Any],
        num_microbatches: int,
        enforce_eager: bool = False,
    ):
        self.builder = builder
        self.plan = plan
        self.static = static
        self.num_microbatches = num_microbatches
        self.enforce_eager = enforce_eager
        self.executables: dict[int, Any] = {}
        self._jit = jax.jit(
            step_fn.step,
            static_argnames=STATIC_ARGNAMES,
            donate_argnames=("kv_cache", "sampling_state"),
        )
        self.bucket_of = {self.layout_key(T): T for T in builder.buckets}

    def layout_key(self, T: int) -> int:
        """The packed layout's token count of bucket T (the key `execute` looks up)."""
        M = self.num_microbatches
        return self.builder.microbatch_layout(T, M).num_tokens if M else T

    def layout(self, T: int):
        """Bucket T's packed layout (per micro-batch under pipeline parallelism)."""
        M = self.num_microbatches
        return self.builder.microbatch_layout(T, M) if M else self.builder.layout(T)

    def bitmask_shape(self, layout) -> tuple[int, int]:
        """[sampler rows, ceil(V / 32)]: the step's structured-output bitmask."""
        rows = layout.num_rows * max(1, self.num_microbatches)
        return rows, (self.static["cfg"].vocab_size + 31) // 32

    def lower(self, T: int, params, kv_cache, sampling_state):
        """Bucket T's step lowered for arrays (or `ShapeDtypeStruct`s) like these."""
        M = self.num_microbatches
        layout = self.layout(T)
        shape = (M, layout.size) if M else (layout.size,)
        rep = self.plan.replicated()
        packed = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
        bitmask = jax.ShapeDtypeStruct(self.bitmask_shape(layout), jnp.int32, sharding=rep)
        expert_parallel = getattr(self.static["cfg"], "expert_parallel", False)
        return self._jit.lower(
            params,
            abstract(kv_cache),
            sampling_state,
            packed,
            bitmask,
            layout=layout,
            mesh=self.plan.mesh if M or expert_parallel else None,
            num_microbatches=M,
            sample_block_rows=sample_block_rows(self.plan.mesh),
            **self.static,
        )

    def compile(self, T: int, params, kv_cache, sampling_state) -> Any:
        """Compiles bucket T's step and keeps it."""
        exe = self.lower(T, params, kv_cache, sampling_state).compile()
        self.executables[self.layout_key(T)] = exe
        return exe

    def get(self, key: int, params, kv_cache, sampling_state) -> Any:
        """The executable of layout token count `key`; under `enforce_eager`, compiled now
        if this is the bucket's first step.

        Raises:
            RuntimeError: no bucket has that layout, or (without `enforce_eager`) its
                executable was not compiled at warm-up.
        """
        exe = self.executables.get(key)
        if exe is not None:
            return exe
        if not self.enforce_eager or key not in self.bucket_of:
            raise RuntimeError(f"no compiled step for {key} tokens; warm up first")
        t0 = time.perf_counter()
        exe = self.compile(self.bucket_of[key], params, kv_cache, sampling_state)
        logger.info(
            "compiled the %d-token step bucket at its first step (enforce_eager) in %.1f s",
            self.bucket_of[key],
            time.perf_counter() - t0,
        )
        return exe
