"""Helpers shared by the benchmarks: workloads and the environment a result was measured in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
STANDARD_WORKLOAD = HERE / "workloads" / "standard.json"


def load_workload(path: str | Path = STANDARD_WORKLOAD) -> list[dict]:
    """Requests of a workload file: each with prompt_token_ids and output_len."""
    with open(path) as f:
        data = json.load(f)
    return data["requests"]


def environment() -> dict:
    """Commit, versions, machine and thread settings, recorded with every result."""
    try:
        import jax
    except ImportError:  # the vllm backend's Python has no JAX
        jax = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    except OSError:
        pass
    return {
        "commit": commit,
        "python": platform.python_version(),
        "jax": jax.__version__ if jax else None,
        "backend": jax.default_backend() if jax else None,
        "devices": [str(d) for d in jax.devices()] if jax else [],
        "machine": platform.machine(),
        "cpu": cpu,
        # the vector extensions the native kernels' ISA paths depend on
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": list(os.getloadavg()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def shared_prefix_workload(
    num_requests: int = 64,
    prefix_len: int = 200,
    suffix_len: tuple[int, int] = (16, 64),
    output_len: int = 32,
    vocab: tuple[int, int] = (1000, 40000),
    seed: int = 0,
) -> list[dict]:
    """Requests that share one `prefix_len`-token prefix (a system prompt), each with its own
    suffix of U[suffix_len] tokens; token ids are drawn uniformly from `vocab`."""
    import random

    rnd = random.Random(seed)
    prefix = [rnd.randrange(*vocab) for _ in range(prefix_len)]
    reqs = []
    for i in range(num_requests):
        suffix = [rnd.randrange(*vocab) for _ in range(rnd.randint(*suffix_len))]
        reqs.append({"id": i, "prompt_token_ids": prefix + suffix, "output_len": output_len})
    return reqs


def load_any_workload(name: str) -> list[dict]:  # noqa: D103
    """A workload file's requests, or a generated one: "shared-prefix"."""
    if name == "shared-prefix":
        return shared_prefix_workload()
    return load_workload(name)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
