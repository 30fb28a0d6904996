"""Runs tiny models under several device layouts on 8 simulated CPU devices and prints a JSON
report (greedy outputs, per-device shard shapes). Started by conftest in a subprocess,
because XLA_FLAGS must be set before jax is imported.

Usage: sharding_worker.py FOLDER CACHE_DIR JOBS: JOBS is a JSON list of [name, [[LAYOUTS,
MODELS], ...]], run one after another in this one process (its ~10 s of start-up paid once).
For each [LAYOUTS, MODELS], each of the comma-separated MODELS (keys of `MODELS`) is written
to FOLDER/<model> and run under each of the comma-separated LAYOUTS (or under its own,
"model=layout+layout"). As each job ends the worker prints "REPORT <name> <json>", the json
{model: {layout: ...}}, and for a model with a sliding window also {model: {"hf": HF's greedy
tokens, "hf_full": the same weights' without the window}}. The model "smollm2" is the real
default model (not written)."""

from __future__ import annotations

import json
import os
import sys

# 8 devices, on top of the flags inherited from the test process (conftest.TEST_XLA_FLAGS)
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
)
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
    "pp4": {"pipeline_parallel_size": 4},
    "pp2-part12": {"pipeline_parallel_size": 2, "pp_layer_partition": "1,2"},
    "int8": {"quantization": "int8"},
    "tp2-int8": {"quantization": "int8", "tensor_parallel_size": 2},
    "pp2-int8": {"quantization": "int8", "pipeline_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "ep4": {"tensor_parallel_size": 4, "enable_expert_parallel": True},
    "ep2-pp2": {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "enable_expert_parallel": True,
    },
    "ep2-int8": {"tensor_parallel_size": 2, "enable_expert_parallel": True, "quantization": "int8"},
}
# `conftest.make_checkpoint` arguments of each model (2 layers, 4 query heads, 2 KV heads).
MODELS = {
    "llama": {},
    "qwen3": dict(arch="qwen3", head_dim=32),  # per-head q/k norms, head_dim != D / N
    # layer 0 full attention, layer 1 a 16-token window: under pp2, one on each stage
    "qwen2-swa": dict(
        arch="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
    ),
    # 4 layers: 3 local (16-token window, local RoPE base) then 1 global; under pp2 the two
    # stages hold different patterns, so each must read its layers' windows and RoPE tables
    "gemma3": dict(
        arch="gemma3",
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    "smollm2": None,  # the real default model (30 layers), not written: LLM(model=None)
    # layer counts no stage count divides (uneven pipeline stages, `sharding.stages`)
    "llama-l3": dict(num_hidden_layers=3),
    "llama-l5": dict(num_hidden_layers=5),
    "llama-l6": dict(num_hidden_layers=6),
    # local, global, local: split [1, 2] by a user partition, stage 1 starts at layer 1 (not
    # at 1 x its 2 rows), so a wrong layer offset gives layer 1 a window and the local RoPE
    "gemma3-l3": dict(
        arch="gemma3",
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # mixtures of experts: 8 experts, top-2; Qwen3-MoE with a dense layer (mlp_only_layers)
    "mixtral": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # 3 layers: uneven stages under PP=2 (2 + 1); layer 1 dense
    "qwen3_moe-l3": dict(
        arch="qwen3_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}


def collectives(runner) -> dict[str, dict[str, int]]:
    """Collective ops of the compiled step (the largest bucket): for each while loop's body
    (the layer scan's body runs once per layer), the count of each of all-to-all, all-gather,
    reduce-scatter, all-reduce and collective-permute in it and in what it calls; and the
    whole module's under "module"."""
    import re

    exe = runner.steps.executables[max(runner.steps.executables)]
    kinds = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
    own: dict[str, dict[str, int]] = {}
    calls: dict[str, set[str]] = {}
    bodies, name = [], None
    for line in exe.as_text().splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            own[name], calls[name] = {}, set()
            continue
        if name is None:
            continue
        for kind in kinds:
            if re.search(rf"= [^=]*\b{kind}(-start)?\(", line):
                own[name][kind] = own[name].get(kind, 0) + 1
        called = re.findall(
            r"(?:body|condition|to_apply|calls|computations?)=\{?%?([\w.\-]+)", line
        )
        called += re.findall(r"branch_computations=\{([^}]*)\}", line)
        for c in called:
            calls[name].update(x.strip().lstrip("%") for x in c.split(","))
        bodies += re.findall(r"\bwhile\(.*body=%?([\w.\-]+)", line)

    def total(comp, seen=()):
        out = dict(own.get(comp, {}))
        for c in calls.get(comp, ()):
            if c not in seen:
                for k, v in total(c, (*seen, comp)).items():
                    out[k] = out.get(k, 0) + v
        return out

    report = {f"while:{b}": total(b) for b in bodies}
    report["module"] = {}
    for ops in own.values():
        for k, v in ops.items():
            report["module"][k] = report["module"].get(k, 0) + v
    return report


def shard_shapes(tree) -> dict[str, list[list[int]]]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[jax.tree_util.keystr(path)] = [list(s.data.shape) for s in leaf.addressable_shards]
    return out


def hf_window_report(folder: Path, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """HF's greedy tokens with the checkpoint's window, and without it (full attention)."""
    import conftest
    from transformers import AutoConfig, AutoModelForCausalLM

    model = conftest.hf_model(folder)
    config = AutoConfig.from_pretrained(str(folder))
    config.use_sliding_window = False
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    full = AutoModelForCausalLM.from_pretrained(str(folder), config=config).eval()
    return {
        "hf": [conftest.hf_greedy(model, p, 8) for p in prompts],
        "hf_full": [conftest.hf_greedy(full, p, 8) for p in prompts],
    }


def run_model(folder: Path, cache_dir: str, layouts: list[str], prompts) -> dict:
    from pagedjax import LLM, SamplingParams
    from pagedjax.sharding.rules import max_device_bytes

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    report = {}
    for name in layouts:
        llm = LLM(
            None if folder is None else str(folder),
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=16,  # one bucket: prompts are chunked
            cuda_graph_sizes="16",
            max_num_seqs=16,
            num_gpu_blocks_override=40,
            compilation_cache_dir=cache_dir,
            use_tqdm_on_load=False,
            disable_log_stats=True,
            enforce_eager=True,  # one bucket, compiled by the first step; no unused ops
            **LAYOUTS[name],
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        eng = llm.llm_engine
        replicas = getattr(eng, "replicas", [eng])
        report[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "replicas": [
                {
                    "devices": r.layout["devices"],
                    "stage_layers": r.layout["stage_layers"],
                    "kv_bytes": r.layout["kv_cache_bytes_per_device"],
                    "params": shard_shapes(r.runner.params),
                    "kv": shard_shapes(r.runner.kv_cache),
                    "free_blocks": r.kv_cache_manager.pool.num_free_blocks,
                    "usable_blocks": r.kv_cache_manager.pool.num_usable_blocks,
                    "collectives": collectives(r.runner),
                    "param_bytes": r.layout["param_bytes_per_device"],
                    "weight_bytes": max_device_bytes(r.runner.params),
                }
                for r in replicas
            ],
        }
    return report


def run_models(folder: str, cache_dir: str, layouts: list[str], models: list[str]) -> dict:
    """{model: {layout: ...}} of each model spec ("name" or "name=layout+layout") of `models`
    under `layouts` (or its own); checkpoints are written to FOLDER/<name> once."""
    import conftest

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (1, 7, 33, 60, 90)]
    report = {}
    for spec in models:
        model, _, own = spec.partition("=")
        model_dir = None if MODELS[model] is None else Path(folder) / model
        if model_dir is not None and not (model_dir / "config.json").exists():
            kw = dict(MODELS[model])
            if kw.get("arch", "").startswith("gemma"):
                from test_gemma import make_gemma_checkpoint

                make_gemma_checkpoint(model_dir, **kw)
            else:
                conftest.make_checkpoint(model_dir, **kw)
        report[model] = run_model(model_dir, cache_dir, own.split("+") if own else layouts, prompts)
        if (MODELS[model] or {}).get("sliding_window"):
            report[model].update(hf_window_report(model_dir, prompts))
    return report


def run_jobs(folder: str, cache_dir: str, jobs: list) -> None:
    """Each job [name, [[layouts, models], ...]] in turn: prints "REPORT <name> <json>" as
    each job ends."""
    for name, runs in jobs:
        report: dict = {}
        for layouts, models in runs:
            report.update(
                run_models(
                    folder, cache_dir, layouts.split(",") if layouts else [], models.split(",")
                )
            )
        print(f"REPORT {name} {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    run_jobs(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
