"""Online serving benchmark: a workload streamed through `/v1/completions` of a real server.

    python -m benchmarks.serving [--url http://127.0.0.1:8000 | --model PATH] \\
        [--workload FILE|shared-prefix] [--concurrency 16] [--request-rate inf] \\
        [--max-model-len 1024] [--out benchmarks/results/serving.json]

Without `--url`, it starts `pagedjax serve` (the default model, or `--model`) on a free port
of 127.0.0.1 and stops it afterwards; start-up is reported apart. Each request of the workload
(default: `workloads/standard.json`, exact prompt token ids, greedy, EOS ignored, exactly
output_len tokens) is sent as a streamed completion, at most `--concurrency` at once, arriving
as a Poisson process of `--request-rate` requests/s (inf: all at once). Measured per request
on the client (time.perf_counter): TTFT (send -> first chunk with text), ITL (gaps between
chunks) and end-to-end latency; overall output tokens/s and requests/s. Medians, p90 and p99
are printed and written as JSON with the environment. Every loop is bounded by `--timeout`.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def _one(http, req, sem, result):
    body = {
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
        end = time.perf_counter()
    result.append(
        {
            "ttft_s": times[0] - t0 if times else end - t0,
            "itl_s": list(np.diff(times)),
            "e2e_s": end - t0,
            "output_tokens": tokens,
        }
    )


async def run(url: str, reqs: list[dict], ns) -> dict:
    sem = asyncio.Semaphore(ns.concurrency)
    rnd = random.Random(0)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=ns.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=ns.timeout, limits=limits) as http:
        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(_one(http, req, sem, results)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rnd.expovariate(ns.request_rate))
        await asyncio.wait_for(asyncio.gather(*tasks), ns.timeout)
        wall = time.perf_counter() - t0

    def stats(xs):
        xs = np.asarray(xs, float)
        return {k: float(np.percentile(xs, q)) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}

    out_tokens = sum(r["output_tokens"] for r in results)
    return {
        "num_requests": len(results),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(results) / wall,
        "ttft_s": stats([r["ttft_s"] for r in results]),
        "itl_s": stats([x for r in results for x in r["itl_s"]]),
        "e2e_s": stats([r["e2e_s"] for r in results]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="A running server (default: start one).")
    p.add_argument("--model", default=None, help="Model for the started server.")
    p.add_argument("--workload", default="standard", help="standard, shared-prefix or a file.")
    p.add_argument("--num-requests", type=int, default=None, help="Use the first N requests.")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
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
    try:
        res = asyncio.run(run(url, reqs, ns))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    res.update(
        startup_s=startup,
        concurrency=ns.concurrency,
        request_rate=ns.request_rate,
        env=environment(),
    )
    print(json.dumps({k: v for k, v in res.items() if k != "env"}, indent=2))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
