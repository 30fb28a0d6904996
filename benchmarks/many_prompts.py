"""One `/v1/completions` call with many short prompts: where its time goes.

    python -m benchmarks.many_prompts [--counts 256,2048] [--prompt-words 5] [--model M]
        [--token-ids] [--out benchmarks/results/many_prompts.json]

The server's app (`build_app`) runs in this process on the engine `pagedjax serve` would
build (the same defaults; default model SmolLM2-135M-Instruct) and is called through httpx's
in-process ASGI transport: no socket, so the HTTP framing is not measured, everything else
is. For each count N one request carries N distinct text prompts of about 10 tokens
(`--token-ids`: the same prompts as token ids), greedy, max_tokens 1, after one small
warm-up request. Reported per N, in seconds:

- total: the client's wall time for the call (request bytes pre-encoded);
- engine: the engine thread's `LLMEngine.step`s, split as `StepTiming`: device (the model's
  compute: dispatch of the compiled step until its sampled ids are on the host), and the
  engine's host work (schedule, prepare, update: scheduler, stop checks, detokenization,
  outputs); plus `engine_add`, the engine's `add_request` of every prompt (validation);
- server: FastAPI's parse and validation of the body (until `create` starts), the handler's
  tokenization (`_prompts`), `add_requests` as the event loop sees it, the wait for the
  outputs beyond the engine's own work (delivery through the per-request streams), the
  response object (`_response`) and its JSON (`JSONResponse.render`);
- client_decode: the client's json.loads of the answer.

Runs bounded (one call per N) and in one process; nothing listens on the network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from benchmarks.common import environment

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _text_prompts(n: int, words: int) -> list[str]:
    """n distinct prompts (no shared prefix beyond a word) of `words` words."""
    out = []
    for i in range(n):
        ws = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(words - 1)]
        out.append(f"{i} " + " ".join(ws))
    return out


class _Timers:
    """Accumulated seconds by name, and patches that add to them."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self._undo: list = []

    def add(self, name: str, dt: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + dt

    def wrap(self, owner, attr: str, name: str, is_async: bool = False, mark: str = "") -> None:
        real = getattr(owner, attr)
        timers = self

        if is_async:

            async def timed(*a, **k):
                t0 = time.perf_counter()
                if mark:
                    timers.marks.setdefault(mark, t0)
                try:
                    return await real(*a, **k)
                finally:
                    timers.add(name, time.perf_counter() - t0)
                    timers.marks[name + "_end"] = time.perf_counter()
        else:

            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return real(*a, **k)
                finally:
                    timers.add(name, time.perf_counter() - t0)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, real))

    def reset(self) -> None:
        self.t, self.marks = {}, {}


def _instrument(engine, timers: _Timers) -> None:
    from fastapi.responses import JSONResponse

    from pagedjax.server import serving, serving_completion

    llm_engine = engine.engine
    real_step = llm_engine.step

    def step():
        out = real_step()
        st = llm_engine.last_step_timing
        timers.add("engine_steps", st.total_s)
        timers.add("device", st.device_s)
        timers.add("schedule", st.schedule_s)
        timers.add("prepare", st.prepare_s)
        timers.add("update", st.update_s)
        timers.add("num_steps", 1)
        return out

    llm_engine.step = step
    timers.wrap(llm_engine, "add_request", "engine_add")
    cls = serving_completion.OpenAIServingCompletion
    timers.wrap(cls, "create", "create", is_async=True, mark="create_start")
    timers.wrap(cls, "_prompts", "tokenize")
    timers.wrap(serving.OpenAIServing, "add_requests", "add_requests", is_async=True)
    timers.wrap(cls, "_response", "response")
    timers.wrap(JSONResponse, "render", "json")


async def _call(app, body: bytes, timers: _Timers) -> tuple[float, float, dict]:
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=None) as c:
        t0 = time.perf_counter()
        res = await c.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        total = time.perf_counter() - t0
    res.raise_for_status()
    t1 = time.perf_counter()
    data = json.loads(res.content)
    decode = time.perf_counter() - t1
    timers.marks["request_start"] = t0
    return total, decode, data


