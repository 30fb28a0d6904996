"""Quantized checkpoints: `quantization_config`, AWQ / GPTQ / fp8 tensors, KV-cache scales.

`resolve_quantization` decides the engine's method from the `quantization=` argument and the
checkpoint's config.json (as vLLM does: a quantized checkpoint names its method, a float one
can be quantized on load). `QuantTensorCollector` takes the quantized tensors of a Hugging
Face checkpoint as the loader streams them and turns each linear layer into an
`ops.quant.QuantizedWeight` (layout in `ops.quant`). Published layouts read here:

AutoAWQ, GEMM version (`awq/modules/linear/gemm.py`, `WQLinear_GEMM.from_linear`):
    qweight int32 [in, out // 8]: output columns packed eight to an int32, column 8c + AWQ_ORDER[i]
        of row r in bits 4i .. 4i + 3 of qweight[r, c], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7);
    qzeros  int32 [in // group_size, out // 8], packed the same way;
    scales  float16 [in // group_size, out];
    w[r, o] = (q[r, o] - z[r // group_size, o]) * s[r // group_size, o]  (no zero offset).
GPTQ, as AutoGPTQ (`auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`, `QuantLinear.pack`)
and GPTQModel write it:
    qweight int32 [in // 8, out]: input rows packed eight to an int32, row 8r + j of column o in
        bits 4j .. 4j + 3 of qweight[r, o];
    qzeros  int32 [groups, out // 8]: column 8c + j in bits 4j .. 4j + 3, storing zero - 1 in
        checkpoint_format "gptq" (v1, the historical offset: a zero of 0 wraps to 15 and
        reads back as 16) and the zero itself in "gptq_v2";
    scales  float16 [groups, out];  g_idx int32 [in]: the group of each input row (act-order,
        `desc_act`, makes it a permutation of the sorted groups);
    w[r, o] = (q[r, o] - z[g_idx[r], o]) * s[g_idx[r], o].
fp8 (vLLM's `quant_method: "fp8"`, as AutoFP8 / llm-compressor write it):
    weight float8_e4m3fn [out, in]; weight_scale float32 [] or [out] / [out, 1];
    input_scale float32 [] (activation_scheme "static"); w = weight * weight_scale.
KV-cache scales (vLLM): `self_attn.k_scale`, `self_attn.v_scale` (or one `self_attn.kv_scale`
for both), float32 scalars per layer; kept only for a float8 KV cache.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pagedjax.models.hf_format import HF_LINEAR_MODULES
from pagedjax.ops.choices import (
    INT4_METHODS,
    QUANTIZATION_ALIASES,
    QUANTIZATION_CHOICES,
    QUANTIZE_ON_LOAD,
)
from pagedjax.ops.choices import QUANTIZATION_METHODS as METHODS
from pagedjax.ops.quant import QUANTIZED_WEIGHTS, QuantizedWeight, quantize_weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_ORDER = tuple(range(8))
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.([a-z_]+)$")
_COMPONENTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "fp8": ("weight", "weight_scale", "input_scale"),
}
_KV_SCALE_NAMES = {"k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v")}
_FP8_SAFETENSORS = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's `quantization_config` says.

    method: "awq", "gptq", "fp8", or "int8" / "w8a8" (pagedjax conversions only).
    group_size: input rows per scale group (-1: all of them) for AWQ / GPTQ (act-order is
        read from each layer's g_idx).  zero_offset: 1 for GPTQ v1 checkpoints (stored zero =
        zero - 1).
    activation_scheme: fp8 "dynamic" or "static" (the checkpoint's `input_scale`).
    """

    method: str
    group_size: int = -1
    zero_offset: int = 0
    activation_scheme: str = "dynamic"


