"""Tensor and data parallelism on 8 simulated CPU devices: greedy outputs identical to one
device, and every parameter's and the KV cache's per-device shard shapes as the rules say; for
Qwen3 (per-head q/k norms) and a Qwen2 with a sliding window on its second layer only, TP=2
and PP=2 against one device (the window table read at the pipeline stage's layer offset)."""

from __future__ import annotations

import pytest

from pagedjax.ops.fused_projections import FUSED
from pagedjax.ops.quant import LINEAR_WEIGHTS
from pagedjax.sharding.mesh import device_grid
from pagedjax.sharding.rules import ShardingPlan

# Tiny model: L=3, D=64, N=4 query heads, K=2 KV heads, H=16, F=128, V=320.
FULL = {
    "['embed_tokens']": [320, 64],
    "['final_norm']": [64],
    "['lm_head']": [64, 320],
    "['layers']['input_norm']": [3, 64],
    "['layers']['post_attn_norm']": [3, 64],
    "['layers']['q_proj']": [3, 64, 64],
    "['layers']['k_proj']": [3, 64, 32],
    "['layers']['v_proj']": [3, 64, 32],
    "['layers']['o_proj']": [3, 64, 64],
    "['layers']['gate_proj']": [3, 64, 128],
    "['layers']['up_proj']": [3, 64, 128],
    "['layers']['down_proj']": [3, 128, 64],
}


