"""Reading GGUF files (llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3 as llama.cpp's
converter writes them): the
architecture from the metadata, the tensors dequantized to float32 by the `gguf` package, and
the routing of GGUF tensor names into the params pytree (`assign_gguf`).

What differs between the architectures' files:
    llama  Q/K rows reordered by the converter (its RoPE rotates adjacent pairs; undone here);
    qwen2  q/k/v biases; rows stored as in Hugging Face (llama.cpp runs it with NeoX RoPE);
    qwen3  per-head q/k norms (`attn_q_norm`, `attn_k_norm`), `attention.key_length` the head
           dim; rows as in Hugging Face;
    qwen3moe  qwen3's attention; every layer a mixture of experts: the router
           `ffn_gate_inp` [E, D] and the expert stacks `ffn_gate_exps` / `ffn_up_exps`
           [E, Fe, D], `ffn_down_exps` [E, D, Fe] (torch order; ggml's is reversed), with
           `expert_count`, `expert_used_count`, `expert_feed_forward_length`. The format has
           no dense layers (no `mlp_only_layers`: llama.cpp runs experts on every layer) and
           no `norm_topk_prob`: the top-k weights are renormalised, as llama.cpp and
           transformers' GGUF reader do. Mixtral (llama.cpp's "llama" with `expert_count`)
           and qwen2moe are refused;
    phi3   fused `attn_qkv` (q, k, v rows) and `ffn_up` holding gate then up rows, split on
           load; a window on every layer when `attention.sliding_window` is not 0; LongRoPE
           (`rope_factors_long` / `rope_factors_short` tensors) refused;
    gemma2 / gemma3  every RMSNorm weight stored as (w + 1) (llama.cpp's Gemma norms scale by
           the stored weight; Hugging Face's by 1 + w): 1 is subtracted on load. The four
           norms of a layer are `attn_norm`, `post_attention_norm` (the attention output's),
           `ffn_norm` (before the MLP), `post_ffw_norm`; gemma3 adds `attn_q_norm` /
           `attn_k_norm`. What the file does not say is llama.cpp's: sliding-window layers
           every other one from layer 0 (gemma2) or five of every six (gemma3), when
           `attention.sliding_window` is there and not 0; gemma3's local RoPE base 10000; the
           softmax scale head_dim ** -0.5 (`attention.key_length`), hidden / heads for the
           27B models (46 gemma2 layers, 62 gemma3 layers); a tanh-approximate GELU.

Quantized tensors kept as in the file (`gguf_tensors(path, keep_quantized=True)`, the engine's
default for a GGUF file): a 2-D tensor in one of `ops.gguf_quant.GGUF_FORMATS` comes as a
`RawBlocks` (its rows of blocks), which the routing above moves like an array (rows split,
Q/K rows reordered) and `stacking.StackedParams` turns into an `ops.gguf_quant.GGUFWeight`;
other tensors (F32 norms, F16 or other quantized formats) are dequantized to float32, and so
are the 3-D expert stacks and the router of a qwen3moe file, whatever their format (the
expert matmul, `ops.linear.expert_linear`, takes no GGUF blocks): a kept load holds them in
the load's dtype, its attention weights, embedding and head as blocks.

Named `gguf_file` rather than `gguf` so that it is never mistaken for the `gguf` package.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterator

import numpy as np

from pagedjax.models import registry
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.gguf_index import open_gguf
from pagedjax.models.hf_checkpoint import split_fused
from pagedjax.models.stacking import StackedParams
from pagedjax.ops.gguf_quant import GGUF_FORMATS, GGUFWeight

# general.architecture -> the Hugging Face architecture of the family that runs it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# The architectures whose Q/K rows llama.cpp's converter reorders (its LlamaModel); the
# others' converters write the Hugging Face rows as they are.
_PERMUTED_QK = frozenset({"LlamaForCausalLM"})

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
    "attn_output.bias": "o_bias",
    "attn_q_norm.weight": "q_norm",  # qwen3
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
# Mixture-of-experts tensors (qwen3moe): [E, D] or [E, out, in], each transposed on its
# last two axes into the router [D, E] or the expert stack [E, in, out] of one layer.
_GGUF_MOE_NAMES = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "experts_gate",
    "ffn_up_exps.weight": "experts_up",
    "ffn_down_exps.weight": "experts_down",
}
# Fused tensors -> the layer params their rows split into, in order; by architecture.
_GGUF_FUSED = {"attn_qkv.weight": ("q_proj", "k_proj", "v_proj")}
_GGUF_FUSED_BY_ARCH = {"Phi3ForCausalLM": {"ffn_up.weight": ("gate_proj", "up_proj")}}
# Gemma's layer norms: the norm of the attention output, then the two around the MLP.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "pre_ffn_norm",
    "post_ffw_norm.weight": "post_ffn_norm",
}
# The architectures whose converter stores every RMSNorm weight as (w + 1).
_NORM_PLUS_ONE = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})
_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens", "output_norm.weight": "final_norm"}
# Tensors that carry a RoPE variant this engine does not run.
_UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "Llama 3.1 RoPE scaling",
    "rope_factors_long.weight": "Phi-3 LongRoPE",
    "rope_factors_short.weight": "Phi-3 LongRoPE",
}


def gguf_reader(path: str):
    """The file's metadata fields and tensors (`fields.get(key)`, `tensors`), opened once per
    process while the file is unchanged (same path, inode, size and modification time).

    `gguf.GGUFReader` parses every metadata field in Python when it opens the file (the default
    model's 49,152 tokens and 48,900 merges: ~3.4 s on these machines), and a load reads the
    file twice (its architecture, then its tensors): engines built in one process from one
    file share the open, and processes after the first read the file's index from the cache
    directory instead of parsing it (`gguf_index`: a `GGUFIndex`, with the reader's
    interface). The file is mapped read-only; callers copy what they keep.
    """
    st = os.stat(path)
    return _open_reader(os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, inode: int, size: int, mtime_ns: int):
    return open_gguf(path)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch_config(reader) -> DecoderArchConfig:
    """The architecture a GGUF file's metadata describes, as its family's config class.

    Raises:
        ValueError: an architecture other than those of `GGUF_ARCHITECTURES` (named), a
            mixture-of-experts file of another architecture than qwen3moe (Mixtral's "llama"
            with `expert_count`, qwen2moe; named), or a feature the engine does not run
            (named): Llama 3.1 RoPE scaling, Phi-3 LongRoPE, RoPE on part of each head, a RoPE
            scaling type other than linear.
    """
    arch = _field(reader, "general.architecture")
    hf_arch = GGUF_ARCHITECTURES.get(arch)
    if arch == "qwen2moe" or (arch != "qwen3moe" and _field(reader, f"{arch}.expert_count", 0)):
        # llama.cpp writes Mixtral as "llama" with expert_count
        raise ValueError(
            f"GGUF mixture-of-experts files of architecture {arch!r} are not supported "
            "(of GGUF MoE files, only qwen3moe); load the Hugging Face safetensors folder "
            "(e.g. MixtralForCausalLM) instead"
        )
    if hf_arch is None:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    for name, what in _UNSUPPORTED_TENSORS.items():
        if name in names:
            raise ValueError(f"GGUF tensor {name!r} ({what}) is not supported")

    def key(k, default=None):
        return _field(reader, f"{arch}.{k}", default)

    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    rope_dims = key("rope.dimension_count")
    head_dim = int(key("attention.key_length") or rope_dims or hidden // heads)
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count {rope_dims} (RoPE on part of each head of "
            f"{head_dim}) is not supported"
        )
    value_dim = key("attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ValueError(
            f"GGUF {arch}.attention.value_length {value_dim} differs from the key length "
            f"{head_dim}; not supported"
        )
    window = int(key("attention.sliding_window", 0) or 0) if arch == "phi3" else 0
    L = int(key("block_count"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=hf_arch,
        vocab_size=int(key("vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length") or key("expert_feed_forward_length")),
        num_hidden_layers=L,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(arch, key),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        max_position_embeddings=int(key("context_length", 2048)),
        sliding_window=window or None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    if arch in ("gemma2", "gemma3"):
        fields.update(_gemma_fields(arch, key, L, hidden // heads, head_dim))
    if arch == "qwen3moe":
        fields.update(_qwen3moe_fields(reader, key))
    return registry.get_model(hf_arch).ArchConfig(**fields)


def _gemma_fields(arch: str, key, num_layers: int, hidden_per_head: int, head_dim: int):
    """The Gemma config fields of a gemma2 / gemma3 file: from its keys where the converter
    writes them, else as llama.cpp runs the architecture (which these files are made for)."""
    window = int(key("attention.sliding_window", 0) or 0)
    pattern = 2 if arch == "gemma2" else 6  # llama.cpp's swa pattern: the last of each is global
    sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
    # llama.cpp's softmax scale: hidden / heads for the 27B models (known by layer count)
    is_27b = num_layers == (46 if arch == "gemma2" else 62)
    fields = dict(
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(hidden_per_head if is_27b else head_dim),
        final_logit_softcap=_cap(key("final_logit_softcapping")),
        attn_logit_softcap=_cap(key("attn_logit_softcapping")) if arch == "gemma2" else None,
        sliding_window=window or None,
        sliding_layers=sliding if window and sliding else None,
    )
    if arch == "gemma3":  # rope.freq_base is the global layers'; the local ones' 10000
        fields.update(rope_theta=_f32(key("rope.freq_base", 1_000_000.0)), rope_local_theta=10000.0)
    return fields


def _qwen3moe_fields(reader, key) -> dict:
    """The mixture-of-experts fields of a qwen3moe file: experts on every layer, the top-k
    weights renormalised (llama.cpp's qwen3moe graph; transformers' GGUF default), the expert
    MLP size from `expert_feed_forward_length`, else from the `ffn_gate_exps` stack."""
    size = key("expert_feed_forward_length")
    if not size:  # ggml's shape of [E, Fe, D]: (D, Fe, E)
        gate = [t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight"]
        if not gate:
            raise ValueError("GGUF qwen3moe file without blk.0.ffn_gate_exps.weight")
        size = gate[0].shape[1]
    return dict(
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(size),
        norm_topk_prob=True,
        sparse_layers=None,
        qk_norm=True,
    )


def _cap(value) -> float | None:
    return _f32(value) if value else None


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest decimal that rounds to the same float32."""
    return float(str(np.float32(x)))


def _rope_scaling(arch: str, key) -> tuple[tuple[str, object], ...] | None:
    """`rope_scaling` items from `<arch>.rope.scaling.*`: none, or linear with its factor.

    Raises:
        ValueError: another scaling type (e.g. yarn), named.
    """
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return (("factor", _f32(key("rope.scaling.factor", 1.0))), ("rope_type", "linear"))
    raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported; only linear")


@dataclasses.dataclass(frozen=True)
class RawBlocks:
    """A GGUF tensor kept in its quantized blocks: a weight [N, K] (torch layout) as N rows.

    Attributes:
        data: uint8 [N, row_bytes], row n the K values of row n in blocks of `qtype`.
        qtype: a key of `ops.gguf_quant.GGUF_FORMATS`.
        k: K, the values per row.
        transposed: True once `.T` was taken (the [K, N] = [in, out] view the params hold);
            it changes `shape` only, the blocks stay rows of N.
    """

    data: np.ndarray
    qtype: str
    k: int
    transposed: bool = False
    ndim = 2

    @property
    def shape(self) -> tuple[int, int]:
        n = self.data.shape[0]
        return (self.k, n) if self.transposed else (n, self.k)

    @property
    def T(self) -> RawBlocks:  # noqa: N802 (numpy's name)
        return dataclasses.replace(self, transposed=not self.transposed)

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> RawBlocks:
        """The same tensor with its rows rearranged by fn (uint8 [N, B] -> [N', B])."""
        return dataclasses.replace(self, data=np.ascontiguousarray(fn(self.data)))

    def dequantized(self) -> np.ndarray:
        """float32 in this view's shape (by `gguf.quants.dequantize`)."""
        import gguf
        from gguf.quants import dequantize

        w = dequantize(self.data, gguf.GGMLQuantizationType[self.qtype])
        return w.T if self.transposed else w

    def weight(self) -> GGUFWeight:
        """The `GGUFWeight` (host arrays) of these rows: logical shape [K, N]."""
        return GGUFWeight(self.data, self.qtype, self.k)


def gguf_tensors(
    path: str, keep_quantized: bool = False
) -> Iterator[tuple[str, np.ndarray | RawBlocks]]:
    """(name, float32 array) for every tensor of the file, dequantized one at a time; with
    `keep_quantized`, a 2-D tensor in one of GGUF_FORMATS comes as a `RawBlocks` instead
    (3-D tensors, qwen3moe's expert stacks [E, out, in], always come as float32)."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    for t in reader.tensors:
        kind = t.tensor_type.name
        if keep_quantized and kind in GGUF_FORMATS and len(t.shape) == 2:
            yield t.name, RawBlocks(np.array(t.data, np.uint8), kind, int(t.shape[0]))
        else:
            yield t.name, dequantize(t.data, t.tensor_type)


def assign_gguf(stack: StackedParams, cfg: DecoderArchConfig, name: str, value) -> None:
    """Routes one GGUF tensor ([out, in] like torch once dequantized) to its place in the
    pytree: fused tensors split, llama's Q/K rows put back in Hugging Face's order, Gemma's
    norms less the 1 its converter adds, a qwen3moe router [E, D] or expert stack
    [E, out, in] transposed on its last two axes (a router kept in blocks dequantized).

    Raises:
        ValueError: a tensor name this architecture has no place for, or a wrong shape.
    """
    if m := _GGUF_LAYER.match(name):
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix in _GGUF_MOE_NAMES:
            if isinstance(value, RawBlocks):
                value = value.dequantized()
            stack.set_layer(_GGUF_MOE_NAMES[suffix], layer, np.swapaxes(value, -1, -2), name)
            return
        fused = _GGUF_FUSED_BY_ARCH.get(cfg.architecture, {}).get(suffix) or _GGUF_FUSED.get(suffix)
        if fused is not None:
            if isinstance(value, RawBlocks):  # rows split as they are, blocks untouched
                parts = split_fused(stack, fused, value.data, name)
                parts = [(t, value.map_rows(lambda _, p=p: p)) for t, p in parts]
            else:
                parts = split_fused(stack, fused, value, name)
            for target, part in parts:
                stack.set_layer(target, layer, part.T, name)
            return
        gemma = cfg.architecture in _NORM_PLUS_ONE
        target = (_GGUF_GEMMA_LAYER_NAMES if gemma else _GGUF_LAYER_NAMES).get(suffix)
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the GGUF file")
        if target in ("q_proj", "k_proj") and cfg.architecture in _PERMUTED_QK:
            heads = cfg.num_attention_heads if target == "q_proj" else cfg.num_key_value_heads
            if isinstance(value, RawBlocks):
                value = value.map_rows(lambda rows, h=heads: unpermute_gguf_qk(rows, h))
            else:
                value = unpermute_gguf_qk(value, heads)
        if gemma and suffix.endswith("norm.weight"):
            value = value - np.float32(1)
        stack.set_layer(target, layer, value.T if value.ndim == 2 else value, name)
    elif name in _GGUF_GLOBAL:
        if name == "output_norm.weight" and cfg.architecture in _NORM_PLUS_ONE:
            value = value - np.float32(1)
        stack.set_global(_GGUF_GLOBAL[name], value, name)
    elif name == "output.weight":
        stack.set_global("lm_head", value.T, name)
    else:
        raise ValueError(f"unexpected tensor {name!r} in the GGUF file")


def unpermute_gguf_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's conversion-time reordering of Q/K rows (llama files only).

    llama.cpp's llama converter stores each head's rows with the two RoPE halves interleaved
    (row pairs (i, i + H/2) made adjacent) because its RoPE rotates adjacent pairs; this
    model rotates halves (Hugging Face's layout). w: [heads * H, D] -> the same shape.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