def checkpoint_quantization(source) -> CheckpointQuantization | None:
    """Reads a source's `quantization_config` (None: float weights, or a GGUF file).

    Raises:
        ValueError: a method or setting this engine cannot load (the message names it).
    """
    if source.kind == "gguf":
        return None
    with open(Path(source.path) / "config.json") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if qc.get("pagedjax") and method in METHODS:  # a conversion saved by `save_converted`
        return CheckpointQuantization(method=method)
    if method in ("awq", "gptq"):
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"{method} checkpoints with bits={bits} are not supported (4 only)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or not qc.get("zero_point", True):
                raise ValueError(
                    f"AWQ version={version!r}, zero_point={qc.get('zero_point')} is not "
                    "supported; supported: the GEMM packing with zero points"
                )
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: gptq, gptq_v2")
        return CheckpointQuantization(
            method=method,
            group_size=int(qc.get("group_size", qc.get("q_group_size", -1))),
            zero_offset=1 if method == "gptq" and fmt == "gptq" else 0,
        )
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(
                "fp8 checkpoints with block-wise scales (weight_block_size) are "
                "not supported; supported: per-tensor or per-channel scales"
            )
        scheme = str(qc.get("activation_scheme", "dynamic"))
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported")
        return CheckpointQuantization(method="fp8", activation_scheme=scheme)
    raise ValueError(
        f"the checkpoint's quantization method {method!r} is not supported; "
        "supported: awq, gptq, fp8"
    )


def resolve_quantization(requested: str | None, source) -> str | None:
    """The method the engine runs: the checkpoint's, or `requested` applied to float weights.

    Raises:
        ValueError: an unknown method; a method that contradicts the checkpoint's; AWQ / GPTQ
            asked of float weights; "gguf" asked of something that is not a GGUF file.
    """
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {requested!r}"
        )
    requested = QUANTIZATION_ALIASES.get(requested, requested)
    if requested == "gguf":
        if source.kind != "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file")
        return "gguf"  # its quantized blocks kept (`ops.gguf_quant`)
    ckpt = checkpoint_quantization(source)
    if ckpt is not None:
        if requested not in (None, ckpt.method):
            raise ValueError(
                f"quantization={requested!r} does not match the checkpoint's quantization "
                f"method {ckpt.method!r} (config.json quantization_config)"
            )
        return ckpt.method
    if requested in INT4_METHODS:
        raise ValueError(
            f"quantization={requested!r} needs a checkpoint quantized with it (config.json "
            f"with quantization_config.quant_method={requested!r}); {source.path!r} holds "
            f"float weights: {', '.join(QUANTIZE_ON_LOAD)} quantize them on load"
        )
    return requested


# ----------------------------------------------------------------------------- unpacking


