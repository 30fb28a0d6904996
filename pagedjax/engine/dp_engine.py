"""Data parallelism: replicas of the engine, each with its own scheduler, KV cache and slice
of the devices, behind the `LLMEngine` interface.

A new request goes to the replica with the fewest unfinished requests; a step steps every
replica that has work, in threads, so that replicas on different devices compute at the same
time (JAX releases the GIL while a step runs).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable

import jax

from pagedjax.config import EngineConfig
from pagedjax.engine.engine import LLMEngine
from pagedjax.outputs import RequestOutput
from pagedjax.sharding.mesh import device_grid


class DataParallelEngine:
    """`data_parallel_size` LLMEngine replicas, each on a [pipeline, tensor] slice of devices."""

    def __init__(self, config: EngineConfig, use_tqdm: bool = True, devices=None):
        pc = config.parallel_config
        grid = device_grid(
            jax.devices() if devices is None else devices,
            pc.data_parallel_size,
            pc.pipeline_parallel_size,
            pc.tensor_parallel_size,
        )
        self.config = config
        self.replicas = [LLMEngine(config, use_tqdm, devices=grid[i]) for i in range(len(grid))]
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.eos_token_id = first.eos_token_id
        self.compile_seconds = sum(r.compile_seconds for r in self.replicas)
        self.layout = {"replicas": [r.layout for r in self.replicas]}
        self._owner: dict[str, LLMEngine] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas))

    def get_tokenizer(self):
        return self.tokenizer

    def prompt_token_ids(self, prompt) -> list[int]:
        return self.replicas[0].prompt_token_ids(prompt)

    def add_request(
        self,
        request_id: str,
        prompt,
        params=None,
        arrival_time=None,
        priority: int = 0,
        check_max_tokens: bool = False,
    ) -> None:
        """Queues a request on the least loaded replica (see `LLMEngine.add_request`, whose
        arguments and errors these are; a duplicate id raises ValueError)."""
        replica = self._replica_for(request_id)
        replica.add_request(
            request_id, prompt, params, arrival_time, priority, check_max_tokens=check_max_tokens
        )
        self._owner[request_id] = replica

    def add_processed(self, request_id: str, inp, arrival_time=None, priority: int = 0) -> None:
        """`LLMEngine.add_processed` on the least loaded replica (the replicas share one
        model, so one `InputProcessor` serves them all)."""
        replica = self._replica_for(request_id)
        replica.add_processed(request_id, inp, arrival_time, priority)
        self._owner[request_id] = replica

    def _replica_for(self, request_id: str) -> LLMEngine:
        """The least loaded replica, for a new request id (ValueError if it is in use)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        return min(self.replicas, key=lambda r: r.get_num_unfinished_requests())

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """As `LLMEngine.abort_request`, on the replica that holds each request."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            replica = self._owner.pop(rid, None)
            if replica is not None:
                outputs += replica.abort_request(rid)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Resets every replica's prefix cache; True if all of them did."""
        return all([r.reset_prefix_cache() for r in self.replicas])

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outputs: list[RequestOutput] = []
        for outs in self._pool.map(lambda r: r.step(), busy):
            outputs.extend(outs)
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs


def create_local_engine(
    config: EngineConfig, use_tqdm: bool = True
) -> LLMEngine | DataParallelEngine:
    """The engine of one process: data_parallel_size replicas (`DataParallelEngine`), or one
    `LLMEngine`."""
    if config.parallel_config.data_parallel_size > 1:
        return DataParallelEngine(config, use_tqdm)
    return LLMEngine(config, use_tqdm)
