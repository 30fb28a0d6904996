"""Does every kind of step keep both cores busy? Step time on 1 core against all cores.

    python -m benchmarks.step_threads [--cores 0 0,1] [--reps 3]
        [--out benchmarks/results/step_threads.json]

For each core set (`taskset -c`; XLA's thread pool sizes itself to the cores the process may
run on) a child process builds the default engine (SmolLM2-135M, float32, the native CPU
kernels) and times, after a warm-up, the median over `--reps` of:
  - decode steps of 8 and of 64 running requests (128-token prompts, `latency.run_batch`);
  - a prefill step of one 512-token prompt and one of 2,048 tokens (the step's budget).
For each it records the wall time and the process CPU time (`time.process_time`, all
threads): CPU / wall is the number of cores the step kept busy (at most the core count; less
where a thread waits, or where other jobs share the machine). The speed-up is the 1-core
time over the all-core time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment, median


def _child(ns) -> dict:
    from benchmarks.latency import run_batch
    from pagedjax import LLM, SamplingParams

    llm = LLM(
        max_model_len=2304,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        disable_log_stats=True,
        use_tqdm_on_load=False,
    )
    eng = llm.llm_engine
    rnd = random.Random(0)
    out = {"cpu_kernel_isa": eng.config.model_config.cpu_kernel_isa}

    class _Ns:
        input_len, output_len = 128, 8

    for batch in (8, 64):
        run_batch(llm, batch, 0, _Ns, rnd)  # warm-up
        walls, cpus = [], []
        for _ in range(ns.reps):
            for s in run_batch(llm, batch, 0, _Ns, rnd)["decode_steps"]:
                walls.append(s["total_s"])
            c0, w0 = time.process_time(), time.perf_counter()
            run_batch(llm, batch, 0, _Ns, rnd)
            cpus.append((time.process_time() - c0) / (time.perf_counter() - w0))
        out[f"decode_{batch}"] = {"step_s": median(walls), "cores_busy": median(cpus)}
    vocab = eng.config.model_config.arch.vocab_size
    for n in (512, 2048):
        walls, cpus = [], []
        for rep in range(ns.reps + 1):
            prompt = [rnd.randrange(100, vocab) for _ in range(n)]
            eng.add_request(
                f"p{n}-{rep}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1)
            )
            c0, w0 = time.process_time(), time.perf_counter()
            eng.step()
            wall = time.perf_counter() - w0
            if rep:  # the first is a warm-up
                walls.append(wall)
                cpus.append((time.process_time() - c0) / wall)
            while eng.has_unfinished_requests():
                eng.step()
        out[f"prefill_{n}"] = {"step_s": median(walls), "cores_busy": median(cpus)}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", nargs="+", default=["0", "0,1"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/step_threads.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        json.dump(_child(ns), sys.stdout)
        return {}
    runs = {}
    for cores in ns.cores:
        with tempfile.TemporaryFile("w+") as f:
            cmd = ["taskset", "-c", cores, sys.executable, "-m", "benchmarks.step_threads"]
            subprocess.run([*cmd, "--child", "--reps", str(ns.reps)], stdout=f, check=True)
            f.seek(0)
            runs[cores] = json.load(f)
        print(f"cores {cores}: {runs[cores]}", file=sys.stderr, flush=True)
    one, *_, all_ = ns.cores
    speedup = {
        k: runs[one][k]["step_s"] / runs[all_][k]["step_s"]
        for k in runs[one]
        if isinstance(runs[one][k], dict)
    }
    print(f"speed-up {one} -> {all_}: {speedup}", file=sys.stderr)
    result = {
        "benchmark": "step_threads",
        "runs": runs,
        "speedup": speedup,
        "env": {**environment(), "cpu_count_affinity": len(os.sched_getaffinity(0))},
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
