"""Interleaved A/B of `benchmarks.latency` between two source trees (e.g. a commit before a
change, from `git archive <commit> | tar -x -C DIR`, and the working tree).

    python -m benchmarks.ab_latency --a DIR_A --b DIR_B [--pairs 3] \\
        [--latency-args "--batch-size 64 --input-len 128 --output-len 16 --reps 2"] \\
        [--out benchmarks/results/ab_latency.json]

Runs A, B, A, B, ... (`--pairs` of each), each a fresh process with PYTHONPATH at its tree,
so that both see the same machine load over the same period; reports each run's decode step
and decode tok/s per batch size and their medians, and B / A.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import environment, median


def run(tree: str, latency_args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "benchmarks.latency", *latency_args, "--out", out]
    subprocess.run(cmd, check=True, cwd=tree, env=env)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="source tree A (the baseline)")
    p.add_argument("--b", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument(
        "--latency-args", default="--batch-size 64 --input-len 128 --output-len 16 --reps 2"
    )
    p.add_argument("--out", default="benchmarks/results/ab_latency.json")
    ns = p.parse_args(argv)
    args = shlex.split(ns.latency_args)
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(ns.pairs):
        for side in ("a", "b"):
            r = run(getattr(ns, side), args)
            rows = [
                {k: row.get(k) for k in ("batch_size", "decode_step_s", "prefill_s", "e2e_s")}
                for row in r["rows"]
            ]
            runs[side].append({"pair": i, "rows": rows})
            print(side, json.dumps(rows), file=sys.stderr, flush=True)
    summary = {}
    for side in ("a", "b"):
        by_batch: dict[int, list[float]] = {}
        for r in runs[side]:
            for row in r["rows"]:
                by_batch.setdefault(row["batch_size"], []).append(row["decode_step_s"])
        summary[side] = {str(b): median(v) for b, v in by_batch.items()}
    ratio = {b: summary["b"][b] / summary["a"][b] for b in summary["a"]}
    result = {
        "benchmark": "ab_latency",
        "a": ns.a,
        "b": ns.b,
        "latency_args": ns.latency_args,
        "median_decode_step_s": summary,
        "b_over_a": ratio,
        "runs": runs,
        "env": environment(),
    }
    print(json.dumps({"median_decode_step_s": summary, "b_over_a": ratio}), file=sys.stderr)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
