"""Which model module runs a checkpoint: Hugging Face architecture name -> model module.

A model module is a file of pure functions over a params pytree with the same entry points
as `models.llama`: its architecture config class (`ArchConfig`, a
`arch_config.DecoderArchConfig` with `from_hf_config`), `param_shapes`,
`param_logical_axes`, `logical_unit_counts`, `forward`, `decoder_layers`, `final_norm` and
`compute_logits`. The engine, the step function and the pipeline look a model up here by
`arch.architecture` and never name a model module themselves; the loader reads a config.json
through `arch_config_from_hf`, which picks the family from its `architectures[0]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from pagedjax.models import gemma, llama, mixtral, phi3, qwen3, qwen3_moe
from pagedjax.models.arch_config import DecoderArchConfig, architecture_name, hf_dict

_MODULES = (llama, qwen3, phi3, gemma, mixtral, qwen3_moe)
_MODELS: dict[str, ModuleType] = {
    name: module for module in _MODULES for name in module.SUPPORTED_ARCHITECTURES
}
# Architectures a family module names but does not run -> why (a module's optional
# REFUSED_ARCHITECTURES), so that the error says more than "not supported".
_REFUSED: dict[str, str] = {
    name: why
    for module in _MODULES
    for name, why in getattr(module, "REFUSED_ARCHITECTURES", {}).items()
}
# config.json `model_type` -> architecture, for configs without `architectures`.
_MODEL_TYPES: dict[str, str] = {
    model_type: arch
    for module in _MODULES
    for model_type, arch in module.ArchConfig.MODEL_TYPES.items()
}


def supported_architectures() -> tuple[str, ...]:
    """The Hugging Face `architectures` names the engine runs."""
    return tuple(_MODELS)


def get_model(architecture: str) -> ModuleType:
    """The model module that runs `architecture` (e.g. "LlamaForCausalLM").

    Raises:
        ValueError: the architecture is not registered (the message names it and lists the
            supported ones), or is one a family refuses (named, with the reason).
    """
    if architecture in _REFUSED:
        why = _REFUSED[architecture]
        raise ValueError(f"architecture {architecture!r} is not supported: {why}")
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None


def arch_config_from_hf(hf: Mapping[str, Any] | Any) -> DecoderArchConfig:
    """The architecture of a Hugging Face config (config.json's dict or a
    `PretrainedConfig`), read by the config class of the family its `architectures[0]` (else
    its `model_type`) names.

    Raises:
        ValueError: an unregistered architecture (named), a malformed config, or a feature
            the family does not support (named).
    """
    d = hf_dict(hf)
    arch = architecture_name(d, _MODEL_TYPES)
    if not arch:
        raise ValueError(
            f"config.json names no architecture (`architectures`) and its model_type "
            f"{d.get('model_type')!r} is not supported; supported: {', '.join(_MODELS)}"
        )
    return get_model(arch).ArchConfig.from_hf_config(d)
