"""The model runner's compiled side operations: KV block copies, and swaps between the device
cache and the host pool (preemption by swapping, copy-on-write of shared blocks), and the
fills of sampling-state rows (penalty counts, logit bias) of requests entering the batch.

Each operation is compiled once for a fixed group size: `BLOCK_OP_BATCH` blocks, or
`STATE_INIT_ROWS` rows of `STATE_INIT_TOKENS` tokens; a short group is padded with the null
block (block 0, never read) or the scratch sampling-state slot, so that no step compiles
anything after warm-up.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.interface import SchedulerOutput
from pagedjax.executor import step as step_fn
from pagedjax.executor.request_state import RequestState
from pagedjax.executor.step_executables import abstract
from pagedjax.ops.kv_cache import KVCache
from pagedjax.ops.sampling import init_state_rows, set_bias_rows
from pagedjax.sharding.rules import ShardingPlan

BLOCK_OP_BATCH = 16  # block copies / swaps run in padded groups of this many blocks
STATE_INIT_ROWS = 8  # sampling-state rows filled per call
STATE_INIT_TOKENS = 256  # tokens per row and call when filling sampling-state rows

OP_NAMES = ("copy", "gather", "scatter", "init_rows", "bias_rows")


class RunnerOps:
    """The compiled block and sampling-state operations of one runner.

    Args:
        plan: the runner's sharding plan (every operand is replicated).
        vocab_size: the model's vocabulary (width of a logit-bias row).
        scratch_slot: the sampling-state slot that padding rows write to.
    """

    def __init__(self, plan: ShardingPlan, vocab_size: int, scratch_slot: int):
        self.plan = plan
        self.vocab_size = vocab_size
        self.scratch_slot = scratch_slot
        self._compiled: dict[str, Any] = {}

    def compiled(self, name: str, kv_cache: KVCache | None, sampling_state: Any):
        """The compiled operation `name` (one of `OP_NAMES`), compiled on first use for the
        shapes of `kv_cache` (the block operations "copy" / "gather" / "scatter" of
        BLOCK_OP_BATCH blocks) or `sampling_state` ("init_rows" / "bias_rows" of
        STATE_INIT_ROWS rows).

        Raises:
            KeyError: an unknown name.
        """
        op = self._compiled.get(name)
        if op is not None:
            return op
        rep = self.plan.replicated()

        def spec(shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        kv_spec = abstract(kv_cache) if name in ("copy", "gather", "scatter") else None
        ids = spec((BLOCK_OP_BATCH,))
        R, C, V = STATE_INIT_ROWS, STATE_INIT_TOKENS, self.vocab_size
        if name == "copy":
            lowered = jax.jit(step_fn.copy_blocks, donate_argnums=0).lower(kv_spec, ids, ids)
        elif name == "gather":
            lowered = jax.jit(step_fn.gather_blocks).lower(kv_spec, ids)
        elif name == "scatter":
            out = jax.jit(step_fn.gather_blocks).eval_shape(kv_spec, ids)
            scatter = jax.jit(step_fn.scatter_blocks, donate_argnums=0)
            lowered = scatter.lower(kv_spec, ids, spec(out.shape, out.dtype))
        elif name == "init_rows":
            lowered = jax.jit(init_state_rows, donate_argnums=0).lower(
                sampling_state, spec((R,)), spec((R,), jnp.bool_), spec((R, C)), spec((R, C))
            )
        elif name == "bias_rows":
            lowered = jax.jit(set_bias_rows, donate_argnums=0).lower(
                sampling_state, spec((R,)), spec((R, V), jnp.float32)
            )
        else:
            raise KeyError(name)
        op = self._compiled[name] = lowered.compile()
        return op

    def apply_block_ops(
        self, so: SchedulerOutput, kv_cache: KVCache, host_cache: np.ndarray | None, draft=None
    ) -> KVCache:
        """The step's swap-outs (device -> `host_cache`), then swap-ins, then copies (also
        in the draft model's cache, `draft.copy_blocks`); each reads the blocks as they were
        before the step. Returns the new device cache (the old one is donated)."""
        B = BLOCK_OP_BATCH
        for i in range(0, len(so.blocks_to_swap_out), B):
            pairs = so.blocks_to_swap_out[i : i + B]
            ids = np.zeros(B, np.int32)
            ids[: len(pairs)] = [d for d, _ in pairs]
            data = np.asarray(self.compiled("gather", kv_cache, None)(kv_cache, ids))
            host_cache[:, :, [h for _, h in pairs]] = data[:, :, : len(pairs)]
        for i in range(0, len(so.blocks_to_swap_in), B):
            pairs = so.blocks_to_swap_in[i : i + B]
            ids = np.zeros(B, np.int32)
            ids[: len(pairs)] = [d for _, d in pairs]
            data = np.zeros(host_cache.shape[:2] + (B,) + host_cache.shape[3:], host_cache.dtype)
            data[:, :, : len(pairs)] = host_cache[:, :, [h for h, _ in pairs]]
            kv_cache = self.compiled("scatter", kv_cache, None)(kv_cache, ids, data)
        for i in range(0, len(so.blocks_to_copy), B):
            pairs = so.blocks_to_copy[i : i + B]
            src, dst = np.zeros(B, np.int32), np.zeros(B, np.int32)
            src[: len(pairs)] = [a for a, _ in pairs]
            dst[: len(pairs)] = [b for _, b in pairs]
            kv_cache = self.compiled("copy", kv_cache, None)(kv_cache, src, dst)
            if draft is not None:
                draft.copy_blocks(src, dst)
        return kv_cache

    def init_state_rows(
        self, sampling_state: Any, states: list[tuple[RequestState, tuple[int, ...]]]
    ) -> Any:
        """Fills the penalty rows (prompt mask, output counts) of requests entering the batch
        from every token each knows (`states`: (request state, token ids) pairs). Returns the
        new sampling state (the old one is donated)."""
        R, C = STATE_INIT_ROWS, STATE_INIT_TOKENS
        op = self.compiled("init_rows", None, sampling_state)
        for i in range(0, len(states), R):
            group = states[i : i + R]
            longest = max(len(ids) for _, ids in group)
            for c0 in range(0, longest, C):
                slots = np.full(R, self.scratch_slot, np.int32)
                reset = np.zeros(R, bool)
                tokens = np.zeros((R, C), np.int32)
                kinds = np.zeros((R, C), np.int32)
                for j, (st, ids) in enumerate(group):
                    slots[j], reset[j] = st.slot, c0 == 0
                    n = max(0, min(C, len(ids) - c0))
                    tokens[j, :n] = ids[c0 : c0 + n]
                    pos = np.arange(c0, c0 + n)
                    kinds[j, :n] = np.where(pos < st.spec.num_prompt_tokens, 1, 2)
                sampling_state = op(sampling_state, slots, reset, tokens, kinds)
        return sampling_state

    def set_bias_rows(self, sampling_state: Any, biases: list[tuple[int, np.ndarray]]) -> Any:
        """Writes logit-bias rows (`biases`: (slot, float32 [vocab_size] row) pairs). Returns
        the new sampling state (the old one is donated)."""
        R = STATE_INIT_ROWS
        op = self.compiled("bias_rows", None, sampling_state)
        for i in range(0, len(biases), R):
            group = biases[i : i + R]
            slots = np.full(R, self.scratch_slot, np.int32)
            rows = np.zeros((R, self.vocab_size), np.float32)
            for j, (slot, bias) in enumerate(group):
                slots[j], rows[j] = slot, bias
            sampling_state = op(sampling_state, slots, rows)
        return sampling_state
