"""A real `pagedjax serve` subprocess on 127.0.0.1 for the server tests, and helpers to read
its Prometheus metrics. The subprocess imports this checkout's code (PYTHONPATH and cwd are
the repository root)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tiny_server_args(model_dir, compile_cache_dir: str, **overrides) -> list[str]:
    """Flags for the tiny test model (the same engine settings as conftest's `make_llm`);
    an override's value may be a list (a flag of several values)."""
    flags = {
        "--dtype": "float32",
        "--max-model-len": "128",
        "--max-num-batched-tokens": "64",
        "--cuda-graph-sizes": "16,32",
        "--max-num-seqs": "16",
        "--compilation-cache-dir": compile_cache_dir,
        "--served-model-name": "tiny",
        "--uvicorn-log-level": "warning",
    }
    flags.update({k: v if isinstance(v, list) else str(v) for k, v in overrides.items()})
    args = [str(model_dir), "--disable-log-stats", "--disable-uvicorn-access-log"]
    for k, v in flags.items():
        args += [k, *v] if isinstance(v, list) else [k, v]
    return args


class RemoteServer:
    """Starts `python -m pagedjax.cli serve ARGS` on a free port of 127.0.0.1; call
    `wait_healthy()` before use (other set-up can run while the model loads).

    Args:
        args: arguments after `serve` (without --host / --port).
        log_path: where the server's output goes (default: discarded).
    """

    def __init__(self, args: list[str], log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "pagedjax.cli", "serve", *args]
        cmd += ["--host", HOST, "--port", str(self.port)]
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=self._log)
        self._log_path = log_path

    def wait_healthy(self, timeout: float = 300.0) -> RemoteServer:
        """Waits (bounded) for /health to answer 200; raises if the process dies first."""
        log_path = self._log_path
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} (log: {log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s (log: {log_path})")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then waits; kills it if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


def read_metrics(url: str) -> dict[str, float]:
    """The unlabelled-by-reason samples of /metrics: name (labels dropped) -> value; samples
    with a `finished_reason` label are keyed `name{reason}`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if 'finished_reason="' in name_labels:
            reason = name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
            name = f"{name}{{{reason}}}"
        elif "_bucket" in name:
            continue
        out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    m = read_metrics(url)
    while time.monotonic() < deadline:
        m = read_metrics(url)
        if (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["pagedjax:kv_cache_free_blocks"] == num_blocks(url)
        ):
            return m
        time.sleep(0.2)
    return m


def num_blocks(url: str) -> int:
    """num_gpu_blocks of vllm:cache_config_info (usable blocks)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    return int(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
