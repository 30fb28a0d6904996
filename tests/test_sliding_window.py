"""Sliding-window models against Hugging Face transformers (torch, float32): Mistral with a
window on every layer, and Qwen2 with `use_sliding_window` on the layers from
`max_window_layers` on (full attention below), with prompts of several windows' length so
that the window really cuts the context; through the native "cpu" attention kernel and the
XLA path, under chunked prefill and prefix caching."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import hf_greedy, hf_model, make_checkpoint

from pagedjax import SamplingParams
from pagedjax.models import loader

WINDOW = 16
NEW_TOKENS = 32
CASES = {
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    # two layers: layer 0 full attention, layer 1 windowed
    "qwen2-mixed": dict(
        arch="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}


@pytest.fixture(scope="module")
def swa_dirs(tmp_path_factory):
    return {
        name: make_checkpoint(tmp_path_factory.mktemp(name), seed=7, **kw)
        for name, kw in CASES.items()
    }


@pytest.fixture(scope="module")
def swa_prompts():
    rng = np.random.default_rng(99)
    return [rng.integers(3, 259, size=n).tolist() for n in (50, 58, 64, 70)]


def test_configs_read_the_windowed_layers(swa_dirs):
    mistral = loader.load_arch_config(loader.resolve_model_source(str(swa_dirs["mistral"])))
    assert mistral.layer_windows() == (WINDOW, WINDOW)
    qwen2 = loader.load_arch_config(loader.resolve_model_source(str(swa_dirs["qwen2-mixed"])))
    assert qwen2.layer_windows() == (0, WINDOW)
    hf = json.loads((swa_dirs["qwen2-mixed"] / "config.json").read_text())
    assert hf["layer_types"] == ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("backend", ["cpu", "xla"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_with_a_sliding_window_matches_hf(
    make_llm, swa_dirs, swa_prompts, name, backend, tmp_path
):
    """Prompts of 3-4 windows and 32 new tokens, prefilled in chunks of 32 tokens with prefix
    caching on: equal to HF token for token (full attention would differ: checked below)."""
    hf = hf_model(swa_dirs[name])
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in swa_prompts]
    llm = make_llm(
        swa_dirs[name],
        block_size=16,
        max_num_batched_tokens=32,
        attention_backend=backend,
        linear_backend="xla" if backend == "xla" else "auto",
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in swa_prompts], greedy, use_tqdm=False)
    for p, out, ref in zip(swa_prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == ref, f"{name}/{backend}: prompt of {len(p)} tokens"
    # The window matters for these prompts: the same weights without it continue otherwise.
    assert _hf_greedy_without_window(swa_dirs[name], swa_prompts, tmp_path) != want


def _hf_greedy_without_window(folder, prompts, tmp_path):
    """HF greedy outputs of the checkpoint in `folder` with a window wider than any prompt
    (full attention)."""
    full = tmp_path / "full"
    shutil.copytree(folder, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (full / "config.json").write_text(json.dumps(cfg))
    hf = hf_model(full)
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
