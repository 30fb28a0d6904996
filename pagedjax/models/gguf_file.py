"""Reading GGUF files (llama architecture): the architecture from the metadata, the tensors
dequantized to float32 by the `gguf` package, and the routing of GGUF tensor names into the
params pytree (`assign_gguf`, undoing llama.cpp's Q/K row order).

Named `gguf_file` rather than `gguf` so that it is never mistaken for the `gguf` package.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from pagedjax.models.llama import LlamaArchConfig
from pagedjax.models.stacking import StackedParams

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


def gguf_reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch_config(reader) -> LlamaArchConfig:
    """The architecture a GGUF file's metadata describes.

    Raises:
        ValueError: an architecture other than llama, or Llama 3.1 RoPE scaling.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling) is not supported"
        )
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(_field(reader, "llama.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def gguf_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every tensor of the file, dequantized one at a time."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    for t in reader.tensors:
        yield t.name, dequantize(t.data, t.tensor_type)


def assign_gguf(stack: StackedParams, cfg: LlamaArchConfig, name: str, value) -> None:
    """Routes one GGUF tensor ([out, in] like torch once dequantized) to its place in the pytree."""
    if m := _GGUF_LAYER.match(name):
        target = _GGUF_LAYER_NAMES.get(m.group(2))
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the GGUF file")
        if target in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if target == "q_proj" else cfg.num_key_value_heads
            value = unpermute_gguf_qk(value, heads)
        stack.set_layer(target, int(m.group(1)), value.T if value.ndim == 2 else value, name)
    elif name in _GGUF_GLOBAL:
        stack.set_global(_GGUF_GLOBAL[name], value, name)
    elif name == "output.weight":
        stack.set_global("lm_head", value.T, name)
    else:
        raise ValueError(f"unexpected tensor {name!r} in the GGUF file")


def unpermute_gguf_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's conversion-time reordering of Q/K rows.

    llama.cpp's converter stores each head's rows with the two RoPE halves interleaved
    (row pairs (i, i + H/2) made adjacent) because its RoPE rotates adjacent pairs; this
    model rotates halves (Hugging Face's layout). w: [heads * H, D] -> the same shape.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
