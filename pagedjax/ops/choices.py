"""The names of the ops' variants: attention backends, quantization methods, KV-cache dtypes.

One copy of each list, jax-free, so that the config can validate an option without importing
jax; the ops that implement the variants (`attention`, `quant`, `kv_cache`) and the
checkpoint readers (`models.quant_loader`) import their lists from here.
"""

from __future__ import annotations

# `ops.attention.ragged_paged_attention`'s backends (the config adds "auto").
ATTENTION_BACKENDS = ("reference", "xla", "cpu", "pallas")

# `ops.linear`'s implementations of float32 linear layers: XLA's dot, or weights pre-packed
# for the native CPU matmul (`ops.cpu_linear`).
LINEAR_BACKENDS = ("xla", "cpu")

# The native CPU kernels' ISA paths, widest first (`ops.cpu_kernels`; the config adds "auto").
CPU_KERNEL_ISAS = ("avx512", "avx2", "portable")
# What the native GGUF kernel multiplies the blocks with (`ops.cpu_gguf`).
GGUF_ACTIVATIONS = ("float32", "int8")

# What `ops.quant` computes (vLLM's `quantization=` names).
QUANTIZATION_METHODS = ("int8", "w8a8", "fp8", "awq", "gptq")
QUANTIZE_ON_LOAD = ("int8", "w8a8", "fp8")  # computed from float weights at load time
INT4_METHODS = ("awq", "gptq")
# vLLM's alternative names for the same formats (its Marlin kernels read the same files).
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
# Every accepted `quantization=` value: the methods, their aliases, and "gguf" (a GGUF file,
# dequantized on load).
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES, "gguf")

# kv_cache_dtype values other than "auto" and the float8 format each stores (vLLM's names;
# "fp8" is float8_e4m3fn, as on CUDA). See `ops.kv_cache`.
FP8_KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