def expected_shards(tp: int, pp: int = 1) -> dict[str, list[int]]:
    """Per-device shapes, worked out by hand from the rules: under tensor parallelism the
    columns of q/k/v/gate/up, rows of o/down, and the vocab of embedding and head split tp
    ways (k/v stay whole when tp does not divide the 2 KV heads); under pipeline parallelism
    the stacked layer axis splits pp ways, each device holding the largest stage's rows (3
    layers over 2 stages: 2 and 1, both padded to 2)."""
    s = {k: list(v) for k, v in FULL.items()}
    for k in s:
        if k.startswith("['layers']"):
            s[k][0] = -(-s[k][0] // pp)
    if tp == 1:
        return s
    s["['embed_tokens']"][0] //= tp
    s["['lm_head']"][1] //= tp
    s["['layers']['q_proj']"][2] //= tp
    s["['layers']['o_proj']"][1] //= tp
    for k in ("gate_proj", "up_proj"):
        s[f"['layers']['{k}']"][2] //= tp
    s["['layers']['down_proj']"][1] //= tp
    if 2 % tp == 0:
        s["['layers']['k_proj']"][2] //= tp
        s["['layers']['v_proj']"][2] //= tp
    return s


def prepacked_shapes(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """The "cpu" backend's params (`cpu_linear.pack_params`): each linear weight [L, K, N]
    held as panels [L, ceil(N / 16), K, 16], the LM head [D, V] as [1, ceil(V / 16), D, 16];
    then q/k/v and gate/up each one weight of their columns (`ops.fused_projections`)."""
    out = {}
    for key, shape in shapes.items():
        if key == "['lm_head']":
            shape = [1, *shape]
        elif not any(f"['{n}']" in key for n in LINEAR_WEIGHTS):
            out[key] = shape
            continue
        L, K, N = shape
        out[key + ".panels"] = [L, -(-N // 16), K, 16]
    for fused, parts in FUSED.items():
        panels = [out.pop(f"['layers']['{p}'].panels") for p in parts]
        L, _, K, _ = panels[0]
        out[f"['layers']['{fused}'].panels"] = [L, sum(p[1] for p in panels), K, 16]
    return out


@pytest.fixture(scope="module")
def report(llama3_report):
    return llama3_report  # conftest: one worker run shared with test_pipeline_stages


@pytest.mark.parametrize("layout", ["tp2", "tp4", "dp2", "dp2-tp2", "pp2", "pp2-tp2"])
def test_greedy_output_identical_to_one_device(report, layout):
    assert report[layout]["tokens"] == report["single"]["tokens"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("model", ["qwen3", "qwen2-swa", "gemma3"])
def test_families_greedy_output_identical_to_one_device(family_report, model, layout):
    rep = family_report[model]
    assert rep[layout]["tokens"] == rep["single"]["tokens"]
    devices = [d for r in rep[layout]["replicas"] for d in r["devices"]]
    assert len(devices) == 2


def test_families_shard_shapes(family_report):
    """Qwen3's q/k norms [L, H=32] stay whole under TP and split by layer under PP; its
    q_proj's N*H = 128 columns split over TP."""
    tp2 = family_report["qwen3"]["tp2"]["replicas"][0]["params"]
    pp2 = family_report["qwen3"]["pp2"]["replicas"][0]["params"]
    for name in ("['layers']['q_norm']", "['layers']['k_norm']"):
        assert tp2[name] == [[2, 32]] * 2
        assert pp2[name] == [[1, 32]] * 2
    assert tp2["['layers']['q_proj']"] == [[2, 64, 64]] * 2
    assert pp2["['layers']['q_proj']"] == [[1, 64, 128]] * 2


def test_sliding_window_under_the_pipeline_is_hfs(family_report):
    """The windowed Qwen2 on one device is HF's greedy output, and the window matters for
    these prompts (HF without it continues otherwise), so PP=2's equality above checks that
    stage 1 reads layer 1's window, not layer 0's."""
    rep = family_report["qwen2-swa"]
    assert rep["single"]["tokens"] == rep["hf"]
    assert rep["hf_full"] != rep["hf"]


def test_int8_weights_under_tensor_parallelism(report):
    """Quantized columns split over the tensor axis give the single-device int8 output."""
    assert report["tp2-int8"]["tokens"] == report["int8"]["tokens"]
    params = report["tp2-int8"]["replicas"][0]["params"]
    assert params["['layers']['q_proj'].qweight"] == [[3, 64, 32]] * 2  # out columns split
    assert params["['layers']['q_proj'].scales"] == [[3, 32]] * 2
    assert params["['layers']['o_proj'].qweight"] == [[3, 64, 64]] * 2  # row-parallel: whole


@pytest.mark.parametrize(
    "layout,tp,pp,replicas",
    [
        ("single", 1, 1, 1),
        ("tp2", 2, 1, 1),
        ("tp4", 4, 1, 1),
        ("dp2", 1, 1, 2),
        ("dp2-tp2", 2, 1, 2),
        ("pp2", 1, 2, 1),
        ("pp2-tp2", 2, 2, 1),
    ],
)
def test_per_device_shard_shapes(report, layout, tp, pp, replicas):
    reps = report[layout]["replicas"]
    assert len(reps) == replicas
    devices = [d for r in reps for d in r["devices"]]
    assert len(devices) == len(set(devices)) == tp * pp * replicas  # disjoint slices
    want = expected_shards(tp, pp)
    if layout == "single":  # one CPU device: "auto" is the "cpu" backend, weights pre-packed
        want = prepacked_shapes(want)
    for rep in reps:
        assert set(rep["params"]) == set(want)
        for name, shapes in rep["params"].items():
            assert shapes == [want[name]] * tp * pp, name
        kv_heads = 2 // tp if 2 % tp == 0 else 2
        for shapes in rep["kv"].values():
            assert [s[3] for s in shapes] == [kv_heads] * tp * pp
            assert all(s[:3] == [-(-3 // pp), 40, 16] and s[4] == 16 for s in shapes)
        assert rep["free_blocks"] == rep["usable_blocks"]


def test_rules_replicate_what_does_not_divide():
    import jax

    mesh_devices = device_grid(jax.devices() * 4, 1, 1, 4)[0]
    from jax.sharding import Mesh

    plan = ShardingPlan(
        Mesh(mesh_devices, ("pipeline", "tensor")),
        {"q_heads": 9, "kv_heads": 3, "mlp": 1536, "vocab": 49152},
    )
    assert plan.spec(("layers", "embed", "q_heads")) == jax.sharding.PartitionSpec()
    assert plan.spec(("layers", "embed", "mlp")) == jax.sharding.PartitionSpec(None, None, "tensor")
    assert plan.spec(("vocab", "embed")) == jax.sharding.PartitionSpec("tensor")


def test_too_few_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="8 devices are needed, 1 are available"):
        device_grid(["d0"], 2, 1, 4)
