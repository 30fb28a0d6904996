"""Online serving benchmark: a workload streamed through `/v1/completions` of a real server.

    python -m benchmarks.serving [--url http://127.0.0.1:8000 | --model PATH] \\
        [--workload FILE|shared-prefix] [--concurrency 64] [--request-rate 0.5,1,2,inf] \\
        [--max-model-len 1024] [--label pagedjax] [--out benchmarks/results/serving.json]
    python -m benchmarks.serving --plot OUT.png RESULT.json [RESULT.json ...]

Without `--url`, it starts `pagedjax serve` (the default model, or `--model`) on a free port
of 127.0.0.1 and stops it afterwards; start-up is reported apart. Each request of the workload
(default: `workloads/standard.json`, exact prompt token ids, greedy, EOS ignored, exactly
output_len tokens) is sent as a streamed completion, at most `--concurrency` at once, arriving
as a Poisson process of `--request-rate` requests/s (inf: all at once). Measured per request
on the client (time.perf_counter): TTFT (send -> first chunk with text), ITL (gaps between
chunks), TPOT ((end-to-end - TTFT) / (output tokens - 1)) and end-to-end latency; overall
output tokens/s and requests/s, and failed requests. Mean, p50, p95 and p99 are printed and
written as JSON with the environment. Every loop is bounded by `--timeout`.

`--request-rate` takes a comma-separated sweep, run one rate after the other on the same
server; `--plot` draws the latency-throughput curves (median TPOT and TTFT against output
tokens/s, one line per result file, e.g. pagedjax's and vLLM's on the same rates).
The body names the server's first model (`/v1/models`), so a peer server works unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import environment, load_workload, shared_prefix_workload

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ns) -> tuple[subprocess.Popen, str, float]:
    """Starts `pagedjax serve` and waits (bounded) until /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedjax.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-model-len", str(ns.max_model_len)]
    cmd += ["--disable-log-stats", "--disable-uvicorn-access-log"]
    if ns.model:
        cmd.append(ns.model)
    if ns.max_num_seqs:
        cmd += ["--max-num-seqs", str(ns.max_num_seqs)]
    cmd += getattr(ns, "extra_server_args", [])  # flags of a benchmark's own
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < ns.timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.terminate()
    raise TimeoutError("the server did not become healthy")


async def _one(http, req, sem, result, model):
    body = {
        "model": model,
        "prompt": req["prompt_token_ids"],
        "max_tokens": req["output_len"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with sem:
        t0 = time.perf_counter()
        times, tokens = [], 0
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        times.append(time.perf_counter())
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            result.append({"error": f"{type(e).__name__}: {e}"})
            return
        end = time.perf_counter()
    ttft = times[0] - t0 if times else end - t0
    result.append(
        {
            "ttft_s": ttft,
            "tpot_s": (end - t0 - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl_s": list(np.diff(times)),
            "e2e_s": end - t0,
            "output_tokens": tokens,
        }
    )


def _stats(xs) -> dict:
    xs = np.asarray([x for x in xs if x is not None], float)
    if not len(xs):
        return {}
    out = {"mean": float(xs.mean())}
    out.update((k, float(np.percentile(xs, q))) for k, q in (("p50", 50), ("p95", 95), ("p99", 99)))
    return out


async def run(url: str, reqs: list[dict], ns, rate: float) -> dict:
    """Sends `reqs` at `rate` requests/s (Poisson arrivals; inf: all at once)."""
    sem = asyncio.Semaphore(ns.concurrency)
    rnd = random.Random(0)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=ns.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=ns.timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(_one(http, req, sem, results, model)))
            if rate != float("inf"):
                await asyncio.sleep(rnd.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks), ns.timeout)
        wall = time.perf_counter() - t0

    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "request_rate": rate,
        "num_requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_s": _stats([r["ttft_s"] for r in ok]),
        "tpot_s": _stats([r["tpot_s"] for r in ok]),
        "itl_s": _stats([x for r in ok for x in r["itl_s"]]),
        "e2e_s": _stats([r["e2e_s"] for r in ok]),
    }


def plot(out: str, paths: list[str]) -> None:
    """Median TPOT and TTFT against output tokens/s, one line per result file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for path in paths:
        res = json.loads(Path(path).read_text())
        rows = sorted(res["rates"], key=lambda r: r["output_tokens_per_s"])
        x = [r["output_tokens_per_s"] for r in rows]
        for ax, key in zip(axes, ("tpot_s", "ttft_s"), strict=True):
            ax.plot(x, [1e3 * r[key]["p50"] for r in rows], "o-", label=res.get("label", path))
    for ax, name in zip(axes, ("TPOT p50 (ms)", "TTFT p50 (ms)"), strict=True):
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Serving: latency against throughput (request-rate sweep)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="A running server (default: start one).")
    p.add_argument("--model", default=None, help="Model for the started server.")
    p.add_argument("--workload", default="standard", help="standard, shared-prefix or a file.")
    p.add_argument("--num-requests", type=int, default=None, help="Use the first N requests.")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[float("inf")],
        help="requests/s, comma-separated for a sweep (inf: all at once)",
    )
    p.add_argument("--label", default="pagedjax", help="name of this server in the plot")
    p.add_argument("--plot", nargs="+", default=None, metavar=("OUT.png", "RESULT.json"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.plot:
        plot(ns.plot[0], ns.plot[1:])
        return 0
    if ns.workload == "standard":
        reqs = load_workload()
    elif ns.workload == "shared-prefix":
        reqs = shared_prefix_workload()
    else:
        reqs = load_workload(ns.workload)
    reqs = reqs[: ns.num_requests]
    proc, url, startup = None, ns.url, None
    if url is None:
        proc, url, startup = start_server(ns)
    rates = []
    try:
        for rate in ns.request_rate:
            rates.append(asyncio.run(run(url, reqs, ns, rate)))
            r = rates[-1]
            print(
                f"{ns.label} rate {rate}/s: {r['output_tokens_per_s']:.1f} out tok/s, "
                f"TTFT p50 {1e3 * r['ttft_s'].get('p50', 0):.0f} ms, "
                f"TPOT p50 {1e3 * r['tpot_s'].get('p50', 0):.0f} ms, failed {r['failed']}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    res = {
        "label": ns.label,
        "url": ns.url,
        "workload": ns.workload,
        "startup_s": startup,
        "concurrency": ns.concurrency,
        "rates": rates,
        "env": environment(),
    }
    print(json.dumps({k: v for k, v in res.items() if k != "env"}, indent=2))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(res, indent=2))
        if len(rates) > 1:
            with contextlib.suppress(ImportError):
                plot(str(Path(ns.out).with_suffix(".png")), [ns.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
