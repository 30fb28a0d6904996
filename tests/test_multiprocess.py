"""Two processes on localhost joined by jax.distributed (CPU collectives over gloo) run one
tensor-parallel model: each process holds one of the two KV heads (and half of every
layer), and both produce the single-process greedy output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import TEST_XLA_FLAGS

from pagedjax import SamplingParams

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_model(tiny_llama_dir, make_llm):
    port = _free_port()
    # one device per process (no inherited device count), compiled as the suite compiles
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), XLA_FLAGS=TEST_XLA_FLAGS)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "multiprocess_worker.py"),
                str(tiny_llama_dir),
                str(port),
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        line = next((ln for ln in out.splitlines() if ln.startswith("REPORT ")), None)
        assert p.returncode == 0 and line, out[-2000:] + err[-4000:]
        reports.append(json.loads(line[len("REPORT ") :]))
    llm = make_llm(
        tiny_llama_dir, max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=40
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 259, size=n).tolist()} for n in (1, 9, 40)]
    want = [
        o.outputs[0].token_ids
        for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
    ]
    for r in reports:
        assert r["process_count"] == 2
        assert len(r["devices"]) == 2
        assert r["kv_local_shards"] == [[2, 40, 16, 1, 16]]  # one of the 2 KV heads here
        assert r["tokens"] == want
