"""Building blocks the decoder families share, as pure functions of their weights.

RMSNorm (plain, or Gemma's 1 + w), RoPE (inverse frequencies with default / linear / llama3
scaling, and the rotation), the attention call of a decoder layer (q/k/v projections with
optional bias and per-head q/k RMSNorm, RoPE, the paged KV cache write and
`ragged_paged_attention`, o_proj), gated MLPs, the embedding lookup, the LM head, and
`scan_layers`, which runs a layer function over weights stacked on a leading L axis.

Every linear layer goes through `ops.linear.linear(x, w, num_rows=...)`, so a weight may be
plain, quantized or pre-packed (`ops.linear`); nothing here asks how a weight is stored.
Weights are [in, out] (the transpose of torch.nn.Linear). The dimension legend is the one
of `models.llama`: T tokens, D hidden, F MLP, N / K query / KV heads, H head dim, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.ops.attention import AttentionMetadata, ragged_paged_attention
from pagedjax.ops.gguf_quant import GGUFWeight, embedding_rows
from pagedjax.ops.kv_cache import KVCache, is_quantized_cache, write_kv
from pagedjax.ops.linear import layer_weights, linear, split_layers

# ----------------------------------------------------------------------------- norms


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis, [..., D] -> [..., 1], in a fixed pairwise order: zero-padded to
    a power of two, then halved by elementwise adds. A row's sum is then the same bits in a
    step of any size (batch invariance): XLA's CPU reduction picks its summation order by
    the shape and fusion it is compiled in, so `jnp.sum` of the same row can differ in its
    last bit between a step of 16 tokens and one of 64."""
    D = x.shape[-1]
    P = 1 << max(D - 1, 0).bit_length()
    if P != D:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, P - D)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: bool = False) -> jax.Array:
    """RMSNorm (Zhang & Sennrich, 2019), computed in float32. x: [..., D]; weight: [D]. The
    mean of squares is a `row_sum` (the same bits for a row whatever else is in the step).

    offset: scale by (1 + weight) computed in float32, as Gemma's RMSNorm (its weights are
    stored around 0); otherwise by weight, in x's dtype, as Llama's.
    """
    x32 = x.astype(jnp.float32)
    mean_sq = row_sum(x32 * x32) * (1.0 / x.shape[-1])  # [..., 1]
    x32 = x32 * jax.lax.rsqrt(mean_sq + eps)
    if offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2] float32, with a checkpoint's scaling applied.

    Default: theta ** (-2i / H) (Su et al., RoFormer, 2021). "linear": divided by `factor`.
    "llama3": the wavelength-dependent scaling of Meta's Llama 3.1 release (as implemented by
    Hugging Face's `_compute_llama3_parameters`): long wavelengths are divided by `factor`,
    short ones kept, and the band in between interpolated smoothly.

    scaling: None, or a dict with "rope_type" and that type's parameters (Hugging Face's
    names), e.g. `DecoderArchConfig.rope_scaling_dict`.
    """
    H = head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    scaling = scaling or {}
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
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    return inv_freq.astype(np.float32)


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


# ----------------------------------------------------------------------------- attention


def attention(
    w: Mapping[str, Any],
    x: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    layer_idx: jax.Array,
    md: AttentionMetadata,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inv_freq: jax.Array,
    qk_norm_eps: float | None = None,
    qk_norm_offset: bool = False,
    sm_scale: float | None = None,
    attention_backend: str = "xla",
    num_rows: jax.Array | int | None = None,
    sliding_window: jax.Array | int | None = None,
    logit_soft_cap: float | None = None,
) -> tuple[jax.Array, KVCache]:
    """The attention block of one decoder layer over normed hidden states x [T, D].

    Weights of `w` (one layer's): q_proj [D, N*H], k_proj / v_proj [D, K*H] (or the three
    as qkv_proj [D, (N + 2K)*H], `ops.fused_projections`), o_proj [N*H, D]; q_bias / k_bias /
    v_bias ([N*H], [K*H]) and o_bias [D] added when present; q_norm / k_norm [H], RMSNorm of
    each head before RoPE, when `qk_norm_eps` is given (Qwen3; Gemma 3 with `qk_norm_offset`,
    its 1 + w RMSNorm); k_scale / v_scale, a float8 cache's scalar scales (1.0 when absent).

    Args:
        kv_cache: (k_cache, v_cache), each [layers, num_blocks, block_size, K, H]; the
            layer's K/V are written at `md.slot_mapping` of layer `layer_idx`.
        inv_freq: [H // 2] float32 (`rope_inv_freq`).
        sm_scale: the softmax scale; None: 1 / sqrt(H).
        attention_backend: `ops.attention`'s backend (static).
        num_rows: the step's real token count, for the linear layers (`ops.linear.linear`).
        sliding_window, logit_soft_cap: as `ops.attention.ragged_paged_attention` (None:
            full attention, no cap).

    Returns:
        (the o_proj output [T, D] in x's dtype, the updated cache).
    """
    N, K, H = num_heads, num_kv_heads, head_dim
    T = x.shape[0]
    k_cache, v_cache = kv_cache

    def proj(v, name):
        return linear(v, w[name], num_rows=num_rows)

    if "qkv_proj" in w:  # one call for the three (`ops.fused_projections`)
        q, k, v = jnp.split(proj(x, "qkv_proj"), [N * H, (N + K) * H], axis=-1)
    else:
        q = proj(x, "q_proj")  # [T, N*H]
        k = proj(x, "k_proj")  # [T, K*H]
        v = proj(x, "v_proj")
    if "q_bias" in w:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    if qk_norm_eps is not None:
        q = rms_norm(q, w["q_norm"], qk_norm_eps, offset=qk_norm_offset)
        k = rms_norm(k, w["k_norm"], qk_norm_eps, offset=qk_norm_offset)
    q = apply_rope(q, positions, inv_freq)  # [T, N, H]
    k = apply_rope(k, positions, inv_freq)  # [T, K, H]
    # A float8 cache always gets explicit scalar scales (1.0 unless the checkpoint has them).
    fp8_cache = is_quantized_cache(k_cache.dtype)
    one = jnp.ones((), jnp.float32)
    k_scale = w.get("k_scale", one) if fp8_cache else None
    v_scale = w.get("v_scale", one) if fp8_cache else None
    k_cache, v_cache = write_kv(
        k_cache,
        v_cache,
        layer_idx,
        k,
        v,
        md.slot_mapping,
        k_scale,
        v_scale,
        native=attention_backend == "cpu",
    )
    attn = ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        layer_idx,
        md,
        sm_scale=1.0 / math.sqrt(H) if sm_scale is None else sm_scale,
        backend=attention_backend,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
    )  # [T, N, H]
    out = proj(attn.reshape(T, N * H).astype(x.dtype), "o_proj")  # [T, D]
    if "o_bias" in w:
        out = out + w["o_bias"]
    return out, (k_cache, v_cache)


# ----------------------------------------------------------------------------- MLP

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(
    w: Mapping[str, Any],
    x: jax.Array,
    *,
    activation: str = "silu",
    num_rows: jax.Array | int | None = None,
) -> jax.Array:
    """down_proj(act(gate_proj(x)) * up_proj(x)): x [T, D] -> [T, D] (Shazeer, 2020).

    Weights of `w`: gate_proj and up_proj [D, F] (or both as gate_up_proj [D, 2F],
    `ops.fused_projections`), down_proj [F, D].
    activation: Hugging Face's `hidden_act` name: "silu" / "swish" (SwiGLU), "gelu" (erf),
    "gelu_new" / "gelu_pytorch_tanh" (the tanh approximation; GeGLU).
    """
    act = _ACTIVATIONS[activation]
    if "gate_up_proj" in w:  # one call for the two (`ops.fused_projections`)
        gate, up = jnp.split(linear(x, w["gate_up_proj"], num_rows=num_rows), 2, axis=-1)
    else:
        gate = linear(x, w["gate_proj"], num_rows=num_rows)  # [T, F]
        up = linear(x, w["up_proj"], num_rows=num_rows)
    return linear(act(gate) * up, w["down_proj"], num_rows=num_rows)


# ----------------------------------------------------------------------------- embeddings


def embed(params: Mapping[str, Any], input_ids: jax.Array) -> jax.Array:
    """The embedding lookup: input_ids [T] int32 -> [T, D] in the params dtype (a GGUF
    embedding kept quantized: only the looked-up rows are dequantized, to the dtype of the
    final norm, the model's)."""
    table = params["embed_tokens"]
    if isinstance(table, GGUFWeight):
        return embedding_rows(table, input_ids, params["final_norm"].dtype)
    return table[input_ids]


def compute_logits(
    params: Mapping[str, Any],
    hidden: jax.Array,
    num_rows: jax.Array | int | None = None,
    cfg: DecoderArchConfig | None = None,
) -> jax.Array:
    """LM head through `ops.linear.linear`: hidden [S, D] (already normed) -> logits [S, V]
    float32. The head is params["lm_head"] (a plain [D, V] array, or a pre-packed one of
    [1, D, V], `cpu_linear.pack_params`), else the transposed embedding matrix (tied).

    num_rows: scalar int32 or None (all S): the real rows, which come first. A pre-packed head
    multiplies only these (the rest: zeros); a plain one computes every row.
    cfg: the architecture; its `final_logit_softcap` (Gemma 2/3), when set, caps the logits
    as cap * tanh(logits / cap), in float32. None: no cap.
    """
    head = params.get("lm_head")
    if head is None:  # tied embeddings
        head = params["embed_tokens"]
        # A GGUF embedding is stored as the head's rows already (logical shape [D, V]).
        head = head if isinstance(head, GGUFWeight) else head.T  # [D, V]
    logits = linear(hidden, head, num_rows=num_rows).astype(jnp.float32)
    cap = cfg.final_logit_softcap if cfg is not None else None
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    return logits


# ----------------------------------------------------------------------------- layer stack

LayerFn = Callable[[dict[str, Any], jax.Array, KVCache, jax.Array], tuple[jax.Array, KVCache]]


def decoder_forward(decoder_layers: Callable[..., Any], final_norm: Callable[..., Any]):
    """A model's `forward` from its `decoder_layers` and `final_norm`:

    forward(params, kv_cache, input_ids, positions, md, *, cfg, attention_backend="xla")
        -> (hidden states after the final norm [T, D] in the params dtype, updated cache)

    runs the decoder over a flat ragged batch (input_ids, positions: [T] int32; md: the
    step's attention metadata), writing its K/V into the paged cache (k_cache, v_cache),
    each [L, num_blocks, block_size, K, H] in the model dtype or float8 (donate it);
    `attention_backend` ("xla", "cpu", "reference" or "pallas", static) picks the attention
    only (the linear layers follow their weights' kind, `ops.linear`).
    """

    def forward(
        params: Mapping[str, Any],
        kv_cache: KVCache,
        input_ids: jax.Array,
        positions: jax.Array,
        md: AttentionMetadata,
        *,
        cfg: DecoderArchConfig,
        attention_backend: str = "xla",
    ) -> tuple[jax.Array, KVCache]:
        h = embed(params, input_ids)  # [T, D]
        h, kv_cache = decoder_layers(
            params["layers"],
            kv_cache,
            h,
            positions,
            md,
            cfg=cfg,
            attention_backend=attention_backend,
        )
        return final_norm(params, h, cfg), kv_cache

    return forward


def layer_window_fn(
    cfg: DecoderArchConfig, layer_offset: jax.Array | int = 0
) -> Callable[[jax.Array], jax.Array | int | None]:
    """`fn(layer_idx)` -> the attention window of local layer `layer_idx` of a stack whose
    first layer is the model's `layer_offset`: None when no layer has a window, a Python int
    when every layer has the same one, else a traced int32 (0: full attention) read from
    the per-layer table `cfg.layer_windows()`."""
    windows = cfg.layer_windows()
    if not any(windows):
        return lambda layer_idx: None
    if len(set(windows)) == 1:
        return lambda layer_idx: windows[0]
    table = jnp.asarray(windows, jnp.int32)
    return lambda layer_idx: table[layer_offset + layer_idx]


# The key of an optional [Ls] bool entry of a stack of layers: True for its real layers (a
# prefix), False for the padding rows of a pipeline stage smaller than the largest one
# (`sharding.stages`). `scan_layers` runs the real layers only.
REAL_LAYERS = "real_layers"


def scan_layers(
    layers: Mapping[str, Any], kv_cache: KVCache, h: jax.Array, layer_fn: LayerFn
) -> tuple[jax.Array, KVCache]:
    """Runs `layer_fn(w, h, kv_cache, layer_idx) -> (h, kv_cache)` over the layers whose
    weights `layers` stacks on a leading axis (all L, or one pipeline stage's), by
    `jax.lax.scan`; `w` is layer i's weights, pre-packed stacks read in place as
    `ops.linear.LayerView`s (`ops.linear.split_layers`), and layer i of `layers` reads and
    writes layer i of `kv_cache`.

    A stack with a `REAL_LAYERS` mask [Ls] (a pipeline stage padded to the largest stage)
    runs only its first sum(mask) layers, by a loop of that many (traced) steps: the padding
    rows are never read and cost nothing."""
    layers = dict(layers)
    real = layers.pop(REAL_LAYERS, None)
    sliced, in_place = split_layers(layers)

    def run(layer_idx, w_slice, h, kv):
        return layer_fn(layer_weights(w_slice, in_place, layer_idx), h, kv, layer_idx)

    if real is not None:

        def step(i, carry):
            w_slice = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), sliced)
            return run(i, w_slice, *carry)

        num_real = jnp.sum(real.astype(jnp.int32))
        return jax.lax.fori_loop(0, num_real, step, (h, kv_cache))

    def body(carry, xs):
        w_slice, layer_idx = xs
        return run(layer_idx, w_slice, *carry), None

    num_layers = jax.tree.leaves(sliced)[0].shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    (h, kv_cache), _ = jax.lax.scan(body, (h, kv_cache), (sliced, layer_ids))
    return h, kv_cache
