"""distributed_executor_backend="ray": the engine's processes as Ray actors.

Two layouts, behind the `LLMEngine` interface that `LLM` uses:

- one model over several processes (num_processes > 1): one actor per process, placed by
  Ray; actor 0 opens the `jax.distributed` coordinator on a free port of its node, every actor
  runs the same engine (JAX's multi-controller model), and the driver sends each call to all
  actors and returns actor 0's outputs;
- data-parallel replicas (data_parallel_size > 1): one actor per replica, each an engine of
  its own; a new request goes to the replica with the fewest unfinished requests.

The driver joins a running Ray cluster (`ray.init(address="auto")`) when there is one, and
otherwise starts a local Ray instance. Ray is an optional dependency (`pip install ray`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from pagedjax.engine_args import EngineArgs


class _Worker:
    """The body of an actor: an engine built from EngineArgs in the actor's process."""

    def node_address(self) -> str:
        """host:port of a free port on this actor's node (for the coordinator)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from pagedjax.engine.dp_engine import create_local_engine

        config = EngineArgs.from_kwargs(**kwargs).create_engine_config()
        self.engine = create_local_engine(config, use_tqdm=False)
        eng = self.engine
        return {
            "layout": eng.layout,
            "eos_token_id": eng.eos_token_id,
            "config": eng.config,
            "tokenizer": eng.tokenizer,
        }

    def call(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)


class RayEngine:
    """The `LLMEngine` interface over Ray actors (see the module docstring).

    Raises:
        ImportError: Ray is not installed.
        ValueError: neither num_processes nor data_parallel_size is above 1.
    """

    def __init__(self, args: EngineArgs):
        import ray

        if args.num_processes <= 1 and args.data_parallel_size <= 1:
            raise ValueError(
                "distributed_executor_backend='ray' needs num_processes > 1 or "
                "data_parallel_size > 1"
            )
        if not ray.is_initialized():
            try:
                ray.init(address="auto")
            except ConnectionError:  # no running cluster: a local instance
                ray.init()
        self._ray = ray
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        kwargs["distributed_executor_backend"] = None
        self.spmd = args.num_processes > 1
        count = args.num_processes if self.spmd else args.data_parallel_size
        actor = ray.remote(num_cpus=0)(_Worker)
        self.actors = [actor.remote() for _ in range(count)]
        if self.spmd:
            address = args.coordinator_address or ray.get(self.actors[0].node_address.remote())
            per_actor = [
                dict(kwargs, coordinator_address=address, process_id=i) for i in range(count)
            ]
        else:
            per_actor = [dict(kwargs, data_parallel_size=1)] * count
        infos = ray.get([a.start.remote(k) for a, k in zip(self.actors, per_actor, strict=True)])
        self.layout = {"actors": [i["layout"] for i in infos]}
        self.eos_token_id = infos[0]["eos_token_id"]
        self.config = infos[0]["config"]
        self.tokenizer = infos[0]["tokenizer"]
        self._owner: dict[str, int] = {}
        self._unfinished = [0] * count

    # -- the LLMEngine interface --------------------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    def _all(self, method: str, *args):
        return self._ray.get([a.call.remote(method, *args) for a in self.actors])

    def reset_prefix_cache(self) -> bool:
        """Resets every actor's prefix cache; True if all of them did."""
        return all(self._all("reset_prefix_cache"))

    def prompt_token_ids(self, prompt) -> list[int]:
        return self._ray.get(self.actors[0].call.remote("prompt_token_ids", prompt))

    def add_request(
        self,
        request_id: str,
        prompt,
        params=None,
        arrival_time=None,
        priority: int = 0,
        check_max_tokens: bool = False,
    ) -> None:
        """Queues a request on every actor (one model over processes) or on the least loaded
        replica's actor (see `LLMEngine.add_request`, whose errors it raises)."""
        args = (request_id, prompt, params, arrival_time, priority)
        kw = {"check_max_tokens": check_max_tokens}
        if self.spmd:
            self._ray.get([a.call.remote("add_request", *args, **kw) for a in self.actors])
            return
        i = min(range(len(self.actors)), key=lambda j: self._unfinished[j])
        self._ray.get(self.actors[i].call.remote("add_request", *args, **kw))
        self._owner[request_id] = i
        self._unfinished[i] += 1

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self.spmd:
            self._all("abort_request", ids)
            return
        for rid in ids:
            i = self._owner.pop(rid, None)
            if i is not None:
                self._ray.get(self.actors[i].call.remote("abort_request", rid))
                self._unfinished[i] -= 1

    def has_unfinished_requests(self) -> bool:
        if self.spmd:
            return self._ray.get(self.actors[0].call.remote("has_unfinished_requests"))
        return any(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        if self.spmd:
            return self._ray.get(self.actors[0].call.remote("get_num_unfinished_requests"))
        return sum(self._unfinished)

    def step(self):
        if self.spmd:
            return self._all("step")[0]
        busy = [i for i, n in enumerate(self._unfinished) if n]
        outputs = []
        for outs in self._ray.get([self.actors[i].call.remote("step") for i in busy]):
            outputs.extend(outs)
        for out in outputs:
            if out.finished and out.request_id in self._owner:
                self._unfinished[self._owner.pop(out.request_id)] -= 1
        return outputs

    def shutdown(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []
