"""Phi-3 (Microsoft's Phi-3 / Phi-4 dense models, `Phi3ForCausalLM`): a Llama variant.

transformers' Phi3 is Llama's pre-norm decoder with SwiGLU MLP, RMSNorm and no q/k/v bias;
what differs is the checkpoint, whose q/k/v projections are one fused `qkv_proj` ([N*H +
2*K*H, D], q rows first, then k, then v) and whose MLP has one fused `gate_up_proj` ([2F, D],
gate rows first). The loader splits both into the usual q/k/v and gate/up weights
(`hf_checkpoint.assign_hf`), so the params pytree, the sharding, quantization and the CPU
kernels are `models.llama`'s, and so is every function here.

Not supported (refused with a ValueError naming it): LongRoPE (`rope_scaling` type
"longrope", or its older names "su" / "yarn": the 128k-context checkpoints) and a
`partial_rotary_factor` other than 1 (Phi-4-mini).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedjax.models.arch_config import DecoderArchConfig, hf_rope_dict
from pagedjax.models.llama import compute_logits as compute_logits
from pagedjax.models.llama import decoder_layers as decoder_layers
from pagedjax.models.llama import final_norm as final_norm
from pagedjax.models.llama import forward as forward
from pagedjax.models.llama import logical_unit_counts as logical_unit_counts
from pagedjax.models.llama import param_logical_axes as param_logical_axes
from pagedjax.models.llama import param_shapes as param_shapes

SUPPORTED_ARCHITECTURES = ("Phi3ForCausalLM",)
_LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers maps Phi-3's "su" / "yarn" here


@dataclasses.dataclass(frozen=True)
class Phi3ArchConfig(DecoderArchConfig):
    """A Phi-3 checkpoint's hyper-parameters (`DecoderArchConfig`): no attention bias; plain
    RoPE only."""

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {"phi3": "Phi3ForCausalLM"}

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        rope_type = hf_rope_dict(d)["rope_type"]
        if rope_type in _LONGROPE_NAMES:
            raise ValueError(
                f"Phi-3 LongRoPE (rope_scaling type {rope_type!r}, the long-context "
                "checkpoints) is not supported; only plain RoPE (no rope_scaling)"
            )
        fields = super()._hf_fields(d, arch)
        fields["attention_bias"] = fields["o_proj_bias"] = False
        return fields


ArchConfig = Phi3ArchConfig  # the name `models.registry` expects of every model module
