"""Mixtral (`MixtralForCausalLM`): Mistral's decoder with a routed mixture of experts for
its MLP (`models.moe`).

As transformers' `MixtralSparseMoeBlock`: `num_local_experts` experts of `intermediate_size`
each, `num_experts_per_tok` (top-2) of them per token, their softmax weights renormalised
over the chosen k (the same as a softmax of the top-k logits); every layer is sparse;
Mistral's sliding window when the config has one. `router_jitter_noise` is training-only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedjax.models.layers import compute_logits as compute_logits
from pagedjax.models.layers import decoder_forward
from pagedjax.models.moe import MoeArchConfig
from pagedjax.models.moe import absent_layer_params as absent_layer_params
from pagedjax.models.moe import decoder_layers as decoder_layers
from pagedjax.models.moe import final_norm as final_norm
from pagedjax.models.moe import logical_unit_counts as logical_unit_counts
from pagedjax.models.moe import param_logical_axes as param_logical_axes
from pagedjax.models.moe import param_shapes as param_shapes

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM",)


@dataclasses.dataclass(frozen=True)
class MixtralArchConfig(MoeArchConfig):
    """A Mixtral checkpoint's hyper-parameters (`moe.MoeArchConfig`)."""

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {"mixtral": "MixtralForCausalLM"}

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        fields = super()._hf_fields(d, arch)
        fields.update(
            num_experts=d.get("num_local_experts") or 8,
            num_experts_per_tok=d.get("num_experts_per_tok") or 2,
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
        )
        return fields

    def hf_config_extras(self) -> dict[str, Any]:
        return {
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
        }


ArchConfig = MixtralArchConfig  # the name `models.registry` expects of every model module
forward = decoder_forward(decoder_layers, final_norm)  # the registry's entry point