def unpack_int4_cols(packed: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """int32 [rows, cols // 8] -> int32 [rows, cols] values 0..15; nibble i of packed column c
    is column 8c + order[i]."""
    bits = np.asarray(packed, np.int32).view(np.uint32)  # the same 32 bits, unsigned
    nib = (bits[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    out = np.empty_like(nib)
    out[..., list(order)] = nib  # [rows, cols // 8, 8]: slot order[i] <- nibble i
    return out.reshape(*packed.shape[:-1], -1).astype(np.int32)


def unpack_int4_rows(packed: np.ndarray) -> np.ndarray:
    """int32 [rows // 8, cols] -> int32 [rows, cols]: nibble j of packed row r is row 8r + j."""
    bits = np.asarray(packed, np.int32).view(np.uint32)  # the same 32 bits, unsigned
    nib = bits[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[:, None]
    return (nib & 0xF).reshape(-1, packed.shape[-1]).astype(np.int32)


def pack_int4_rows(q: np.ndarray) -> np.ndarray:
    """int [rows, cols] values 0..15 -> int32 [rows // 8, cols] (inverse of unpack_int4_rows)."""
    q = q.astype(np.uint32).reshape(q.shape[0] // 8, 8, q.shape[1])
    packed = np.zeros((q.shape[0], q.shape[2]), np.uint32)
    for j in range(8):
        packed |= q[:, j] << np.uint32(4 * j)
    return packed.view(np.int32)


def _group_size(ckpt: CheckpointQuantization, n_in: int, groups: int, name: str) -> int:
    gs = n_in if ckpt.group_size == -1 else ckpt.group_size
    if n_in % gs or n_in // gs != groups:
        raise ValueError(
            f"{name}: {n_in} input rows do not split into the {groups} groups of "
            f"group_size={ckpt.group_size} that its scales have"
        )
    return gs


def awq_layer(parts: dict[str, np.ndarray], ckpt: CheckpointQuantization, name: str):
    """AutoAWQ GEMM tensors of one layer -> (qweight [in/8, out], scales, zeros, None)."""
    q = unpack_int4_cols(parts["qweight"], AWQ_ORDER)  # [in, out]
    zeros = unpack_int4_cols(parts["qzeros"], AWQ_ORDER)  # [G, out]
    scales = parts["scales"].astype(np.float32)  # [G, out]
    _check_int4_shapes(name, q, zeros, scales)
    _group_size(ckpt, q.shape[0], scales.shape[0], name)
    return pack_int4_rows(q), scales, zeros.astype(np.int8), None


def gptq_layer(parts: dict[str, np.ndarray], ckpt: CheckpointQuantization, name: str):
    """GPTQ tensors of one layer -> (qweight [in/8, out], scales, zeros, perm or None).

    Act-order rows are sorted by group (stable), so that groups are contiguous; `perm` maps
    stored rows to original rows.
    """
    qweight = parts["qweight"].astype(np.int32)  # [in/8, out]
    zeros = unpack_int4_cols(parts["qzeros"], GPTQ_ORDER) + ckpt.zero_offset  # [G, out]
    scales = parts["scales"].astype(np.float32)  # [G, out]
    n_in = qweight.shape[0] * 8
    if zeros.shape != scales.shape or qweight.shape[1] != scales.shape[1]:
        raise ValueError(
            f"{name}: qweight {parts['qweight'].shape}, qzeros {parts['qzeros'].shape} and "
            f"scales {scales.shape} do not fit together"
        )
    gs = _group_size(ckpt, n_in, scales.shape[0], name)
    sequential = np.arange(n_in) // gs
    g_idx = parts.get("g_idx")
    if g_idx is None or np.array_equal(g_idx, sequential):
        return qweight, scales, zeros.astype(np.int8), None
    g_idx = np.asarray(g_idx).reshape(-1)
    order = np.argsort(g_idx, kind="stable")
    if g_idx.shape != (n_in,) or not np.array_equal(g_idx[order], sequential):
        raise ValueError(f"{name}: g_idx does not assign {gs} rows to each of the groups")
    q = unpack_int4_rows(qweight)[order]  # [in, out], rows sorted by group
    return pack_int4_rows(q), scales, zeros.astype(np.int8), order.astype(np.int32)


def _check_int4_shapes(name, q, zeros, scales):
    if zeros.shape != scales.shape or q.shape[1] != scales.shape[1]:
        raise ValueError(
            f"{name}: qweight {q.shape}, qzeros {zeros.shape} and scales {scales.shape} "
            "(unpacked) do not fit together"
        )


def fp8_layer(parts: dict[str, np.ndarray], ckpt: CheckpointQuantization, name: str):
    """fp8 tensors of one layer -> (qweight [in, out] float8_e4m3fn, scales [out], input_scale)."""
    import ml_dtypes

    w = np.ascontiguousarray(parts["weight"].T)  # [in, out]
    if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"{name}.weight is {w.dtype}, expected float8_e4m3fn")
    out = w.shape[1]
    scale = np.asarray(parts.get("weight_scale", np.ones(())), np.float32).reshape(-1)
    if scale.size not in (1, out):
        raise ValueError(f"{name}.weight_scale has {scale.size} values; expected 1 or {out}")
    input_scale = None
    if ckpt.activation_scheme == "static":
        if "input_scale" not in parts:
            raise ValueError(f"{name}.input_scale is missing (activation_scheme 'static')")
        input_scale = np.asarray(parts["input_scale"], np.float32).reshape(-1).max()
    return w, np.broadcast_to(scale, (out,)).copy(), input_scale


# ----------------------------------------------------------------------------- collection


class QuantTensorCollector:
    """Takes the quantized and KV-scale tensors of a Hugging Face checkpoint, then builds the
    stacked `QuantizedWeight`s.

    Args:
        num_layers: L.
        ckpt: the checkpoint's quantization (None: only KV-cache scales are taken).
        keep_kv_scales: keep k/v scales (a float8 KV cache); otherwise they are dropped.
    """

    def __init__(self, num_layers: int, ckpt: CheckpointQuantization | None, keep_kv_scales):
        self.L, self.ckpt, self.keep_kv_scales = num_layers, ckpt, keep_kv_scales
        self.parts: dict[str, list[dict[str, np.ndarray]]] = {}
        self.kv_scales: dict[str, dict[int, float]] = {"k": {}, "v": {}}

    def accept(self, name: str, value: np.ndarray) -> bool:
        """Takes `name` if it is a quantized linear's tensor or a KV scale; False otherwise."""
        m = _HF_LAYER.match(name)
        if m is None:
            return False
        layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
        if module == "self_attn" and leaf in _KV_SCALE_NAMES:
            for which in _KV_SCALE_NAMES[leaf]:
                self.kv_scales[which][layer] = float(np.asarray(value, np.float32).max())
            return True
        target = HF_LINEAR_MODULES.get(module)
        if target is None or self.ckpt is None or leaf not in _COMPONENTS[self.ckpt.method]:
            return False
        if leaf == "weight" and value.dtype.itemsize != 1:
            return False  # a linear left in float (ignored layer): the plain path loads it
        if not 0 <= layer < self.L:
            raise ValueError(f"tensor {name!r} names layer {layer}, but the model has {self.L}")
        per_layer = self.parts.setdefault(target, [{} for _ in range(self.L)])
        per_layer[layer][leaf] = value
        return True

    def finish(self) -> tuple[dict[str, QuantizedWeight], dict[str, np.ndarray]]:
        """Returns ({target: stacked QuantizedWeight of numpy arrays}, {"k_scale": [L], ...}).

        Raises:
            ValueError: a layer lacks a tensor (named), or shapes do not fit together.
        """
        weights = {}
        for target, per_layer in self.parts.items():
            weights[target] = self._stack(target, per_layer)
        scales = {}
        if self.keep_kv_scales:
            for which, got in self.kv_scales.items():
                if not got:
                    continue
                missing = [i for i in range(self.L) if i not in got]
                if missing:
                    raise ValueError(f"{which}_scale is missing for layers {missing[:8]}")
                scales[f"{which}_scale"] = np.array([got[i] for i in range(self.L)], np.float32)
        return weights, scales

    def _stack(self, target: str, per_layer: list[dict[str, np.ndarray]]) -> QuantizedWeight:
        method = self.ckpt.method
        required = [c for c in _COMPONENTS[method] if c not in ("g_idx", "input_scale")]
        if method == "fp8":
            required = ["weight"]
        converted = []
        for i, parts in enumerate(per_layer):
            name = f"layer {i} {target}"
            lacking = [c for c in required if c not in parts]
            if lacking:
                raise ValueError(f"checkpoint lacks {', '.join(lacking)} of {name}")
            convert = {"awq": awq_layer, "gptq": gptq_layer, "fp8": fp8_layer}[method]
            converted.append(convert(parts, self.ckpt, name))
        if method == "fp8":
            q, s, inp = zip(*converted, strict=True)
            input_scale = None if inp[0] is None else np.array(inp, np.float32)
            return QuantizedWeight(
                np.stack(q),
                np.stack(s),
                input_scale=input_scale,
                method="fp8",
                in_features=q[0].shape[0],
            )
        q, s, z, perm = zip(*converted, strict=True)
        if len({p is None for p in perm}) > 1:  # some layers act-order, some not
            n_in = q[0].shape[0] * 8
            perm = tuple(np.arange(n_in, dtype=np.int32) if p is None else p for p in perm)
        return QuantizedWeight(
            np.stack(q),
            np.stack(s),
            zeros=np.stack(z),
            perm=None if perm[0] is None else np.stack(perm),
            method=method,
            in_features=q[0].shape[0] * 8,
        )


def check_linear_shapes(weights: dict[str, QuantizedWeight], shapes: dict[str, Any]) -> None:
    """Checks each quantized weight's logical shape against `param_shapes(cfg)["layers"]`."""
    for target, w in weights.items():
        if tuple(w.shape) != tuple(shapes[target]):
            raise ValueError(
                f"quantized layers/{target} has logical shape {tuple(w.shape)}, "
                f"expected {tuple(shapes[target])}"
            )


# ----------------------------------------------------------------------------- safetensors


def read_fp8_tensor(path: Path, name: str) -> np.ndarray:
    """One float8 tensor of a .safetensors file as an ml_dtypes array (safetensors' numpy
    reader has no float8). Format: u64 header length, JSON header, then the raw data."""
    import ml_dtypes

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
    begin, end = info["data_offsets"]
    dtype = np.dtype(getattr(ml_dtypes, _FP8_SAFETENSORS[info["dtype"]]))
    data = np.memmap(path, np.uint8, "r", offset=8 + n + begin, shape=(end - begin,))
    return np.array(data).view(dtype).reshape(info["shape"])


def is_fp8_safetensors_dtype(dtype: str) -> bool:
    return dtype in _FP8_SAFETENSORS


# ----------------------------------------------------------------------------- orbax


def match_saved_layers(saved: dict, abstract: dict, shapes: dict, method: str | None, target):
    """Fits the orbax restore target of `layers/` to what was saved: KV-cache scales [L]
    float32 when present, and a `QuantizedWeight` of the saved leaves for each quantized
    linear weight (its static fields from `method` and `shapes`).

    Args:
        saved: the orbax metadata of `layers/` (name -> array metadata, or a dict of them for
            a quantized weight); KV scales are removed from it.
        abstract: the float target of `layers/`, updated in place.
        shapes: `param_shapes(cfg)["layers"]`.
        method: the conversion's quantization method (its config.json), None if float.
        target: target(name, shape, dtype) -> jax.ShapeDtypeStruct.

    Raises:
        ValueError: quantized params without a method in config.json.
    """
    num_layers = shapes["q_proj"][0]
    for k in ("k_scale", "v_scale"):
        if saved.pop(k, None) is not None:
            abstract[k] = target("layers/" + k, (num_layers,), "float32")
    for k, meta in saved.items():
        if not isinstance(meta, dict) or k not in abstract:
            continue
        if method is None:
            raise ValueError("saved params are quantized, but config.json has no method")
        fields = {
            f: (
                None
                if meta.get(f) is None
                else target(f"layers/{k}/{f}", meta[f].shape, meta[f].dtype)
            )
            for f in ("qweight", "scales", "zeros", "perm", "input_scale")
        }
        abstract[k] = QuantizedWeight(**fields, method=method, in_features=shapes[k][-2])


def quantizing_place(place, method: str, sharding_for=None):
    """The loader's `place(name, value)`, except for the decoder's linear weights and expert
    stacks (`quant.QUANTIZED_WEIGHTS`), which are quantized with a quantize-on-load `method`
    first and placed once, quantized, with their fields' shardings (`sharding_for(name, leaf)`)."""

    def place_and_quantize(name: str, value: np.ndarray):
        if name.startswith("layers/") and name.removeprefix("layers/") in QUANTIZED_WEIGHTS:
            with jax.default_device(jax.devices("cpu")[0]):
                q = jax.device_get(quantize_weight(value, method))
            return place_quantized(q, sharding_for(name, q) if sharding_for else None)
        return place(name, value)

    return place_and_quantize


def place_quantized(w: QuantizedWeight, sharding=None) -> QuantizedWeight:
    """Sends a QuantizedWeight of host arrays to its devices: `sharding` is a QuantizedWeight
    of its fields' shardings (`sharding.rules.ShardingPlan.sharding_for`), or None for the
    default device."""
    if sharding is None:
        return jax.tree.map(jax.device_put, w)
    return jax.tree.map(jax.device_put, w, sharding)
