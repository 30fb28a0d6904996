"""Stacking per-layer checkpoint tensors into a model's params pytree
(`param_shapes` of the architecture's model module, `models.registry`).

`StackedParams` is filled tensor by tensor (global weights, and one layer of a stacked
[L, ...] weight at a time), checking names and shapes as it goes; each stacked weight is
handed to `place` (e.g. sent to the device) as soon as all its layers are in, so the host
holds at most one stacked weight. The checkpoint formats' name routing lives with their
readers (`hf_checkpoint`, `gguf_file`).

A GGUF tensor kept quantized (`gguf_file.RawBlocks`, recognised by its `weight` method) becomes
an `ops.gguf_quant.GGUFWeight`; a stacked weight whose layers use different block formats
(mixed files, e.g. Q4_K_M's Q6_K layers) cannot be one stack and is dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pagedjax.models import registry
from pagedjax.models.arch_config import DecoderArchConfig


class StackedParams:
    """Fills the params pytree tensor by tensor, checking names and shapes as it goes."""

    def __init__(self, cfg: DecoderArchConfig, dtype, place: Callable[[str, np.ndarray], Any]):
        self.cfg, self.dtype, self.place = cfg, np.dtype(dtype), place
        model = registry.get_model(cfg.architecture)
        self.shapes = model.param_shapes(cfg)
        # Stacked params the checkpoint lacks in some layers (zeros there), e.g. the expert
        # stacks of a mixture-of-experts model's dense layers.
        absent = getattr(model, "absent_layer_params", None)
        self.absent: dict[str, tuple[int, ...]] = absent(cfg) if absent else {}
        self.params: dict[str, Any] = {"layers": {}}
        self._bufs: dict[str, np.ndarray] = {}
        self._filled: dict[str, set[int]] = {}
        self._experts: dict[tuple[str, int], set[int]] = {}
        self._raw: dict[str, dict[int, Any]] = {}  # GGUF blocks of a stack, by layer

    def set_global(self, name: str, value: np.ndarray, source_name: str) -> None:
        if name not in self.shapes:
            raise ValueError(f"unexpected tensor {source_name!r} for this architecture")
        check_shape(source_name, value.shape, self.shapes[name])
        if hasattr(value, "weight"):  # GGUF blocks kept quantized
            self.params[name] = self.place(name, value.weight())
            return
        self.params[name] = self.place(name, np.asarray(value, self.dtype))

    def _layer_shape(self, name: str, layer: int, source_name: str) -> tuple[int, ...]:
        shape = self.shapes["layers"].get(name)
        if shape is None:
            raise ValueError(f"unexpected tensor {source_name!r} for this architecture")
        if not 0 <= layer < self.cfg.num_hidden_layers:
            raise ValueError(
                f"tensor {source_name!r} names layer {layer}, but the model has "
                f"{self.cfg.num_hidden_layers} layers"
            )
        return shape

    def _layer_buf(self, name: str, layer: int, source_name: str) -> np.ndarray:
        shape = self._layer_shape(name, layer, source_name)
        buf = self._bufs.get(name)
        if buf is None:
            absent = self.absent.get(name, ())
            buf = self._bufs[name] = (np.zeros if absent else np.empty)(shape, self.dtype)
            self._filled[name] = set(absent)
        return buf

    def _layer_done(self, name: str, layer: int) -> None:
        self._filled[name].add(layer)
        if len(self._filled[name]) == self.cfg.num_hidden_layers:
            self.params["layers"][name] = self.place("layers/" + name, self._bufs.pop(name))

    def set_layer(self, name: str, layer: int, value: np.ndarray, source_name: str) -> None:
        if hasattr(value, "weight"):  # GGUF blocks kept quantized
            shape = self._layer_shape(name, layer, source_name)
            check_shape(source_name, value.shape, shape[1:])
            self._set_raw_layer(name, layer, value)
            return
        buf = self._layer_buf(name, layer, source_name)
        check_shape(source_name, value.shape, buf.shape[1:])
        buf[layer] = value
        self._layer_done(name, layer)

    def set_expert(
        self, name: str, layer: int, expert: int, value: np.ndarray, source_name: str
    ) -> None:
        """One expert's weight of a stacked [L, E, ...] expert weight."""
        buf = self._layer_buf(name, layer, source_name)
        if not 0 <= expert < buf.shape[1]:
            raise ValueError(
                f"tensor {source_name!r} names expert {expert}, but the model has "
                f"{buf.shape[1]} experts"
            )
        check_shape(source_name, value.shape, buf.shape[2:])
        buf[layer, expert] = value
        have = self._experts.setdefault((name, layer), set())
        have.add(expert)
        if len(have) == buf.shape[1]:
            self._layer_done(name, layer)

    def _set_raw_layer(self, name: str, layer: int, value) -> None:
        raw = self._raw.setdefault(name, {})
        raw[layer] = value
        self._filled.setdefault(name, set()).add(layer)
        if len(raw) < self.cfg.num_hidden_layers:
            return
        layers = [raw.pop(i) for i in range(self.cfg.num_hidden_layers)]
        del self._raw[name]
        if len({w.qtype for w in layers}) == 1:
            first = layers[0].weight()
            stacked = first.replace(blocks=np.stack([w.data for w in layers]))
            self.params["layers"][name] = self.place("layers/" + name, stacked)
        else:  # mixed formats: one float stack
            value = np.stack([np.asarray(w.dequantized(), self.dtype) for w in layers])
            self.params["layers"][name] = self.place("layers/" + name, value)

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


def check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")
