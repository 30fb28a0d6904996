"""Runs the tiny model under several device layouts on 8 simulated CPU devices and prints a
JSON report (greedy outputs, per-device shard shapes). Started by tests/test_sharding.py in a
subprocess, because XLA_FLAGS must be set before jax is imported."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

LAYOUTS = {
    "single": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "dp2": {"data_parallel_size": 2},
    "dp2-tp2": {"data_parallel_size": 2, "tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "pp2-tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "int8": {"quantization": "int8"},
    "tp2-int8": {"quantization": "int8", "tensor_parallel_size": 2},
}


def shard_shapes(tree) -> dict[str, list[list[int]]]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[jax.tree_util.keystr(path)] = [list(s.data.shape) for s in leaf.addressable_shards]
    return out


def main(folder: str, cache_dir: str, layouts: list[str]) -> None:
    import conftest

    from pagedjax import LLM, SamplingParams

    folder_p = Path(folder)
    if not (folder_p / "config.json").exists():
        conftest.make_checkpoint(folder_p)  # 4 query heads, 2 KV heads
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, 259, size=n).tolist()} for n in (1, 7, 33, 60, 90)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    report = {}
    for name in layouts:
        llm = LLM(
            folder,
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=16,  # one bucket: prompts are chunked
            max_num_seqs=16,
            num_gpu_blocks_override=40,
            compilation_cache_dir=cache_dir,
            use_tqdm_on_load=False,
            disable_log_stats=True,
            **LAYOUTS[name],
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        eng = llm.llm_engine
        replicas = getattr(eng, "replicas", [eng])
        report[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "replicas": [
                {
                    "devices": r.layout["devices"],
                    "params": shard_shapes(r.runner.params),
                    "kv": shard_shapes(r.runner.kv_cache),
                    "free_blocks": r.kv_cache_manager.pool.num_free_blocks,
                    "usable_blocks": r.kv_cache_manager.pool.num_usable_blocks,
                }
                for r in replicas
            ],
        }
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
