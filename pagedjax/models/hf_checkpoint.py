"""Reading Hugging Face safetensors checkpoints: streaming their tensors (single file or
sharded with an index; fp8 tensors through `quant_loader`) and routing each HF tensor name
to its place in the params pytree (`assign_hf`). Fused projections (Phi-3's `qkv_proj` and
`gate_up_proj`) are split on load into the usual q/k/v and gate/up weights."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pagedjax.models import quant_loader
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.hf_format import (
    HF_EXPERT_NAMES,
    HF_FUSED_LAYER_NAMES,
    HF_LAYER_NAMES,
    HF_ROUTER_NAMES,
)
from pagedjax.models.sources import safetensors_files
from pagedjax.models.stacking import StackedParams

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# An expert's weight: `block_sparse_moe.experts.<j>.w1.weight`, `mlp.experts.<j>.up_proj.weight`.
_HF_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(.+)$")
# transformers 5's fused expert stacks: gate_up_proj [E, 2 Fe, D], down_proj [E, D, Fe].
_HF_FUSED_EXPERTS = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")


def hf_tensors(folder: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of the folder's checkpoint, one at a time.

    Raises:
        ValueError: no *.safetensors file, or shards the index lists are missing.
    """
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
        paths = safetensors_files(folder_p)
        if not paths:
            raise ValueError(f"no *.safetensors file in {folder!r}")
    for path in paths:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if quant_loader.is_fp8_safetensors_dtype(f.get_slice(name).get_dtype()):
                    yield name, quant_loader.read_fp8_tensor(path, name)
                else:
                    yield name, f.get_tensor(name)


def assign_hf(stack: StackedParams, cfg: DecoderArchConfig, name: str, value) -> None:
    """Routes one HF tensor (torch layout [out, in]) to its place in the pytree."""
    if name.endswith("rotary_emb.inv_freq"):
        return  # a buffer some old checkpoints saved; recomputed from the config
    if (m := _HF_LAYER.match(name)) and m.group(2) in HF_FUSED_LAYER_NAMES:
        layer = int(m.group(1))
        for target, part in split_fused(stack, HF_FUSED_LAYER_NAMES[m.group(2)], value, name):
            stack.set_layer(target, layer, part.T, name)
    elif m and assign_moe(stack, int(m.group(1)), m.group(2), value, name):
        return
    elif m:
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


def assign_moe(stack: StackedParams, layer: int, rest: str, value, name: str) -> bool:
    """Routes a mixture-of-experts tensor of layer `layer` (`rest`: its name after
    `model.layers.<i>.`) to the router or an expert stack; False if it is none of them."""
    if rest in HF_ROUTER_NAMES:
        stack.set_layer("router", layer, value.T, name)
        return True
    if (e := _HF_EXPERT.match(rest)) and e.group(2) in HF_EXPERT_NAMES:
        stack.set_expert(HF_EXPERT_NAMES[e.group(2)], layer, int(e.group(1)), value.T, name)
        return True
    if f := _HF_FUSED_EXPERTS.match(rest):
        value = np.swapaxes(value, -1, -2)  # [E, in, out]
        if f.group(1) == "down_proj":
            stack.set_layer("experts_down", layer, value, name)
        else:
            gate, up = np.split(value, 2, axis=-1)
            stack.set_layer("experts_gate", layer, gate, name)
            stack.set_layer("experts_up", layer, up, name)
        return True
    return False


def split_fused(
    stack: StackedParams, targets: tuple[str, ...], value: np.ndarray, name: str
) -> list[tuple[str, np.ndarray]]:
    """Splits a fused projection [sum of outs, in] (torch layout) into its parts' rows, in
    the order of `targets` (e.g. q_proj, k_proj, v_proj), each part as many rows as its
    weight has output columns.

    Raises:
        ValueError: the fused tensor's rows are not the parts' total (the message names it),
            or the architecture has no such weights.
    """
    layer_shapes = stack.shapes["layers"]
    if any(t not in layer_shapes for t in targets):
        raise ValueError(f"unexpected tensor {name!r} for this architecture")
    sizes = [layer_shapes[t][-1] for t in targets]
    if value.ndim != 2 or value.shape[0] != sum(sizes):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(value.shape)}, expected ({sum(sizes)}, ...): "
            f"{' + '.join(f'{t} {n}' for t, n in zip(targets, sizes, strict=True))} rows"
        )
    parts = np.split(value, np.cumsum(sizes)[:-1], axis=0)
    return list(zip(targets, parts, strict=True))
