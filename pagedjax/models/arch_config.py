"""The hyper-parameters every decoder family shares, and their reading from config.json.

`DecoderArchConfig` holds what the engine, the loader and the shared layers
(`models.layers`) read of an architecture: sizes, RoPE, norms, special tokens. Each family
module subclasses it as its `ArchConfig` (`llama.LlamaArchConfig`, `qwen3.Qwen3ArchConfig`,
...), naming the Hugging Face architectures it runs and reading what is particular to it
(`_hf_fields`); `models.registry.arch_config_from_hf` picks the family from config.json's
`architectures[0]`. Jax-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Hugging Face `hidden_act` names the gated MLP runs (`layers.gated_mlp`).
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class DecoderArchConfig:
    """Hyper-parameters of a decoder-only checkpoint (a subset of Hugging Face's config.json).

    Attributes:
        architecture: the Hugging Face class name, e.g. "LlamaForCausalLM".
        vocab_size: V.  hidden_size: D.  intermediate_size: F.
        num_hidden_layers: L.  num_attention_heads: N.  num_key_value_heads: K.
        head_dim: H (config's `head_dim`, else D // N).
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: None, or a dict (as sorted items) with "rope_type" in
            `SUPPORTED_ROPE_TYPES` and that type's parameters (Hugging Face's names).
        tie_word_embeddings: the LM head is the transposed embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2; Llama and Qwen3 if the
            config's `attention_bias` says so).
        o_proj_bias: the output projection has a bias (Llama and Qwen3 with
            `attention_bias`; not Qwen2).
        max_position_embeddings: the longest context the checkpoint was trained for.
        bos_token_id, eos_token_ids: special tokens from the config (eos may be several).
        sliding_window: the attention window (tokens, the query's own included) of
            sliding-window layers, or None.
        sliding_layers: the indices of the layers that use `sliding_window` (Hugging Face's
            `layer_types`); None: every layer, when there is a window.
        hidden_act: the gated MLP's activation (Hugging Face's name).
        final_logit_softcap: logits = cap * tanh(logits / cap) after the LM head
            (`layers.compute_logits`), or None (Gemma 2/3's `final_logit_softcapping`).
    """

    # The Hugging Face architectures a subclass runs, and config.json `model_type`s that
    # name one of them when `architectures` is absent.
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    MODEL_TYPES: ClassVar[Mapping[str, str]] = {}

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"
    final_logit_softcap: float | None = None

    def __post_init__(self):
        if self.architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported by "
                f"{type(self).__name__}; supported: {', '.join(self.ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )

    def hf_config_extras(self) -> dict[str, Any]:
        """What a family writes into config.json beyond `hf_format.hf_config_dict`'s shared
        fields (and in place of them), so that the family's reader reads the same config
        back; none here."""
        return {}

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def layer_windows(self) -> tuple[int, ...]:
        """The attention window of each of the L layers (0: full causal attention)."""
        L, w = self.num_hidden_layers, self.sliding_window or 0
        if not w or self.sliding_layers is None:
            return (w,) * L
        sliding = set(self.sliding_layers)
        return tuple(w if i in sliding else 0 for i in range(L))

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any) -> DecoderArchConfig:
        """Builds the config from a Hugging Face config (a `PretrainedConfig` or its dict).

        Raises:
            ValueError: the architecture is not one this class runs (the message names it),
                a required field is missing, or a feature is not supported (named).
        """
        d = hf_dict(hf)
        arch = architecture_name(d, cls.MODEL_TYPES)
        if arch not in cls.ARCHITECTURES:
            raise ValueError(
                f"architecture {arch or d.get('model_type')!r} is not supported by "
                f"{cls.__name__}; supported: {', '.join(cls.ARCHITECTURES)}"
            )
        return cls(**cls._hf_fields(d, arch))

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        """The constructor's arguments read from config dict `d`; a family overrides it to
        read (or refuse) what is particular to it."""
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if d.get(key) is None:
                raise ValueError(f"config.json lacks the required field {key!r}")
        theta, scaling = hf_rope(d)
        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        )
        num_heads = d["num_attention_heads"]
        return dict(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias")),
            o_proj_bias=bool(d.get("attention_bias")),
            sliding_window=d.get("sliding_window") or None,
            sliding_layers=_sliding_layers(d.get("layer_types"))
            if d.get("sliding_window")
            else None,
            max_position_embeddings=d.get("max_position_embeddings") or 2048,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=d.get("hidden_act") or "silu",
        )


def _sliding_layers(layer_types) -> tuple[int, ...] | None:
    """The sliding-window layers named by Hugging Face's `layer_types`, if the config has it."""
    if not layer_types:
        return None
    return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


def qwen_sliding_fields(d: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 / Qwen3: a window only with `use_sliding_window`, on the layers from
    `max_window_layers` on (transformers' rule, unless the config lists `layer_types`)."""
    if not d.get("use_sliding_window") or not fields["sliding_window"]:
        return {"sliding_window": None, "sliding_layers": None}
    if fields["sliding_layers"] is None:
        L = fields["num_hidden_layers"]
        start = d.get("max_window_layers")
        start = L if start is None else start
        fields["sliding_layers"] = tuple(range(min(start, L), L))
    if not fields["sliding_layers"]:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_layers": fields["sliding_layers"]}


def hf_dict(hf: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A Hugging Face config (a `PretrainedConfig` or its dict) as a plain dict."""
    return hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)


def architecture_name(d: Mapping[str, Any], model_types: Mapping[str, str]) -> str:
    """config.json's `architectures[0]`, else the architecture its `model_type` names in
    `model_types`, else ""."""
    archs = d.get("architectures") or []
    return archs[0] if archs else model_types.get(d.get("model_type") or "", "")


def hf_rope_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config dict: transformers 5 keeps theta and scaling in
    `rope_parameters`, 4.x in `rope_theta` and `rope_scaling`; "type" is 4.x's "rope_type"."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    return rope


def hf_rope(d: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling as sorted items or None for plain RoPE) of a config dict.

    Raises:
        ValueError: a partial rotary factor other than 1 (RoPE on part of each head).
    """
    rope = hf_rope_dict(d)
    theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    partial = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported; "
            "only 1.0"
        )
    scaling = None if rope["rope_type"] == "default" else tuple(sorted(rope.items()))
    return float(theta), scaling
