"""Writes 4-bit AWQ / GPTQ checkpoints from float params, in the published packing layouts.

For benchmarks and tests where no real AWQ / GPTQ checkpoint exists: the weights are
quantized by round-to-nearest (RTN) with per-group asymmetric scales and zero points, the
min/max rule of AutoAWQ's `pseudo_quantize_tensor`: s = (max - min) / 15,
z = clamp(round(-min / s), 0, 15), q = clamp(round(w / s) + z, 0, 15); s is stored in float16
and q computed with the stored s. This is neither AWQ's activation-aware scaling search nor
GPTQ's Hessian-based error compensation, so its quality is a lower bound for those methods.
The layouts (AutoAWQ GEMM, GPTQ v1 / v2) are described in `models.quant_loader`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.hf_format import HF_LINEAR_MODULES, HF_TENSOR_NAMES, hf_config_dict
from pagedjax.models.quant_loader import AWQ_ORDER, GPTQ_ORDER, pack_int4_rows


def rtn_int4(w: np.ndarray, g_idx: np.ndarray, num_groups: int, min_zero: int = 0):
    """Round-to-nearest 4-bit quantization of w [in, out] with the groups of rows `g_idx`.

    Returns (q [in, out] int32 in 0..15, scales [G, out] float16, zeros [G, out] int32), so
    that w ~ (q - zeros[g_idx]) * scales[g_idx]; each weight is off by at most s / 2 unless
    its group's range had to be clamped (a zero point outside min_zero..15). GPTQ v1 cannot
    store a zero point of 0 (it stores zero - 1 in 4 bits), hence `min_zero=1` there.
    """
    w = np.asarray(w, np.float32)
    scales = np.zeros((num_groups, w.shape[1]), np.float16)
    zeros = np.zeros((num_groups, w.shape[1]), np.int32)
    for g in range(num_groups):
        rows = w[g_idx == g]  # [group_size, out]
        lo, hi = rows.min(axis=0), rows.max(axis=0)
        s = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
        s = np.where(s == 0, np.float16(2**-24), s)  # a float16 underflow stays invertible
        scales[g] = s
        zeros[g] = np.clip(np.round(-lo / s.astype(np.float32)), min_zero, 15)
    s_rows = scales[g_idx].astype(np.float32)  # [in, out]
    q = np.clip(np.round(w / s_rows) + zeros[g_idx], 0, 15).astype(np.int32)
    return q, scales, zeros


def pack_int4_cols(q: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """int [rows, cols] in 0..15 -> int32 [rows, cols // 8]: column 8c + order[i] goes to bits
    4i .. 4i + 3 of packed column c."""
    q = q.astype(np.uint32).reshape(q.shape[0], -1, 8)
    packed = np.zeros(q.shape[:2], np.uint32)
    for i, col in enumerate(order):
        packed |= q[:, :, col] << np.uint32(4 * i)
    return packed.view(np.int32)


def quantize_linear(
    w: np.ndarray, method: str, group_size: int, desc_act: bool = False, gptq_v2: bool = False
) -> dict[str, np.ndarray]:
    """The checkpoint tensors of one linear layer w [in, out] (our layout, x @ w).

    AWQ: {qweight, qzeros, scales}; GPTQ: {qweight, qzeros, scales, g_idx}. With `desc_act`
    the rows are grouped in order of decreasing mean |w| (a stand-in for GPTQ's act-order,
    which sorts by the Hessian's diagonal), so g_idx is a permutation of the sorted groups.
    """
    n_in = w.shape[0]
    if n_in % group_size:
        raise ValueError(f"{n_in} input rows do not split into groups of {group_size}")
    G = n_in // group_size
    g_idx = np.arange(n_in, dtype=np.int32) // group_size
    if desc_act:
        order = np.argsort(-np.abs(w).mean(axis=1), kind="stable")
        g_idx = np.empty(n_in, np.int32)
        g_idx[order] = np.arange(n_in, dtype=np.int32) // group_size
    q, scales, zeros = rtn_int4(w, g_idx, G, min_zero=1 if method == "gptq" and not gptq_v2 else 0)
    if method == "awq":
        return {
            "qweight": pack_int4_cols(q, AWQ_ORDER),
            "qzeros": pack_int4_cols(zeros, AWQ_ORDER),
            "scales": scales,
        }
    stored_zeros = zeros if gptq_v2 else zeros - 1  # v1 stores zero - 1
    return {
        "qweight": pack_int4_rows(q),
        "qzeros": pack_int4_cols(stored_zeros, GPTQ_ORDER),
        "scales": scales,
        "g_idx": g_idx,
    }


def write_int4_checkpoint(
    out: str | Path,
    cfg: DecoderArchConfig,
    params: dict[str, Any],
    method: str,
    group_size: int = 128,
    desc_act: bool = False,
    gptq_v2: bool = False,
    tokenizer=None,
) -> Path:
    """Writes a Hugging Face folder (config.json with quantization_config, model.safetensors)
    whose linear layers are `method` ("awq" or "gptq") 4-bit tensors of float `params`."""
    from safetensors.numpy import save_file

    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": np.asarray(params["embed_tokens"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
    }
    if "lm_head" in params:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    layers = params["layers"]
    linear = set(HF_LINEAR_MODULES.values())
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for ours in layers:  # norms and biases, as they are
            if ours in HF_TENSOR_NAMES and ours not in linear:
                tensors[prefix + HF_TENSOR_NAMES[ours]] = np.asarray(layers[ours][i], np.float32)
        for hf, ours in HF_LINEAR_MODULES.items():
            w = np.asarray(layers[ours][i], np.float32)  # [in, out]
            for leaf, value in quantize_linear(w, method, group_size, desc_act, gptq_v2).items():
                tensors[f"{prefix}{hf}.{leaf}"] = value
    save_file(tensors, str(out / "model.safetensors"))
    config = hf_config_dict(cfg, "float32")
    qc: dict[str, Any] = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        qc.update(version="gemm", zero_point=True)
    else:
        qc.update(desc_act=desc_act, sym=False, checkpoint_format="gptq_v2" if gptq_v2 else "gptq")
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
