"""Checkpoint loading: sharded safetensors, GGUF (with llama.cpp's Q/K row order), dtype
conversion, orbax round trips, and errors that name the file or tensor at fault."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_checkpoint
from gguf_writer import write_gguf

from pagedjax.models import loader
from pagedjax.models.llama import param_shapes


def _load(path, dtype="float32"):
    source = loader.resolve_model_source(str(path))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, dtype)


def _flat(params):
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(params)
    }


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_params_follow_hf_weights(tiny_llama_dir):
    from safetensors.numpy import load_file

    cfg, params = _load(tiny_llama_dir)
    raw = load_file(str(tiny_llama_dir / "model.safetensors"))
    np.testing.assert_array_equal(params["embed_tokens"], raw["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        params["layers"]["q_proj"][1], raw["model.layers.1.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(params["lm_head"], raw["lm_head.weight"].T)
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == param_shapes(cfg)


def test_sharded_checkpoint_with_index(tmp_path, tiny_llama_dir):
    from safetensors.numpy import load_file, save_file

    raw = load_file(str(tiny_llama_dir / "model.safetensors"))
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", out)
    names = sorted(raw)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: raw[n] for n in shard}, str(out / fname))
        weight_map.update({n: fname for n in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same(_load(out)[1], _load(tiny_llama_dir)[1])
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        _load(out)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"layers/up_proj \(layers \[1\]\)"),
        (lambda t: t.pop("model.norm.weight"), "final_norm"),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.up_proj.weight", np.zeros((3, 3), np.float32)
            ),
            "model.layers.0.mlp.up_proj.weight.*shape",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.mystery.weight", np.zeros(3, np.float32)),
            "model.layers.0.mystery.weight",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.7.mlp.up_proj.weight", np.zeros((128, 64), np.float32)
            ),
            "layer 7",
        ),
    ],
    ids=["missing-layer", "missing-global", "wrong-shape", "unknown", "layer-out-of-range"],
)
def test_bad_checkpoints_name_the_tensor(tmp_path, tiny_llama_dir, edit, match):
    from safetensors.numpy import load_file, save_file

    raw = dict(load_file(str(tiny_llama_dir / "model.safetensors")))
    edit(raw)
    out = tmp_path / "bad"
    out.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", out)
    save_file(raw, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        _load(out)


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        loader.resolve_model_source(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model_source(str(tmp_path / "empty"))


def test_the_default_models_hub_id_loads_the_bundled_file(tmp_path, monkeypatch):
    """`pagedjax serve HuggingFaceTB/SmolLM2-135M-Instruct` (a copied vLLM command line) loads
    the bundled GGUF under the id it was given; a local path of that name wins; any other
    missing id (not in the Hugging Face cache either) is still an error."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = loader.resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    default = loader.resolve_model_source(None)
    assert (source.kind, source.path) == (default.kind, default.path)
    assert source.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert loader.resolve_model_source("SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="nothing is downloaded"):
        loader.resolve_model_source("HuggingFaceTB/SmolLM2-360M-Instruct")
    monkeypatch.chdir(tmp_path)
    local = make_checkpoint(tmp_path / "SmolLM2-135M-Instruct")
    source = loader.resolve_model_source("SmolLM2-135M-Instruct")
    assert (source.kind, source.name) == ("hf", local.name)


def test_a_hub_id_in_the_hugging_face_cache_loads_from_there(tmp_path, tiny_llama_dir, monkeypatch):
    """As vLLM does offline: "org/name" that is not a local path loads its cached snapshot
    (the ref's commit, or the revision asked for), under that id; an uncached revision or id
    is an error that says nothing is downloaded (before, every hub id was refused)."""
    import huggingface_hub.constants
    from transformers import AutoTokenizer

    from pagedjax import EngineArgs

    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # no local folder named "org/tiny"

    for revision in (None, "main", commit):
        source = loader.resolve_model_source("org/tiny", revision)
        assert (source.kind, source.name, source.from_hub_cache) == ("hf", "org/tiny", True)
        assert source.path == str(repo / "snapshots" / commit)
    with pytest.raises(ValueError, match="at revision 'v2'.*nothing is downloaded"):
        loader.resolve_model_source("org/tiny", "v2")
    with pytest.raises(ValueError, match="nothing is downloaded"):
        loader.resolve_model_source("org/other")
    mc = EngineArgs(model="org/tiny").create_engine_config().model_config
    assert (mc.source_kind, mc.source_path) == ("hf", str(repo / "snapshots" / commit))
    assert mc.served_model_name == "org/tiny"
    # --tokenizer org/tiny too
    tok = loader.load_tokenizer(loader.resolve_model_source(str(tiny_llama_dir)), "org/tiny")
    assert (
        tok("a b c").input_ids == AutoTokenizer.from_pretrained(tiny_llama_dir)("a b c").input_ids
    )
    with pytest.raises(ValueError, match="nor a hub id in the local Hugging Face cache"):
        loader.load_tokenizer(loader.resolve_model_source(str(tiny_llama_dir)), "org/other")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion(tiny_llama_dir, dtype):
    _, p32 = _load(tiny_llama_dir)
    _, p = _load(tiny_llama_dir, dtype)
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p), strict=True):
        assert b.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a).astype(jnp.dtype(dtype)))


