"""Structured outputs: constrained decoding with llguidance (vLLM's `guidance` backend).

    grammar.py   a `StructuredOutputsParams` -> llguidance grammar text; synchronous validation
                 (what the engine refuses with InvalidInputError(param="structured_outputs"))
    manager.py   `StructuredOutputManager`: the tokenizer adapter, grammar compilation on a
                 worker thread pool with a cache keyed by the constraint, and each step's token
                 bitmask of the constrained rows
    request.py   `StructuredOutputRequest`: one sequence's matcher (its grammar's parse state),
                 advanced by the scheduler with every sampled token

Host side only (numpy and llguidance, no jax): the scheduler owns the matchers and fills the
bitmask [rows, ceil(vocab / 32)] int32 that goes to the runner in `SchedulerOutput`; the jitted
sampler masks disallowed tokens (`ops.bitmask`).
"""

from pagedjax.structured_output.grammar import grammar_text, validate_structured_outputs
from pagedjax.structured_output.manager import StructuredOutputManager
from pagedjax.structured_output.request import StructuredOutputRequest

__all__ = [
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "grammar_text",
    "validate_structured_outputs",
]
