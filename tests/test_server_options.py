"""vLLM's server options beyond the engine's, on the stub engine: CORS (`--allowed-origins`
and friends, vLLM's defaults allowing every origin, preflights answered before the API key
check), `--response-role`, and `--enable-log-requests`; and their command-line parsing."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pagedjax import cli
from tests.server_tools_stub import _app, _post, stub_tokenizer

ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


def _request(app, method: str, path: str, headers: dict, body: dict | None = None):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.request(method, path, headers=headers, json=body)

    return asyncio.run(main())


def _preflight(app) -> httpx.Response:
    return _request(
        app,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )


def test_browsers_may_call_the_api_by_default_even_with_a_key(tokenizer):
    """vLLM answers every origin by default; the preflight (which carries no key) passes the
    API key check, the request itself still needs the key (it had no CORS headers at all)."""
    _, app = _app(tokenizer, api_key="k")
    pre = _preflight(app)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] in ("*", ORIGIN)
    assert "POST" in pre.headers["access-control-allow-methods"]
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    denied = _request(app, "POST", "/v1/chat/completions", {"Origin": ORIGIN}, body)
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == "*"
    ok = _request(
        app,
        "POST",
        "/v1/chat/completions",
        {"Origin": ORIGIN, "Authorization": "Bearer k"},
        body,
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_limit_them(tokenizer):
    _, app = _app(tokenizer, cors={"allow_origins": ["https://other.example"]})
    assert _preflight(app).status_code == 400  # Starlette's answer to a disallowed origin
    r = _request(app, "GET", "/v1/models", {"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_response_role_after_a_generation_prompt_only(tokenizer):
    """vLLM's rule: --response-role names the reply after a generation prompt; a continued
    final message keeps its own role. Streamed, the first delta carries it."""
    engine, app = _app(tokenizer, response_role="model")
    engine.reply = "ok"
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(app, "/v1/chat/completions", {"model": "stub", "messages": msgs})
    assert r.json()["choices"][0]["message"]["role"] == "model"
    cont = msgs + [{"role": "assistant", "content": "o"}]
    body = {
        "model": "stub",
        "messages": cont,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == (
        "assistant"
    )
    r = _post(app, "/v1/chat/completions", {"model": "stub", "messages": msgs, "stream": True})
    first = next(line for line in r.text.splitlines() if line.startswith("data: {"))
    assert '"role":"model"' in first


def test_enable_log_requests_logs_id_and_parameters_not_text(tokenizer, caplog):
    _, app = _app(tokenizer, log_requests=True)
    with caplog.at_level(logging.INFO, logger="pagedjax.server.serving"):
        r = _post(app, "/v1/completions", {"model": "stub", "prompt": "secret words", "n": 2})
    assert r.status_code == 200
    (line,) = [m for m in caplog.messages if m.startswith("Received request")]
    assert "n=2" in line and "prompt tokens" in line and "secret" not in line
    _, quiet = _app(tokenizer)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedjax.server.serving"):
        _post(quiet, "/v1/completions", {"model": "stub", "prompt": "x"})
    assert not [m for m in caplog.messages if m.startswith("Received request")]


def test_the_flags_parse_as_vllms():
    ns = cli.build_parser().parse_args(
        ["serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials"]
        + ["--response-role", "model", "--enable-log-requests"]
    )
    assert ns.allowed_origins == ["https://a.example"] and ns.allowed_methods == ["*"]
    assert ns.allow_credentials and ns.response_role == "model" and ns.enable_log_requests
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--allowed-origins", "https://a.example"])


def test_chat_template_content_format_reaches_the_template(tokenizer):
    """`--chat-template-content-format` (vLLM's; it was an unrecognized argument): "auto"
    gives a template that loops over a message's content the text parts, "string" the
    joined text (which such a template walks character by character)."""
    template = (
        "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
        "{% endfor %}"
    )
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    for fmt, want in (("auto", "[hi]"), ("openai", "[hi]"), ("string", "[][]")):
        engine, app = _app(tokenizer, chat_template=template, chat_template_content_format=fmt)
        assert _post(app, "/v1/chat/completions", body).status_code == 200
        assert tokenizer.decode(engine.requests[0][0]) == want
    ns = cli.build_parser().parse_args(["serve", "--chat-template-content-format", "openai"])
    assert ns.chat_template_content_format == "openai"
