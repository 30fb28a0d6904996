"""The HTTP app's own rules, in process, on a stub engine (no model is loaded): the request
body size limit (413 before the body is parsed) and OpenAI error bodies for the endpoints
this server does not have."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from pagedjax.server.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, build_app


def _stub_engine():
    arch = SimpleNamespace(vocab_size=320)
    mc = SimpleNamespace(
        served_model_name="stub",
        served_model_names=("stub",),
        default_sampling_fields={},
        max_model_len=64,
        model="stub",
        source_path="stub",
        arch=arch,
    )
    return SimpleNamespace(
        model_config=mc, get_tokenizer=lambda: None, errored=False, shutdown=lambda: None
    )


def _request(app, method: str, path: str, **kw) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.request(method, path, **kw)

    return asyncio.run(main())


def _assert_openai_error(res: httpx.Response, status: int) -> dict:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def test_default_limit_is_16_mib():
    assert DEFAULT_MAX_REQUEST_BODY_BYTES == 16 * 1024 * 1024


def test_body_over_the_limit_is_413_by_content_length():
    app = build_app(_stub_engine(), max_request_body_bytes=1000)
    body = b'{"model": "stub", "prompt": "' + b"a" * 2000 + b'"}'
    res = _request(
        app, "POST", "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    err = _assert_openai_error(res, 413)
    assert "1000" in err["message"] and "--max-request-body-bytes" in err["message"]


def test_streamed_body_over_the_limit_is_413():
    """A chunked body (no Content-Length) is counted as it arrives."""
    app = build_app(_stub_engine(), max_request_body_bytes=1000)

    async def chunks():
        yield b'{"model": "stub", "prompt": "'
        for _ in range(10):
            yield b"a" * 200
        yield b'"}'

    res = _request(
        app,
        "POST",
        "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(res, 413)


def test_body_under_the_limit_is_parsed_as_before():
    app = build_app(_stub_engine(), max_request_body_bytes=1000)
    res = _request(
        app,
        "POST",
        "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(res, 400)
    res = _request(app, "POST", "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert _assert_openai_error(res, 404)["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/v1/audio/speech"])
def test_unsupported_endpoints_are_404_with_an_openai_error_naming_them(path):
    app = build_app(_stub_engine())
    res = _request(app, "POST", path, json={"model": "stub", "input": "x"})
    err = _assert_openai_error(res, 404)
    assert path in err["message"] and "not supported" in err["message"]
    assert "/v1/chat/completions" in err["message"]  # says what is there


def test_a_wrong_method_on_a_known_path_is_still_405():
    res = _request(build_app(_stub_engine()), "GET", "/v1/completions")
    assert res.status_code == 405 and "error" in res.json()
