"""Which model module runs a checkpoint: Hugging Face architecture name -> model module.

A model module is a file of pure functions over a params pytree with the same entry points
as `models.llama`: its architecture config class (`ArchConfig`, with `from_hf_config`),
`param_shapes`, `param_logical_axes`, `logical_unit_counts`, `forward`, `decoder_layers`,
`final_norm` and `compute_logits`. The engine, the step function and the pipeline look a
model up here by `arch.architecture` and never name a model module themselves.
"""

from __future__ import annotations

from types import ModuleType

from pagedjax.models import llama

_MODELS: dict[str, ModuleType] = {name: llama for name in llama.SUPPORTED_ARCHITECTURES}


def supported_architectures() -> tuple[str, ...]:
    """The Hugging Face `architectures` names the engine runs."""
    return tuple(_MODELS)


def get_model(architecture: str) -> ModuleType:
    """The model module that runs `architecture` (e.g. "LlamaForCausalLM").

    Raises:
        ValueError: the architecture is not registered (the message names it and lists the
            supported ones).
    """
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None
