"""`scoring.token_logprobs` (the perplexity benchmark's measure) against Hugging Face's
log-softmax at every position, through chunked prefill, and under quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedjax import scoring
from pagedjax.models import loader
from pagedjax.ops import quant


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg)


@pytest.fixture(scope="module")
def text_ids():
    # 65 tokens: 64 predictions, two chunks of 32 (one compiled shape).
    return np.random.default_rng(5).integers(3, 259, size=65).tolist()


def test_token_logprobs_match_hf(tiny, tiny_hf, text_ids):
    cfg, params = tiny
    got = scoring.token_logprobs(params, cfg, text_ids, chunk_size=32)
    with torch.no_grad():
        logits = tiny_hf(torch.tensor([text_ids])).logits[0]
    logp = torch.log_softmax(logits, -1).numpy()
    want = logp[np.arange(len(text_ids) - 1), text_ids[1:]]
    assert got.shape == (len(text_ids) - 1,)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert scoring.perplexity(got) == pytest.approx(np.exp(-want.mean()), rel=1e-4)
    with pytest.raises(ValueError, match="2 to"):
        scoring.token_logprobs(params, cfg, text_ids[:1])


def test_quantized_log_likelihood_stays_close(tiny, text_ids):
    """Mean log-likelihood per token moves by less than 1 % of its value under int8
    weights and under a float8 KV cache (each: a few 1e-3 measured)."""
    cfg, params = tiny
    ref = scoring.token_logprobs(params, cfg, text_ids, chunk_size=32).mean()
    int8 = quant.quantize_params(params, "int8")
    for p, kv in ((int8, "auto"), (params, "fp8")):
        got = scoring.token_logprobs(p, cfg, text_ids, chunk_size=32, kv_cache_dtype=kv).mean()
        assert abs(got - ref) < 0.01 * abs(ref), (kv, got, ref)
