"""The one place that picks the engine behind the `LLMEngine` interface.

    distributed_executor_backend="ray"  -> RayEngine (actors; EngineArgs only)
    data_parallel_size > 1              -> DataParallelEngine (replicas in this process)
    otherwise                           -> LLMEngine

`LLM` and `AsyncLLM` (the server) build their engine here; the Ray actors build theirs, in
their own processes, with the in-process choice (`dp_engine.create_local_engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax.config import EngineConfig
from pagedjax.engine_args import EngineArgs

if TYPE_CHECKING:
    from pagedjax.engine.dp_engine import DataParallelEngine
    from pagedjax.engine.engine import LLMEngine
    from pagedjax.engine.ray_engine import RayEngine

    AnyEngine = LLMEngine | DataParallelEngine | RayEngine


def create_engine(args: EngineArgs | EngineConfig, use_tqdm: bool = True) -> AnyEngine:
    """Builds the engine the arguments ask for (see the module docstring).

    Args:
        args: EngineArgs, or an already validated EngineConfig (which cannot ask for Ray:
            the Ray engine starts its actors from EngineArgs).
        use_tqdm: show the warm-up progress bar (in-process engines).

    Returns:
        An LLMEngine, a DataParallelEngine or a RayEngine; each has `add_request`, `step`,
        `abort_request`, `has_unfinished_requests`, `config`, `tokenizer`, `eos_token_id`.

    Raises:
        ValueError: an invalid engine argument (named), the Ray backend asked through an
            EngineConfig, or "ray" with neither num_processes nor data_parallel_size above 1.
        ImportError: the "ray" backend without Ray installed.
    """
    if isinstance(args, EngineArgs):
        if args.distributed_executor_backend == "ray":
            from pagedjax.engine.ray_engine import RayEngine

            return RayEngine(args)
        config = args.create_engine_config()
    else:
        config = args
        if config.parallel_config.distributed_executor_backend == "ray":
            raise ValueError("the Ray engine is built from EngineArgs, not from an EngineConfig")
    from pagedjax.engine.dp_engine import create_local_engine

    return create_local_engine(config, use_tqdm)
