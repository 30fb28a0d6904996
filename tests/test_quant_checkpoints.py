"""Quantized checkpoints: AWQ and GPTQ folders written here in the published packing layouts
(independently of `pagedjax.models.quant_export`), loaded by the engine's loader and checked
against a straightforward NumPy unpacking; fp8 checkpoints with weight, input and KV-cache
scales; quantized params through orbax; and the errors of contradictory settings.

Layouts written by `_write_int4` (sources named in `pagedjax/models/quant_loader.py`):
AutoAWQ's GEMM packing (`WQLinear_GEMM.from_linear`: eight output columns per int32 in the
order 0, 2, 4, 6, 1, 3, 5, 7; qzeros alike; float16 scales [groups, out]) and AutoGPTQ's
(`QuantLinear.pack`: eight input rows per int32 of qweight, eight output columns per int32 of
qzeros storing zero - 1 in the v1 format; g_idx giving each input row's group).
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import make_checkpoint

from pagedjax.engine_args import EngineArgs
from pagedjax.models import loader, quant_export
from pagedjax.ops import quant

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + order[i]
HF_LINEAR = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@pytest.fixture(scope="module")
def tiny128_dir(tmp_path_factory):
    """A tiny Llama whose every input size (128, 256) divides into groups of 32, 64, 128."""
    folder = tmp_path_factory.mktemp("tiny128")
    return make_checkpoint(folder, hidden_size=128, intermediate_size=256)


def _raw(folder):
    from safetensors.numpy import load_file

    return dict(load_file(str(folder / "model.safetensors")))


def _rtn(w_in_out, g_idx, groups):
    """Round-to-nearest 4-bit with per-group min/max scales (float16) and zero points."""
    scales = np.zeros((groups, w_in_out.shape[1]), np.float16)
    zeros = np.zeros((groups, w_in_out.shape[1]), np.int64)
    for g in range(groups):
        rows = w_in_out[g_idx == g]
        scales[g] = (rows.max(0) - rows.min(0)) / 15
        zeros[g] = np.clip(np.round(-rows.min(0) / scales[g].astype(np.float32)), 1, 15)
    q = np.round(w_in_out / scales[g_idx].astype(np.float32)) + zeros[g_idx]
    return np.clip(q, 0, 15).astype(np.int64), scales, zeros


def _write_int4(src, out, method, group_size, act_order=False, v2=False):
    """Writes `src` (an HF float folder) as an AWQ or GPTQ folder, packing bit by bit."""
    from safetensors.numpy import save_file

    raw, rng = _raw(src), np.random.default_rng(group_size)
    tensors = {}
    for name, value in raw.items():
        module = name.rsplit(".", 1)[0].split(".", 3)[-1] if name.startswith("model.layers") else ""
        if module not in HF_LINEAR.values():
            tensors[name] = value
            continue
        w = value.T.astype(np.float32)  # [in, out]
        n_in, n_out = w.shape
        g_idx = np.arange(n_in) // group_size
        if act_order:
            g_idx = rng.permutation(g_idx)
        q, scales, zeros = _rtn(w, g_idx, n_in // group_size)
        prefix = name.removesuffix(".weight")
        if method == "awq":
            qweight = np.zeros((n_in, n_out // 8), np.int64)
            qzeros = np.zeros((n_in // group_size, n_out // 8), np.int64)
            for col in range(n_out // 8):
                for i in range(8):
                    qweight[:, col] |= q[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
                    qzeros[:, col] |= zeros[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
        else:
            stored_zeros = zeros if v2 else zeros - 1
            qweight = np.zeros((n_in // 8, n_out), np.int64)
            for row in range(n_in // 8):
                for j in range(8):
                    qweight[row] |= q[row * 8 + j] << (4 * j)
            qzeros = np.zeros((n_in // group_size, n_out // 8), np.int64)
            for col in range(n_out // 8):
                for j in range(8):
                    qzeros[:, col] |= stored_zeros[:, col * 8 + j] << (4 * j)
            tensors[prefix + ".g_idx"] = g_idx.astype(np.int32)
        tensors[prefix + ".qweight"] = qweight.astype(np.uint32).view(np.int32)
        tensors[prefix + ".qzeros"] = qzeros.astype(np.uint32).view(np.int32)
        tensors[prefix + ".scales"] = scales
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out)
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        qc.update(zero_point=True, version="gemm")
    else:
        qc.update(desc_act=act_order, sym=False, checkpoint_format="gptq_v2" if v2 else "gptq")
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return out


def _numpy_dequantize(tensors, prefix, method, group_size, v2=False):
    """Straightforward unpacking of one layer's checkpoint tensors to float [in, out]."""
    qweight = tensors[prefix + ".qweight"].view(np.uint32)
    qzeros = tensors[prefix + ".qzeros"].view(np.uint32)
    scales = tensors[prefix + ".scales"].astype(np.float32)
    n_out = scales.shape[1]
    if method == "awq":
        n_in = qweight.shape[0]
        q = np.zeros((n_in, n_out), np.int64)
        z = np.zeros(scales.shape, np.int64)
        for c in range(n_out):
            shift = 4 * AWQ_PACK_ORDER.index(c % 8)
            q[:, c] = (qweight[:, c // 8] >> shift) & 15
            z[:, c] = (qzeros[:, c // 8] >> shift) & 15
        g_idx = np.arange(n_in) // group_size
    else:
        n_in = qweight.shape[0] * 8
        q = np.zeros((n_in, n_out), np.int64)
        for r in range(n_in):
            q[r] = (qweight[r // 8] >> (4 * (r % 8))) & 15
        z = np.zeros(scales.shape, np.int64)
        for c in range(n_out):
            z[:, c] = ((qzeros[:, c // 8] >> (4 * (c % 8))) & 15) + (0 if v2 else 1)
        g_idx = tensors[prefix + ".g_idx"]
    return (q - z[g_idx]).astype(np.float32) * scales[g_idx]


INT4_CASES = {
    "awq-g32": dict(method="awq", group_size=32),
    "awq-g64": dict(method="awq", group_size=64),
    "awq-g128": dict(method="awq", group_size=128),
    "gptq-g32-act-order": dict(method="gptq", group_size=32, act_order=True),
    "gptq-g64": dict(method="gptq", group_size=64),
    "gptq-g128-act-order-v2": dict(method="gptq", group_size=128, act_order=True, v2=True),
}


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_checkpoint_dequantizes_like_numpy(tmp_path, tiny128_dir, case):
    kw = INT4_CASES[case]
    folder = _write_int4(tiny128_dir, tmp_path / case, **kw)
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    method = EngineArgs(model=str(folder)).create_engine_config().model_config.quantization
    assert method == kw["method"]
    params = loader.load_params(source, cfg, quantization=method)
    tensors, float_raw = _raw(folder), _raw(tiny128_dir)
    for target, hf in HF_LINEAR.items():
        w = params["layers"][target]
        assert isinstance(w, quant.QuantizedWeight) and w.group_size == kw["group_size"]
        # One group (in == group_size) has nothing to reorder even with act-order.
        act_order = kw.get("act_order", False) and w.in_features > kw["group_size"]
        assert (w.perm is not None) == act_order
        got = np.asarray(quant.dequantize(w))  # [L, in, out]
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}.{hf}"
            want = _numpy_dequantize(tensors, prefix, kw["method"], kw["group_size"], kw.get("v2"))
            np.testing.assert_array_equal(got[i], want, err_msg=f"{prefix}")
            # And the checkpoint means the float weights, up to one quantization step.
            scale = tensors[prefix + ".scales"].astype(np.float32).max()
            assert np.abs(want - float_raw[prefix + ".weight"].T).max() <= scale
    assert params["layers"]["q_proj"].qweight.dtype == np.int32


def test_quant_export_packs_like_the_published_layouts(tmp_path, tiny128_dir):
    """The benchmark's vectorised writer gives the same bytes as the loop packing above."""
    cfg = loader.load_arch_config(loader.resolve_model_source(str(tiny128_dir)))
    float_params = loader.load_params(loader.resolve_model_source(str(tiny128_dir)), cfg)
    for method, v2 in (("awq", False), ("gptq", False), ("gptq", True)):
        ours = _write_int4(tiny128_dir, tmp_path / f"t-{method}{v2}", method, 64, v2=v2)
        theirs = quant_export.write_int4_checkpoint(
            tmp_path / f"e-{method}{v2}", cfg, float_params, method, 64, gptq_v2=v2
        )
        a, b = _raw(ours), _raw(theirs)
        for name in a:
            if name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"{method} {name}")


def _write_fp8(src, out):
    """An fp8 checkpoint as vLLM's "fp8" method reads it: float8_e4m3fn weights [out, in]
    with per-tensor (attention) or per-channel [out, 1] (MLP) weight_scale, static
    input_scale, and per-layer k_scale / v_scale."""
    import ml_dtypes
    from safetensors.numpy import save_file

    raw = _raw(src)
    tensors = {}
    for name, value in raw.items():
        parts = name.split(".")
        if name.startswith("model.layers") and ".".join(parts[3:5]) in HF_LINEAR.values():
            prefix = name.removesuffix(".weight")
            per_channel = parts[3] == "mlp"
            amax = np.abs(value).max(axis=1, keepdims=True) if per_channel else np.abs(value).max()
            scale = (amax / 448).astype(np.float32)
            tensors[name] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
            tensors[prefix + ".weight_scale"] = np.asarray(scale, np.float32)
            tensors[prefix + ".input_scale"] = np.asarray(0.02, np.float32)
        else:
            tensors[name] = value
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(0.01 * (i + 1), np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray(0.03 * (i + 1), np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, tiny_llama_dir):
    return _write_fp8(tiny_llama_dir, tmp_path_factory.mktemp("fp8") / "ckpt")


def test_fp8_checkpoint_loads_weights_and_scales(fp8_dir):
    import ml_dtypes

    source = loader.resolve_model_source(str(fp8_dir))
    cfg = loader.load_arch_config(source)
    p = loader.load_params(source, cfg, quantization="fp8", kv_cache_dtype="fp8")
    raw = _raw_fp8(fp8_dir)
    for target, hf in HF_LINEAR.items():
        w = p["layers"][target]
        assert w.method == "fp8" and w.qweight.dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(w.input_scale), np.float32([0.02, 0.02]))
        got = np.asarray(quant.dequantize(w))
        for i in range(2):
            prefix = f"model.layers.{i}.{hf}"
            scale = raw[prefix + ".weight_scale"].reshape(-1, 1)  # [1, 1] or [out, 1]
            want = (raw[prefix + ".weight"].astype(np.float32) * scale).T
            np.testing.assert_allclose(got[i], want, rtol=1e-6, err_msg=prefix)
    np.testing.assert_allclose(np.asarray(p["layers"]["k_scale"]), [0.01, 0.02])
    np.testing.assert_allclose(np.asarray(p["layers"]["v_scale"]), [0.03, 0.06])
    # With a KV cache in the model dtype the scales are dropped, as vLLM does.
    p_auto = loader.load_params(source, cfg, quantization="fp8")
    assert "k_scale" not in p_auto["layers"] and "v_scale" not in p_auto["layers"]


def _raw_fp8(folder):
    """The fp8 folder's tensors, read independently of the loader (safetensors via torch)."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if t.dtype == torch.float8_e4m3fn:
            out[name] = t.float().numpy()
        else:
            out[name] = t.numpy()
    return out


@pytest.mark.parametrize("method", ["int8", "w8a8", "fp8", "gptq-act-order"])
def test_quantized_params_round_trip_through_orbax(tmp_path, tiny_llama_dir, tiny128_dir, method):
    if method == "gptq-act-order":
        folder = _write_int4(tiny128_dir, tmp_path / "gptq", "gptq", 32, act_order=True)
        method = "gptq"
    else:
        folder = tiny_llama_dir
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    params = loader.load_params(source, cfg, quantization=method)
    out = tmp_path / "converted"
    loader.save_converted(out, cfg, params, tokenizer=None)
    conv = loader.resolve_model_source(str(out))
    assert EngineArgs(model=str(out)).create_engine_config().model_config.quantization == method
    restored = loader.load_params(conv, cfg, quantization=method)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A float conversion quantizes on load instead (here: int8 over the float params).
    if method == "int8":
        plain = tmp_path / "plain"
        loader.save_converted(plain, cfg, loader.load_params(source, cfg), tokenizer=None)
        again = loader.load_params(
            loader.resolve_model_source(str(plain)), cfg, quantization="int8"
        )
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _config_error(model, **kw):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=str(model), **kw).create_engine_config()
    return str(e.value)


def test_contradictory_settings_are_refused(tmp_path, tiny_llama_dir, tiny128_dir):
    assert "needs a checkpoint quantized" in _config_error(tiny_llama_dir, quantization="awq")
    assert "int4" in _config_error(tiny_llama_dir, quantization="int4")
    assert "kv_cache_dtype" in _config_error(tiny_llama_dir, kv_cache_dtype="int8")
    assert "gguf" in _config_error(tiny_llama_dir, quantization="gguf")
    awq = _write_int4(tiny128_dir, tmp_path / "awq", "awq", 64)
    assert "does not match" in _config_error(awq, quantization="gptq")
    # vLLM's Marlin names read the same files.
    cfg = EngineArgs(model=str(awq), quantization="awq_marlin").create_engine_config()
    assert cfg.model_config.quantization == "awq"
    config = json.loads((awq / "config.json").read_text())
    for edit, match in (
        ({"bits": 8}, "bits=8"),
        ({"version": "gemv"}, "gemv"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"group_size": 48}, "group_size=48"),
    ):
        bad = tmp_path / f"bad-{match}"
        shutil.copytree(awq, bad)
        config_bad = {**config, "quantization_config": {**config["quantization_config"], **edit}}
        (bad / "config.json").write_text(json.dumps(config_bad))
        source = loader.resolve_model_source(str(bad))
        with pytest.raises(ValueError, match=match):
            cfg = loader.load_arch_config(source)
            loader.load_params(source, cfg, quantization=edit.get("quant_method", "awq"))
    from safetensors.numpy import save_file

    raw = _raw(awq)
    del raw["model.layers.1.mlp.up_proj.qzeros"]
    save_file(raw, str(awq / "model.safetensors"))
    source = loader.resolve_model_source(str(awq))
    with pytest.raises(ValueError, match="qzeros of layer 1 up_proj"):
        loader.load_params(source, loader.load_arch_config(source), quantization="awq")
