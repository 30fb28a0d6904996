"""Loading a model: the public entry points (`resolve_model_source`, `load_arch_config`,
`load_params`, `load_tokenizer`, `converted_gguf_source`, `save_converted`, ...), and
`load_params` itself, which streams a checkpoint's tensors into the params pytree.

Each concern has its module; the names are re-exported here:
    sources        what a path names ("hf", "gguf", "orbax"), the default model;
    hf_checkpoint  reading Hugging Face safetensors checkpoints;
    gguf_file      reading GGUF files (dequantized to float32 by `gguf`);
    stacking       filling the [L, ...] stacked params pytree tensor by tensor;
    checkpoint_io  orbax params and converted folders (`save_converted`);
    tokenizer      the Hugging Face tokenizer of a source.

Tensors are read one at a time and written into per-weight stacked host buffers
([L, ...], the layout of the architecture's model module, `models.registry`), each sent to
the device once complete, so the host never holds more than the checkpoint's memory map and
one stacked weight.

A GGUF file is loaded with its quantized tensors kept in their blocks (`quantization="gguf"`,
the engine's default for a GGUF file: `gguf_file.RawBlocks` -> `ops.gguf_quant.GGUFWeight`),
or dequantized: converted once into an orbax folder under the cache directory (dequantizing
and building the tokenizer from GGUF metadata takes tens of seconds); later loads of the
same file (same path, size and mtime) read that folder.

Quantization (`load_params(..., quantization=)`, details in `models.quant_loader`): AWQ, GPTQ
and fp8 checkpoints are read in their published layouts; "int8", "w8a8" and "fp8" quantize
float weights on load, one stacked weight at a time on the device; `save_converted` writes
quantized params too, so that quantizing on load happens once.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models import quant_loader, registry
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.checkpoint_io import (
    publish_folder,
    restore_params,
    save_converted,
    save_params,
)
from pagedjax.models.gguf_file import assign_gguf, gguf_arch_config, gguf_reader, gguf_tensors
from pagedjax.models.hf_checkpoint import assign_hf, hf_tensors
from pagedjax.models.sources import (
    CONVERTED_MARKER,
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_model_path,
    resolve_model_source,
)
from pagedjax.models.stacking import StackedParams
from pagedjax.models.tokenizer import load_tokenizer
from pagedjax.ops import quant
from pagedjax.ops.gguf_quant import GGUFWeight
from pagedjax.paths import cache_root, file_fingerprint

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelSource",
    "checkpoint_dtype",
    "converted_gguf_source",
    "gguf_tokenizer",
    "default_model_path",
    "load_arch_config",
    "load_params",
    "load_tokenizer",
    "resolve_model_source",
    "restore_params",
    "save_converted",
    "save_params",
]

logger = logging.getLogger(__name__)

_CONVERSION_VERSION = 2  # bump when the layout of converted folders changes


# ----------------------------------------------------------------------------- configs


def load_arch_config(source: ModelSource) -> DecoderArchConfig:
    """Reads the architecture hyper-parameters of a source (a config.json through
    `registry.arch_config_from_hf`: the family's config class).

    Raises:
        ValueError: unsupported architecture (named), or a malformed config.
    """
    if source.kind == "gguf":
        return gguf_arch_config(gguf_reader(source.path))
    with open(Path(source.path) / "config.json") as f:
        return registry.arch_config_from_hf(json.load(f))


def checkpoint_dtype(source: ModelSource) -> str:
    """The dtype the checkpoint's config declares ("float32" for GGUF, dequantized)."""
    if source.kind == "gguf":
        return "float32"
    with open(Path(source.path) / "config.json") as f:
        d = json.load(f)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- params


def _default_place(sharding_for: Callable[[str], Any] | None):
    def place(name: str, value: np.ndarray):
        sharding = sharding_for(name) if sharding_for else None
        return jax.device_put(value, sharding)

    return place


def _gguf_place(place):
    """`place` for a load that keeps GGUF blocks: a `GGUFWeight` goes to the default device."""

    def place_gguf(name: str, value):
        if isinstance(value, GGUFWeight):
            return jax.tree.map(jax.device_put, value)
        return place(name, value)

    return place_gguf


def load_params(
    source: ModelSource,
    cfg: DecoderArchConfig,
    dtype: str = "float32",
    sharding_for: Callable[..., Any] | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Loads a source's weights into its model's params pytree on the device.

    Args:
        source: from `resolve_model_source`.
        cfg: the source's architecture.
        dtype: "float32", "bfloat16" or "float16"; weights are converted on the host.
        sharding_for: optional `fn(name, leaf=None, ndim=None)` from a param path
            ("layers/q_proj") to its final jax Sharding (`ShardingPlan.sharding_for`; for a
            QuantizedWeight leaf, a QuantizedWeight of its fields' shardings): every weight
            is placed once, with it, as it is read.
        quantization: None, or a method of `ops.choices.QUANTIZATION_METHODS` as
            `resolve_quantization` returns it: the checkpoint's own ("awq", "gptq", "fp8", or a
            saved conversion's), or "int8" / "w8a8" / "fp8" to quantize float weights on load
            "gguf": a GGUF file's quantized tensors kept in their blocks
            (`ops.gguf_quant.GGUFWeight`, on the default device; other tensors in `dtype`).
        kv_cache_dtype: "auto" drops a checkpoint's KV-cache scales; a float8 cache keeps
            them as `layers/k_scale`, `layers/v_scale` [L] float32.

    Raises:
        ValueError: a missing file or tensor, an unexpected tensor, or a wrong shape; the
            message names it. A quantization the checkpoint contradicts.
    """
    np_dtype = jnp.dtype(dtype)
    place = _default_place(sharding_for)
    keep_gguf = quantization == "gguf" and source.kind == "gguf"
    quantization = None if quantization == "gguf" else quantization
    if keep_gguf:
        place = _gguf_place(place)
    ckpt_q = quant_loader.checkpoint_quantization(source)
    if ckpt_q is not None and quantization not in (None, ckpt_q.method):
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's {ckpt_q.method!r}"
        )
    on_load = quantization if ckpt_q is None else None  # quantize float weights on load
    keep_kv_scales = kv_cache_dtype != "auto"
    if source.kind == "orbax":
        params = restore_params(
            Path(source.path) / "params",
            cfg,
            dtype,
            sharding_for,
            quant_method=ckpt_q.method if ckpt_q else None,
        )
        if not keep_kv_scales:
            params["layers"] = {
                k: v for k, v in params["layers"].items() if k not in ("k_scale", "v_scale")
            }
        if on_load:  # float params restored: quantize, and place each result where it goes
            for name in quant.QUANTIZED_WEIGHTS:
                if name not in params["layers"] or isinstance(
                    params["layers"][name], quant.QuantizedWeight
                ):
                    continue
                q = jax.device_get(quant.quantize_weight(params["layers"][name], on_load))
                sharding = sharding_for("layers/" + name, q) if sharding_for else None
                params["layers"][name] = quant_loader.place_quantized(q, sharding)
        return params
    if on_load:
        place = quant_loader.quantizing_place(place, on_load, sharding_for)
    stack = StackedParams(cfg, np_dtype, place)
    collector = quant_loader.QuantTensorCollector(cfg.num_hidden_layers, ckpt_q, keep_kv_scales)
    if source.kind == "hf":
        for name, value in hf_tensors(source.path):
            if not collector.accept(name, value):
                assign_hf(stack, cfg, name, value)
    else:
        for name, value in gguf_tensors(source.path, keep_quantized=keep_gguf):
            assign_gguf(stack, cfg, name, value)
    weights, kv_scales = collector.finish()
    quant_loader.check_linear_shapes(weights, stack.shapes["layers"])
    for target, w in weights.items():
        sharding = sharding_for("layers/" + target, w) if sharding_for else None
        stack.params["layers"][target] = quant_loader.place_quantized(w, sharding)
    for name, value in kv_scales.items():
        sharding = sharding_for("layers/" + name) if sharding_for else None
        stack.params["layers"][name] = jax.device_put(value, sharding)
    return stack.finish(f"checkpoint {source.path!r}")


# ----------------------------------------------------------------------------- GGUF conversion


def _file_fingerprint(path: str) -> str:
    return file_fingerprint(path, f"v{_CONVERSION_VERSION}")


def gguf_tokenizer(source: ModelSource, download_dir: str | None = None):
    """The tokenizer of a GGUF file, built from its metadata once (seconds) and kept in a
    folder under the cache directory for later loads (a load that keeps the weights quantized
    reads no conversion)."""
    from transformers import AutoTokenizer

    out = (
        cache_root(download_dir) / "tokenizers" / f"{source.name}-{_file_fingerprint(source.path)}"
    )
    if (out / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(out))
    tokenizer = load_tokenizer(source)
    with contextlib.suppress(OSError):
        publish_folder(out, lambda t: tokenizer.save_pretrained(str(t)), "tokenizer_config.json")
    return tokenizer


def converted_gguf_source(source: ModelSource, download_dir: str | None = None) -> ModelSource:
    """The orbax conversion of a GGUF file, writing it first if it is not there yet."""
    out = cache_root(download_dir) / "converted" / f"{source.name}-{_file_fingerprint(source.path)}"
    if (out / CONVERTED_MARKER).exists():
        if not (out / "tokenizer_config.json").exists():  # a conversion made without one
            with contextlib.suppress(Exception):
                load_tokenizer(source).save_pretrained(str(out))
        return ModelSource("orbax", str(out))
    logger.info("converting %s once into %s (later loads are fast)", source.path, out)
    cfg = load_arch_config(source)
    params = load_params(source, cfg, "float32")
    try:
        tokenizer = load_tokenizer(source)
    except Exception as e:  # a GGUF without tokenizer metadata still has usable weights
        logger.warning("no tokenizer in %s (%s); pass tokenizer=<folder>", source.path, e)
        tokenizer = None
    publish_folder(
        out, lambda t: save_converted(t, cfg, params, tokenizer, source.path), CONVERTED_MARKER
    )
    return ModelSource("orbax", str(out))
