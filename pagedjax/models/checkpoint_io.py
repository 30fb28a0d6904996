"""Saving and restoring params with orbax-checkpoint, and writing reloadable converted folders
(`save_converted`: config.json, the tokenizer, params/ and the conversion marker; `publish_folder`
puts a cache folder in place whole, so that processes filling the cache at once never read a
half-written one)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.models import quant_loader, registry
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.hf_format import hf_config_dict
from pagedjax.models.sources import CONVERTED_MARKER
from pagedjax.ops import cpu_linear, quant
from pagedjax.ops.fused_projections import split_projections


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
    cfg: DecoderArchConfig,
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
    shapes = registry.get_model(cfg.architecture).param_shapes(cfg)
    device = jax.devices()[0]

    def target(name, shape, leaf_dtype=None):
        sharding = (
            sharding_for(name, ndim=len(shape)) if sharding_for else None
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
    out: str | Path, cfg: DecoderArchConfig, params: dict[str, Any], tokenizer, origin: str = ""
) -> None:
    """Writes a reloadable folder: config.json, the tokenizer, params/ and a marker file.
    A running engine's params may be given: pre-packed weights are saved as [L, in, out], fused
    projections as their parts."""
    params = cpu_linear.unpack_params(split_projections(params, cfg), cfg.tie_word_embeddings)
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
    with open(out / CONVERTED_MARKER, "w") as f:
        json.dump({"origin": origin}, f)


def publish_folder(out: str | Path, write: Callable[[Path], None], complete_file: str) -> Path:
    """Writes a cache folder whole: `write(tmp)` fills a temporary sibling of `out`, which is
    then renamed to `out`. If another process published `out` first, its folder stays and
    this one is dropped (both wrote the same content), so a reader never sees a folder
    being written. An `out` without `complete_file` (left by an interrupted writer of an
    older version, which wrote in place) is replaced.

    Raises:
        whatever `write` raises (the temporary folder is removed).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # `out` exists: published meanwhile, or an incomplete leftover
            if not (out / complete_file).exists():
                shutil.rmtree(out, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
