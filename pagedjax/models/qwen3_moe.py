"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's decoder (per-head q/k norms) with a routed
mixture of experts for the MLP of its sparse layers (`models.moe`).

As transformers' `Qwen3MoeSparseMoeBlock`: `num_experts` experts of `moe_intermediate_size`,
softmax over the router logits, then the top `num_experts_per_tok`, renormalised only with
`norm_topk_prob`. Layer i is sparse when it is not in `mlp_only_layers` and
(i + 1) % `decoder_sparse_step` == 0; the other layers run a dense MLP of
`intermediate_size`. The sliding window as Qwen3's (`use_sliding_window`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedjax.models.arch_config import qwen_sliding_fields
from pagedjax.models.layers import compute_logits as compute_logits
from pagedjax.models.layers import decoder_forward
from pagedjax.models.moe import MoeArchConfig
from pagedjax.models.moe import absent_layer_params as absent_layer_params
from pagedjax.models.moe import decoder_layers as decoder_layers
from pagedjax.models.moe import final_norm as final_norm
from pagedjax.models.moe import logical_unit_counts as logical_unit_counts
from pagedjax.models.moe import param_logical_axes as param_logical_axes
from pagedjax.models.moe import param_shapes as param_shapes

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeArchConfig(MoeArchConfig):
    """A Qwen3-MoE checkpoint's hyper-parameters (`moe.MoeArchConfig`, with q/k norms)."""

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        fields = super()._hf_fields(d, arch)
        fields.update(qwen_sliding_fields(d, fields))
        E = d.get("num_experts") or d.get("num_local_experts") or 0
        if E < 1:
            raise ValueError("config.json's num_experts must be >= 1 for Qwen3MoeForCausalLM")
        step = d.get("decoder_sparse_step") or 1
        dense = set(d.get("mlp_only_layers") or ())
        L = fields["num_hidden_layers"]
        sparse = tuple(i for i in range(L) if i not in dense and (i + 1) % step == 0)
        fields.update(
            num_experts=E,
            num_experts_per_tok=d.get("num_experts_per_tok") or 8,
            moe_intermediate_size=d.get("moe_intermediate_size") or fields["intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            sparse_layers=None if len(sparse) == L else sparse,
            qk_norm=True,
        )
        return fields

    def hf_config_extras(self) -> dict[str, Any]:
        L = range(self.num_hidden_layers)
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in L if not self.is_sparse(i)],
        }


ArchConfig = Qwen3MoeArchConfig  # the name `models.registry` expects of every model module
forward = decoder_forward(decoder_layers, final_norm)  # the registry's entry point