def measure(app, engine, timers: _Timers, n: int, ns) -> dict:
    prompts: list = _text_prompts(n, ns.prompt_words)
    if ns.token_ids:
        tok = engine.get_tokenizer()
        prompts = [tok(p).input_ids for p in prompts]
    body = {"model": ns.served_name, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    raw = json.dumps(body).encode()
    timers.reset()
    total, decode, data = asyncio.run(_call(app, raw, timers))
    t = timers.t
    assert len(data["choices"]) == n
    prompt_tokens = data["usage"]["prompt_tokens"]
    engine_host = t.get("schedule", 0) + t.get("prepare", 0) + t.get("update", 0)
    # the event loop waits on the engine thread from the end of add_requests to the end of
    # create, less the response building inside create
    create = t.get("create", 0.0)
    wait = create - t.get("tokenize", 0) - t.get("add_requests", 0) - t.get("response", 0)
    parse = timers.marks.get("create_start", 0) - timers.marks["request_start"]
    row = {
        "prompts": n,
        "prompt_tokens": prompt_tokens,
        "request_bytes": len(raw),
        "response_bytes": len(json.dumps(data)),
        "total_s": total,
        "engine_steps": int(t.get("num_steps", 0)),
        "device_s": t.get("device", 0.0),
        "engine_host_s": engine_host,
        "schedule_s": t.get("schedule", 0.0),
        "prepare_s": t.get("prepare", 0.0),
        "update_s": t.get("update", 0.0),
        "engine_add_s": t.get("engine_add", 0.0),
        "server_parse_validate_s": parse,
        "server_tokenize_s": t.get("tokenize", 0.0),
        "server_add_requests_s": t.get("add_requests", 0.0),
        "server_wait_beyond_engine_s": max(0.0, wait - t.get("engine_steps", 0.0)),
        "server_response_s": t.get("response", 0.0),
        "server_json_s": t.get("json", 0.0),
        "client_decode_s": decode,
    }
    row["host_s"] = total - row["device_s"]
    return row


def _print(row: dict) -> None:
    n, total = row["prompts"], row["total_s"]

    def line(label: str, key: str) -> None:
        v = row[key]
        print(f"  {label:<34} {v:8.3f} s  {100 * v / total:5.1f} %  {1e6 * v / n:9.1f} us/prompt")

    print(
        f"{n} prompts, {row['prompt_tokens']} prompt tokens, {row['engine_steps']} engine "
        f"steps, request {row['request_bytes']} B, response {row['response_bytes']} B"
    )
    line("total", "total_s")
    line("device (model compute)", "device_s")
    line("host, all but device", "host_s")
    line("  engine: schedule", "schedule_s")
    line("  engine: prepare inputs", "prepare_s")
    line("  engine: update/outputs", "update_s")
    line("  engine: add_request (validate)", "engine_add_s")
    line("  server: parse + validate body", "server_parse_validate_s")
    line("  server: tokenize", "server_tokenize_s")
    line("  server: add_requests (queue+ack)", "server_add_requests_s")
    line("  server: output delivery", "server_wait_beyond_engine_s")
    line("  server: build response", "server_response_s")
    line("  server: JSON render", "server_json_s")
    line("  client: JSON decode", "client_decode_s")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    p.add_argument("--counts", type=_ints, default=[256, 2048])
    p.add_argument("--prompt-words", type=int, default=5, help="about 10 tokens with SmolLM2")
    p.add_argument("--token-ids", action="store_true", help="send token ids, not text")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/many_prompts.json")
    ns = p.parse_args(argv)

    from pagedjax.engine.async_llm import AsyncLLM
    from pagedjax.engine_args import EngineArgs
    from pagedjax.server.api_server import build_app

    args = EngineArgs(
        model=ns.model,
        disable_log_stats=True,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
    )
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    print(f"engine up in {time.perf_counter() - t0:.1f} s")
    ns.served_name = engine.model_config.served_model_name
    app = build_app(engine, max_request_body_bytes=1 << 30)
    timers = _Timers()
    _instrument(engine, timers)
    rows = []
    try:
        measure(app, engine, timers, 4, ns)  # warm-up
        for n in ns.counts:
            row = measure(app, engine, timers, n, ns)
            _print(row)
            rows.append(row)
    finally:
        engine.shutdown()
    result = {"env": environment(), "token_ids": ns.token_ids, "rows": rows}
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
