"""Llama-family decoder as pure functions of a params pytree (Llama 2/3, SmolLM, Mistral, Qwen2).

The model reads and writes the paged KV cache through `ops.attention`; it never sees a
request, a block manager or a batch size other than the flat token count.

Dimension legend (used in every shape comment and einsum string of this file):
    T  tokens in the flat, ragged step batch        S  sequences in the step
    D  hidden size (d_model)                        F  MLP intermediate size
    N  query heads          K  KV heads             G  query heads per KV head (N // K)
    H  head dim             V  vocabulary size      L  layers (the stacked leading axis)

Params pytree (every layer weight is stacked on a leading L axis and run by `jax.lax.scan`):
    embed_tokens       [V, D]
    layers/input_norm  [L, D]           layers/post_attn_norm [L, D]
    layers/q_proj      [L, D, N*H]      layers/q_bias         [L, N*H]   (Qwen2 only)
    layers/k_proj      [L, D, K*H]      layers/k_bias         [L, K*H]   (Qwen2 only)
    layers/v_proj      [L, D, K*H]      layers/v_bias         [L, K*H]   (Qwen2 only)
    layers/o_proj      [L, N*H, D]
    layers/gate_proj   [L, D, F]        layers/up_proj        [L, D, F]
    layers/down_proj   [L, F, D]
    final_norm         [D]
    lm_head            [D, V]           (absent when the embeddings are tied)
    layers/k_scale     [L] float32      layers/v_scale        [L] float32
                       (a float8 KV cache's per-layer scales from the checkpoint; absent: 1.0)

Weights are stored as [in, out] (the transpose of torch.nn.Linear), so `x @ w` is the layer.
Every linear layer, the LM head included, runs through `ops.linear.linear(x, w)`, which
dispatches on the weight's kind; this model never asks how a weight is stored. With
`quantization`, the seven linear weights of a layer are `ops.quant.QuantizedWeight`s of the
same logical shape. Under `linear_backend="cpu"` the engine holds float32 linear weights as
`ops.cpu_linear.PackedWeight`s of the same logical shape (the native matmul's panel layout,
`cpu_linear.pack_params`), and the LM head as one of [1, D, V] (also with tied embeddings, as
a second copy); the scan reads those stacks in place (`ops.linear.split_layers`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.ops.attention import AttentionMetadata, ragged_paged_attention
from pagedjax.ops.kv_cache import KVCache, is_quantized_cache, write_kv
from pagedjax.ops.linear import layer_weights, linear, split_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclasses.dataclass(frozen=True)
class LlamaArchConfig:
    """Hyper-parameters of a Llama-family checkpoint (a subset of Hugging Face's config.json).

    Attributes:
        architecture: the Hugging Face class name, e.g. "LlamaForCausalLM".
        vocab_size: V.  hidden_size: D.  intermediate_size: F.
        num_hidden_layers: L.  num_attention_heads: N.  num_key_value_heads: K.
        head_dim: H (config's `head_dim`, else D // N).
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: None, or a dict with "rope_type" in {"default", "linear", "llama3"} and
            that type's parameters (Hugging Face's names).
        tie_word_embeddings: the LM head is the transposed embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2).
        max_position_embeddings: the longest context the checkpoint was trained for.
        bos_token_id, eos_token_ids: special tokens from the config (eos may be several).
        sliding_window: the attention window of Mistral-style checkpoints. Sliding-window
            attention is not implemented: the engine caps max_model_len at the window, where
            full attention is exact.
    """

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
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                "supported: default, linear, llama3"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any) -> LlamaArchConfig:
        """Builds the config from a Hugging Face config (a `PretrainedConfig` or its dict).

        Raises:
            ValueError: the architecture is not a supported Llama-family one (the message
                names it), or a required field is missing.
        """
        d = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _ARCH_FROM_MODEL_TYPE.get(d.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch or d.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if d.get(key) is None:
                raise ValueError(f"config.json lacks the required field {key!r}")
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in two fields.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        scaling = None if rope_type == "default" else tuple(sorted(rope.items()))
        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        )
        num_heads = d["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always have a bias; Llama's only if the config says.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias")),
            sliding_window=_sliding_window(d, arch),
            max_position_embeddings=d.get("max_position_embeddings") or 2048,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _sliding_window(d: Mapping[str, Any], arch: str) -> int | None:
    """The attention window, if the checkpoint uses one (Mistral; Qwen2 with
    use_sliding_window)."""
    if arch == "Qwen2ForCausalLM" and not d.get("use_sliding_window"):
        return None
    return d.get("sliding_window") or None


_ARCH_FROM_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


ArchConfig = LlamaArchConfig  # the name `models.registry` expects of every model module


def param_shapes(cfg: LlamaArchConfig) -> dict[str, Any]:
    """The expected shape of every parameter, as a pytree of tuples (the legend above)."""
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layers = {
        "input_norm": (L, D),
        "q_proj": (L, D, NH),
        "k_proj": (L, D, KH),
        "v_proj": (L, D, KH),
        "o_proj": (L, NH, D),
        "post_attn_norm": (L, D),
        "gate_proj": (L, D, F),
        "up_proj": (L, D, F),
        "down_proj": (L, F, D),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, NH), k_bias=(L, KH), v_bias=(L, KH))
    shapes = {"embed_tokens": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def rope_inv_freq(cfg: LlamaArchConfig) -> np.ndarray:
    """Inverse RoPE frequencies [H // 2] float32, with the checkpoint's scaling applied.

    Default: theta ** (-2i / H) (Su et al., RoFormer, 2021). "linear": divided by `factor`.
    "llama3": the wavelength-dependent scaling of Meta's Llama 3.1 release (as implemented by
    Hugging Face's `_compute_llama3_parameters`): long wavelengths are divided by `factor`,
    short ones kept, and the band in between interpolated smoothly.
    """
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    scaling = cfg.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich, 2019), computed in float32. x: [..., D]; weight: [D]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the "rotate half" layout of Hugging Face's Llama.

    x: [T, heads, H]; positions: [T] int32; inv_freq: [H // 2] float32. Returns x's shape/dtype.
    """
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(freqs)[:, None, :]  # [T, 1, H/2]
    sin = jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, heads, H/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def forward(
    params: dict[str, Any],
    kv_cache: KVCache,
    input_ids: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: LlamaArchConfig,
    attention_backend: str = "xla",
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder over a flat ragged batch, writing its K/V into the paged cache.

    Args:
        params: the pytree in the module docstring.
        kv_cache: (k_cache, v_cache), each [L, num_blocks, block_size, K, H] in the model
            dtype or float8 (then read and written with `layers/k_scale`, `layers/v_scale`);
            donate it.
        input_ids: [T] int32 token ids.
        positions: [T] int32 absolute positions (RoPE and the causal mask).
        md: attention metadata for the step (slot mapping, block tables, sequence lengths).
        cfg: the architecture (static).
        attention_backend: "xla", "cpu", "reference" or "pallas" (static); attention only
            (the linear layers follow their weights' kind, `ops.linear`).

    Returns:
        hidden states after the final norm [T, D] in the params dtype, and the updated cache.
    """
    h = params["embed_tokens"][input_ids]  # [T, D]
    h, kv_cache = decoder_layers(
        params["layers"], kv_cache, h, positions, md, cfg=cfg, attention_backend=attention_backend
    )
    return final_norm(params, h, cfg), kv_cache


def final_norm(params: dict[str, Any], h: jax.Array, cfg: LlamaArchConfig) -> jax.Array:
    """The norm after the last decoder layer. h: [..., D] -> [..., D]."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def decoder_layers(
    layers: dict[str, Any],
    kv_cache: KVCache,
    h: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: LlamaArchConfig,
    attention_backend: str = "xla",
) -> tuple[jax.Array, KVCache]:
    """The decoder layers whose weights `layers` holds (a leading axis of any length: all L
    layers, or one pipeline stage's), over hidden states h [T, D]; layer i of `layers` reads
    and writes layer i of `kv_cache` ([layers, num_blocks, block_size, K, H] each).

    The linear layers multiply only the step's real tokens (`md.query_start_loc[-1]`) where
    the weight's kind can skip the bucket's padding rows (pre-packed weights, `ops.linear`);
    stacks read in place stay out of the scan's sliced inputs (`ops.linear.split_layers`).
    """
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    scale = 1.0 / math.sqrt(H)
    T = h.shape[0]
    fp8_cache = is_quantized_cache(kv_cache[0].dtype)

    sliced, in_place = split_layers(layers)
    num_real_tokens = md.query_start_loc[-1]

    def layer(carry, xs):
        h, (k_cache, v_cache) = carry
        w_slice, layer_idx = xs
        w = layer_weights(w_slice, in_place, layer_idx)

        def proj(x, name):
            return linear(x, w[name], num_rows=num_real_tokens)

        x = rms_norm(h, w["input_norm"], cfg.rms_norm_eps)
        q = proj(x, "q_proj")  # [T, N*H]
        k = proj(x, "k_proj")  # [T, K*H]
        v = proj(x, "v_proj")
        if cfg.attention_bias:
            q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
        q = apply_rope(q.reshape(T, N, H), positions, inv_freq)  # [T, N, H]
        k = apply_rope(k.reshape(T, K, H), positions, inv_freq)  # [T, K, H]
        v = v.reshape(T, K, H)
        # A float8 cache always gets explicit scalar scales (1.0 unless the checkpoint has them).
        one = jnp.ones((), jnp.float32)
        k_scale = w.get("k_scale", one) if fp8_cache else None
        v_scale = w.get("v_scale", one) if fp8_cache else None
        k_cache, v_cache = write_kv(
            k_cache, v_cache, layer_idx, k, v, md.slot_mapping, k_scale, v_scale
        )
        attn = ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            layer_idx,
            md,
            sm_scale=scale,
            backend=attention_backend,
            k_scale=k_scale,
            v_scale=v_scale,
        )  # [T, N, H]
        h = h + proj(attn.reshape(T, N * H).astype(h.dtype), "o_proj")
        x = rms_norm(h, w["post_attn_norm"], cfg.rms_norm_eps)
        mlp = jax.nn.silu(proj(x, "gate_proj")) * proj(x, "up_proj")  # [T, F]
        h = h + proj(mlp, "down_proj")
        return (h, (k_cache, v_cache)), None

    num_layers = jax.tree.leaves(layers["input_norm"])[0].shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    (h, kv_cache), _ = jax.lax.scan(layer, (h, kv_cache), (sliced, layer_ids))
    return h, kv_cache


def compute_logits(
    params: dict[str, Any], hidden: jax.Array, num_rows: jax.Array | int | None = None
) -> jax.Array:
    """LM head through `ops.linear.linear`: hidden [S, D] (already normed) -> logits [S, V]
    float32. The head is params["lm_head"] (a plain [D, V] array, or a pre-packed one of
    [1, D, V], `cpu_linear.pack_params`), else the transposed embedding matrix (tied).

    num_rows: scalar int32 or None (all S): the real rows, which come first. A pre-packed head
    multiplies only these (the rest: zeros); a plain one computes every row.
    """
    head = params.get("lm_head")
    if head is None:  # tied embeddings
        head = params["embed_tokens"].T  # [D, V]
    return linear(hidden, head, num_rows=num_rows).astype(jnp.float32)


def param_logical_axes(cfg: LlamaArchConfig) -> dict[str, Any]:
    """The logical axis names of every parameter (same tree as `param_shapes`).

    Names: "layers" (the stacked L axis), "embed" (D), "q_heads" (N*H columns, cut at head
    boundaries), "kv_heads" (K*H), "mlp" (F), "vocab" (V). `sharding.rules` maps them to
    mesh axes; this model never names a mesh axis.
    """
    layers = {
        "input_norm": ("layers", "embed"),
        "q_proj": ("layers", "embed", "q_heads"),
        "k_proj": ("layers", "embed", "kv_heads"),
        "v_proj": ("layers", "embed", "kv_heads"),
        "o_proj": ("layers", "q_heads", "embed"),
        "post_attn_norm": ("layers", "embed"),
        "gate_proj": ("layers", "embed", "mlp"),
        "up_proj": ("layers", "embed", "mlp"),
        "down_proj": ("layers", "mlp", "embed"),
    }
    if cfg.attention_bias:
        layers.update(
            q_bias=("layers", "q_heads"),
            k_bias=("layers", "kv_heads"),
            v_bias=("layers", "kv_heads"),
        )
    axes = {"embed_tokens": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def logical_unit_counts(cfg: LlamaArchConfig) -> dict[str, int]:
    """How many indivisible units each logical axis has (a mesh axis must divide it)."""
    return {
        "layers": cfg.num_hidden_layers,
        "q_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "mlp": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "embed": cfg.hidden_size,
    }