def test_orbax_round_trip(tmp_path, tiny_llama_dir):
    cfg, params = _load(tiny_llama_dir)
    out = tmp_path / "converted"
    loader.save_converted(out, cfg, params, tokenizer=None)
    source = loader.resolve_model_source(str(out))
    assert source.kind == "orbax"
    assert loader.load_arch_config(source) == cfg
    _assert_same(loader.load_params(source, cfg), params)
    bf16 = loader.load_params(source, cfg, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16))
    # A conversion of another architecture is refused with the tensors named.
    other = make_checkpoint(tmp_path / "qwen", arch="qwen2")
    qcfg = loader.load_arch_config(loader.resolve_model_source(str(other)))
    with pytest.raises(ValueError, match="q_bias"):
        loader.restore_params(out / "params", qcfg)


def test_gguf_import_undoes_the_qk_permutation(tmp_path, tiny_llama_dir):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama_dir, quantize_ffn=True)
    source = loader.resolve_model_source(str(path))
    assert source.kind == "gguf"
    cfg = loader.load_arch_config(source)
    ref_cfg, ref = _load(tiny_llama_dir)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        ref_cfg.num_hidden_layers,
        ref_cfg.num_key_value_heads,
        ref_cfg.head_dim,
        ref_cfg.vocab_size,
    )
    params = loader.load_params(source, cfg)
    got, want = _flat(params), _flat(ref)
    for k in want:
        if "up_proj" in k:  # Q8_0: dequantized values, each within a block's scale / 127
            scale = np.abs(want[k]).max() / 127
            np.testing.assert_allclose(got[k], want[k], atol=scale)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # The conversion cache: written once, then read back identically.
    conv = loader.converted_gguf_source(source, str(tmp_path / "cache"))
    assert conv.kind == "orbax"
    _assert_same(loader.load_params(conv, cfg), params)
    assert loader.converted_gguf_source(source, str(tmp_path / "cache")) == conv


def test_cache_folders_are_published_whole(tmp_path):
    """A cache folder appears only once written (renamed from a temporary sibling): a second
    writer keeps the first one's folder, a failing writer leaves nothing, and a leftover
    without its completion file (an interrupted in-place writer) is replaced."""
    from pagedjax.models.checkpoint_io import publish_folder

    out = tmp_path / "cache" / "model"

    def writer(text):
        def write(folder):
            (folder / "done.json").write_text(text)

        return write

    publish_folder(out, writer("first"), "done.json")
    publish_folder(out, writer("second"), "done.json")
    assert (out / "done.json").read_text() == "first"

    def failing(folder):
        (folder / "part").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_folder(tmp_path / "cache" / "other", failing, "done.json")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["model"]

    leftover = tmp_path / "cache" / "stale"
    leftover.mkdir()
    (leftover / "half").write_text("x")
    publish_folder(leftover, writer("whole"), "done.json")
    assert sorted(p.name for p in leftover.iterdir()) == ["done.json"]


def test_the_default_model_answers_to_both_of_its_ids(tmp_path):
    """A server of the default model accepts either id in `model`, however it was started
    (`default_model_ids`); no other model gets them."""
    from pagedjax.models.sources import DEFAULT_MODEL_IDS, default_model_ids

    default = loader.resolve_model_source(None).path
    assert default_model_ids(default) == DEFAULT_MODEL_IDS
    assert set(DEFAULT_MODEL_IDS) == {
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    assert default_model_ids(str(make_checkpoint(tmp_path / "SmolLM2-135M-Instruct"))) == ()
