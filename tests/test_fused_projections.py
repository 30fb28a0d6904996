"""q/k/v and gate/up fused into one native call each (`ops.fused_projections`): the fused
output is the same bits as the separate calls, weights that cannot fuse stay as they are, and
an engine on the native kernels holds the fused weights and answers as before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf_kernels import blocks_for

from pagedjax import SamplingParams
from pagedjax.ops import cpu_kernels, cpu_linear
from pagedjax.ops import gguf_quant as gq
from pagedjax.ops.fused_projections import fuse_projections, split_projections
from pagedjax.ops.linear import LayerView, linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
K, L = 256, 3  # K: a multiple of the K-quants' 256-value blocks
OUTS = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "gate_proj": 96, "up_proj": 96}


def _gguf(fmt: str, n: int, seed: int) -> gq.GGUFWeight:
    blocks = np.stack([blocks_for(fmt, n, K, seed=seed + i) for i in range(L)])
    return gq.GGUFWeight(jnp.asarray(blocks), fmt, K, native=True)


def _packed(n: int, seed: int) -> cpu_linear.PackedWeight:
    w = np.random.default_rng(seed).normal(size=(L, K, n)).astype(np.float32)
    return cpu_linear.pack(jnp.asarray(w))


def _check_same_bits(layers: dict, fused: dict) -> None:
    x = jnp.asarray(np.random.default_rng(1).normal(size=(7, K)).astype(np.float32))
    layer = jnp.int32(2)
    for name, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        for rows in (1, 7):
            got = linear(x, LayerView(fused[name], layer), num_rows=rows)
            want = [linear(x, LayerView(layers[p], layer), num_rows=rows) for p in parts]
            np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.concatenate(want, -1)))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "float32"])
def test_fused_calls_give_the_separate_calls_bits(kind):
    make = _packed if kind == "float32" else (lambda n, s: _gguf(kind, n, s))
    layers = {name: make(n, seed) for seed, (name, n) in enumerate(OUTS.items())}
    layers["o_proj"] = make(64, 9)
    fused = fuse_projections({"layers": layers, "final_norm": jnp.ones(K)})["layers"]
    assert set(fused) == {"qkv_proj", "gate_up_proj", "o_proj"}
    assert fused["qkv_proj"].shape == (L, K, 128) and fused["gate_up_proj"].shape == (L, K, 192)
    _check_same_bits(layers, fused)


def test_split_projections_undoes_the_fusion():
    """The parts back, of their shapes and values (GGUF blocks, packed panels, and the
    unpacked [L, in, out] arrays of a checkpoint being written)."""
    import types

    cfg = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for make in (lambda n, s: _gguf("Q4_1", n, s), _packed):
        layers = {name: make(n, seed) for seed, (name, n) in enumerate(OUTS.items())}
        back = split_projections(fuse_projections({"layers": layers}), cfg)["layers"]
        assert set(back) == set(OUTS)
        for name, w in layers.items():
            for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(back[name]), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    layers = {name: _packed(n, seed) for seed, (name, n) in enumerate(OUTS.items())}
    unpacked = cpu_linear.unpack_params(fuse_projections({"layers": layers}), False)
    back = split_projections(unpacked, cfg)["layers"]
    for name, w in layers.items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(cpu_linear.unpack(w)))


def test_weights_that_cannot_fuse_stay_apart():
    """Formats that differ, a packed part ending mid-panel, a stack not read in place, a
    missing part: left unfused (and the others of the layer still fuse)."""
    mixed = {
        "q_proj": _gguf("Q4_1", 64, 0),
        "k_proj": _gguf("Q8_0", 32, 1),
        "v_proj": _gguf("Q4_1", 32, 2),
    }
    mixed |= {"gate_proj": _gguf("Q4_1", 96, 3), "up_proj": _gguf("Q4_1", 96, 4)}
    out = fuse_projections({"layers": mixed})["layers"]
    assert set(out) == {"q_proj", "k_proj", "v_proj", "gate_up_proj"}
    ragged = {"q_proj": _packed(40, 0), "k_proj": _packed(32, 1), "v_proj": _packed(32, 2)}
    assert set(fuse_projections({"layers": ragged})["layers"]) == set(ragged)
    xla = {
        name: _gguf("Q4_1", n, s).replace(native=False) for s, (name, n) in enumerate(OUTS.items())
    }
    assert set(fuse_projections({"layers": xla})["layers"]) == set(OUTS)
    plain = {name: jnp.zeros((L, K, n)) for name, n in OUTS.items()}
    assert set(fuse_projections({"layers": plain})["layers"]) == set(OUTS)
    assert set(fuse_projections({"layers": {"q_proj": _packed(64, 0)}})["layers"]) == {"q_proj"}


def test_engine_on_native_kernels_holds_fused_weights(
    make_llm, tiny_llama_dir, prompts8, hf_greedy_cache
):
    """The tiny Llama on the native float32 kernels: its layers hold qkv_proj and gate_up_proj,
    and its greedy tokens are Hugging Face's."""
    llm = make_llm(tiny_llama_dir, linear_backend="cpu")
    layers = llm.llm_engine.runner.params["layers"]
    assert {"qkv_proj", "gate_up_proj"} <= set(layers)
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(layers)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts8], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy_cache(p, 8) for p in prompts8]
