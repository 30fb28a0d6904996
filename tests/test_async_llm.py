"""AsyncLLM in-process: outputs equal the offline engine's whatever the output kind; adds
are all-or-nothing; an abandoned request is aborted and frees its blocks; a failing step
fails only the requests then in flight and the engine keeps serving; and the server's
conversions of engine logprobs into OpenAI's objects, on hand-made engine outputs."""

from __future__ import annotations

import asyncio
import threading
import types

import httpx
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.async_llm import AsyncLLM, EngineDeadError, EngineError
from pagedjax.errors import InvalidInputError
from pagedjax.outputs import CompletionOutput, Logprob, RequestOutput
from pagedjax.sampling_params import RequestOutputKind
from pagedjax.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedjax.server.serving_chat import OpenAIServingChat
from pagedjax.server.serving_completion import OpenAIServingCompletion
from pagedjax.server.serving_errors import APIError

PROMPTS = [[10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]


@pytest.fixture(scope="module")
def llm(make_llm, tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def engine(make_llm, tiny_llama_dir):
    eng = AsyncLLM(make_llm(tiny_llama_dir).llm_engine)
    yield eng
    eng.shutdown()


def _pool_whole(eng: AsyncLLM) -> bool:
    pool = eng.engine.kv_cache_manager.pool
    return (
        not eng.engine.has_unfinished_requests()
        and eng.num_unfinished_requests == 0
        and not eng._loops  # no per-request bookkeeping left behind
        and pool.num_free_blocks == pool.num_usable_blocks
    )


async def _settle(eng: AsyncLLM) -> None:
    for _ in range(200):  # the engine thread handles aborts asynchronously
        if _pool_whole(eng):
            return
        await asyncio.sleep(0.01)


def _params(kind, **kw):
    return SamplingParams(temperature=0.0, max_tokens=9, output_kind=kind, **kw)


def test_every_output_kind_equals_offline(engine, llm):
    ref = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], _params(RequestOutputKind.FINAL_ONLY, n=2)
    )

    async def run(params, i, rid):
        return [o async for o in engine.generate({"prompt_token_ids": PROMPTS[i]}, params, rid)]

    async def main():
        kinds = [
            RequestOutputKind.DELTA,
            RequestOutputKind.CUMULATIVE,
            RequestOutputKind.FINAL_ONLY,
        ]
        jobs = [
            run(_params(k, n=2), i, f"{k.name}-{i}") for k in kinds for i in range(len(PROMPTS))
        ]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for j, outs in enumerate(results):
        kind, i = divmod(j, len(PROMPTS))
        want = ref[i].outputs
        if kind == 0:  # DELTA: the pieces join to the final output
            for k in range(2):
                pieces = [c for o in outs for c in o.outputs if c.index == k]
                assert "".join(p.text for p in pieces) == want[k].text
                assert sum((p.token_ids for p in pieces), []) == want[k].token_ids
                # each piece is new: a token, or the finish, reported once and last
                assert all(p.token_ids for p in pieces[:-1])
                assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["length"]
        else:  # CUMULATIVE grows to it; FINAL_ONLY is it, once
            assert kind == 1 or len(outs) == 1
            assert [o.text for o in outs[-1].outputs] == [w.text for w in want]
            assert [o.token_ids for o in outs[-1].outputs] == [w.token_ids for w in want]
            assert [o.finish_reason for o in outs[-1].outputs] == ["length", "length"]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert _pool_whole(engine)


def test_add_requests_is_all_or_nothing(engine):
    async def main():
        good = _params(RequestOutputKind.FINAL_ONLY)
        with pytest.raises(InvalidInputError, match="prompt 1: .*vocabulary") as info:
            await engine.add_requests(
                [("a", PROMPTS[0], good), ("b", [5, 10**6], good), ("c", PROMPTS[1], good)]
            )
        assert info.value.param == "prompt"
        await _settle(engine)
        assert _pool_whole(engine)
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_requests([("d", PROMPTS[0], good), ("d", PROMPTS[1], good)])

    asyncio.run(main())


def test_requests_are_checked_off_the_engine_thread(engine, llm, monkeypatch):
    """A request's checks and tokenization (`InputProcessor.process`) run on the inputs
    thread, never on the engine thread, with a copy of the tokenizer that gives the engine's
    ids; the engine thread only queues the checked request (`add_processed`), and a refusal
    still reaches the caller naming its field."""
    from pagedjax.engine.input_processor import InputProcessor

    threads = []
    real = InputProcessor.process

    def process(self, *args, **kw):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(InputProcessor, "process", process)
    text = "hello there, how are you"

    async def main():
        params = _params(RequestOutputKind.FINAL_ONLY)
        outs = [o async for o in engine.generate(text, params, "text")]
        with pytest.raises(InvalidInputError) as info:
            await engine.add_requests([("bad", [5, 10**6], params)])
        assert info.value.param == "prompt"
        await _settle(engine)
        return outs[-1]

    out = asyncio.run(main())
    assert threads and all(t.startswith("pagedjax-inputs") for t in threads)
    assert engine._input_processor.tokenizer is not engine.engine.tokenizer
    assert out.prompt_token_ids == llm.get_tokenizer()(text).input_ids
    want = llm.generate([text], _params(RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert _pool_whole(engine)


def test_cumulative_outputs_come_straight_from_the_engine(engine):
    kinds = []
    real_add = engine.engine.add_processed

    def spy(request_id, inp, *args, **kwargs):
        kinds.append(inp.params.output_kind)
        return real_add(request_id, inp, *args, **kwargs)

    async def run(kind, rid):
        params = _params(kind, ignore_eos=True)
        return [o async for o in engine.generate({"prompt_token_ids": PROMPTS[1]}, params, rid)]

    engine.engine.add_processed = spy  # the engine thread looks it up at each add
    try:
        cumulative = asyncio.run(run(RequestOutputKind.CUMULATIVE, "cum"))
        (final,) = asyncio.run(run(RequestOutputKind.FINAL_ONLY, "fin"))
    finally:
        del engine.engine.add_processed
    assert kinds == [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    assert len(cumulative) == 9  # one output per step, each holding everything so far
    for k, out in enumerate(cumulative):
        assert len(out.outputs[0].token_ids) == k + 1
        if k:
            assert out.outputs[0].text.startswith(cumulative[k - 1].outputs[0].text)
    last = cumulative[-1].outputs[0]
    assert (last.text, last.token_ids, last.finish_reason) == (
        final.outputs[0].text,
        final.outputs[0].token_ids,
        "length",
    )
    assert len(last.text) > len(cumulative[0].outputs[0].text)
    assert _pool_whole(engine)


def test_server_maps_engine_refusals_to_400_with_their_param():
    async def refuse(requests, priority=0, check_max_tokens=False):
        refuse.check_max_tokens = check_max_tokens
        raise refuse.error

    async def main(srv, error, **kw):
        refuse.error = error
        srv.engine.add_requests = refuse
        with pytest.raises(APIError) as info:
            await srv.add_requests([("r", {"prompt_token_ids": [1]}, SamplingParams())], 0, **kw)
        return info.value

    comp, chat = _fake_serving(OpenAIServingCompletion), _fake_serving(OpenAIServingChat)
    err = asyncio.run(
        main(comp, InvalidInputError("too many", "max_tokens"), check_max_tokens=True)
    )
    assert (err.status_code, err.body.error.param) == (400, "max_tokens")
    assert refuse.check_max_tokens is True
    err = asyncio.run(main(comp, InvalidInputError("empty", "prompt"), check_max_tokens=False))
    assert (err.status_code, err.body.error.param, err.body.error.message) == (
        400,
        "prompt",
        "empty",
    )
    err = asyncio.run(
        main(
            chat,
            InvalidInputError("long", "prompt"),
            check_max_tokens=False,
            prompt_param="messages",
        )
    )
    assert err.body.error.param == "messages"  # the chat request's field
    err = asyncio.run(main(comp, ValueError("no"), check_max_tokens=False))
    assert (err.status_code, err.body.error.param) == (400, None)


def test_sampling_params_errors_name_their_field():
    for kw, field in (
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        # wrong types: a ValueError naming the field, not a TypeError
        ({"stop": 5}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"logit_bias": 3}, "logit_bias"),
    ):
        with pytest.raises(InvalidInputError) as info:
            SamplingParams(**kw)
        assert info.value.param == field


def _aborted(eng: AsyncLLM) -> float:
    labels = {"model_name": eng.model_config.served_model_name, "finished_reason": "abort"}
    return eng.metrics.registry.get_sample_value("vllm:request_success_total", labels)


def test_abandoned_request_is_aborted_and_frees_its_blocks(engine):

    async def main():
        params = _params(RequestOutputKind.DELTA, ignore_eos=True)
        params.max_tokens = 100
        gen = engine.generate(PROMPTS[1], params, "abandoned")
        async for _ in gen:
            break
        await gen.aclose()
        await _settle(engine)

    count0 = _aborted(engine)
    asyncio.run(main())
    assert _pool_whole(engine)
    assert _aborted(engine) == count0 + 1


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_abort_from_elsewhere_ends_the_stream_with_an_abort_output(engine, kind):
    """vLLM's `await engine.abort(request_id)` while another task reads the request: the
    stream ends with a last, finished output whose samples say "abort" (it used to wait for
    ever: `abort` was not awaitable and the stream got nothing more), the blocks are freed,
    and the tokens received add up to those of the last cumulative output."""

    async def main():
        params = _params(kind, ignore_eos=True, n=2)
        params.max_tokens = 200
        outs = []

        async def read():
            async for out in engine.generate(PROMPTS[1], params, "elsewhere"):
                outs.append(out)
                if len(outs) == 3:
                    await engine.abort(["elsewhere"])

        await asyncio.wait_for(read(), timeout=60)
        await _settle(engine)
        return outs

    count0 = _aborted(engine)
    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finished and all(not o.finished for o in outs[:-1])
    assert {o.index for o in last.outputs} == {0, 1}
    assert all(o.finish_reason == "abort" for o in last.outputs)
    for i in (0, 1):
        got = [t for out in outs for o in out.outputs if o.index == i for t in o.token_ids]
        if kind == RequestOutputKind.CUMULATIVE:
            got = next(o.token_ids for o in last.outputs if o.index == i)
        assert 1 <= len(got) < 200
    assert _pool_whole(engine)
    assert _aborted(engine) == count0 + 1


def test_a_failing_step_fails_only_the_requests_in_flight(engine, llm, monkeypatch):
    runner = engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(so):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real(so)

    monkeypatch.setattr(runner, "execute", flaky)
    ref = llm.generate({"prompt_token_ids": PROMPTS[0]}, _params(RequestOutputKind.FINAL_ONLY))

    async def main():
        params = _params(RequestOutputKind.FINAL_ONLY, ignore_eos=True)
        with pytest.raises(EngineError, match="injected device failure"):
            async for _ in engine.generate(PROMPTS[1], params, "victim"):
                pass
        await _settle(engine)
        assert _pool_whole(engine) and not engine.errored
        params = _params(RequestOutputKind.FINAL_ONLY)
        return [o async for o in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "x")]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == ref[0].outputs[0].text


def test_server_internal_error_fails_one_request_only(engine, llm, monkeypatch):
    """A bug while answering one request is a 500 for it alone (in-process ASGI app)."""
    from pagedjax.server import serving_completion
    from pagedjax.server.api_server import build_app

    app = build_app(engine)
    real = serving_completion.OpenAIServingCompletion._response

    def broken(self, request, *args):
        if request.user == "unlucky":
            raise KeyError("injected bug")
        return real(self, request, *args)

    monkeypatch.setattr(serving_completion.OpenAIServingCompletion, "_response", broken)
    ref = llm.generate({"prompt_token_ids": PROMPTS[0]}, _params(RequestOutputKind.FINAL_ONLY))
    body = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 9}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            bad, good = await asyncio.gather(
                http.post("/v1/completions", json={**body, "user": "unlucky"}),
                http.post("/v1/completions", json=body),
            )
            health = await http.get("/health")
        return bad, good, health

    bad, good, health = asyncio.run(main())
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == ref[0].outputs[0].text
    assert health.status_code == 200
    assert _pool_whole(engine)


def test_shutdown_fails_streams_and_refuses_new_requests(make_llm, tiny_llama_dir):
    eng = AsyncLLM(make_llm(tiny_llama_dir).llm_engine)

    async def main():
        params = _params(RequestOutputKind.DELTA, ignore_eos=True)
        params.max_tokens = 100
        (stream,) = await eng.add_requests([("s", PROMPTS[1], params)])
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_requests([("t", PROMPTS[0], params)])

    asyncio.run(main())
    assert eng.errored


# --------------------------------------------------------- conversions, by hand


def _fake_serving(cls):
    tok = types.SimpleNamespace(decode=lambda ids, **kw: "".join(f"<{i}>" for i in ids))
    arch = types.SimpleNamespace(vocab_size=100)
    mc = types.SimpleNamespace(
        max_model_len=64, arch=arch, default_sampling_fields={}, model="m", source_path="m"
    )
    engine = types.SimpleNamespace(get_tokenizer=lambda: tok, model_config=mc)
    return cls(engine, "m", None)


LOGPROBS = [
    {5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.5, 2, "c")},
    {9: Logprob(-0.5, 1, "z"), 6: Logprob(-1.0, 2, "b"), 8: Logprob(float("-inf"), 3, "y")},
]
OUTPUT = CompletionOutput(index=0, text="ab", token_ids=[5, 6], logprobs=LOGPROBS)


def test_completion_logprobs_object():
    srv = _fake_serving(OpenAIServingCompletion)
    req = CompletionRequest(prompt="x", logprobs=1)
    res = RequestOutput("r", None, [3, 4], [OUTPUT], True)
    lp = srv._logprobs(req, OUTPUT, res, 0, 0)
    assert lp.tokens == ["a", "b"]
    assert lp.token_logprobs == [-0.1, -1.0]
    assert lp.top_logprobs == [{"a": -0.1}, {"z": -0.5, "b": -1.0}]  # top 1 + the sampled one
    assert lp.text_offset == [0, 1]
    # echo: the prompt's tokens first (the first one has no logprob), offsets run on
    res.prompt_logprobs = [None, {4: Logprob(-3.0, 5, "d"), 8: Logprob(-0.2, 1, "q")}]
    lp = srv._logprobs(CompletionRequest(prompt="x", logprobs=2, echo=True), OUTPUT, res, 0, 4)
    assert lp.tokens == ["<3>", "d", "a", "b"]
    assert lp.token_logprobs == [None, -3.0, -0.1, -1.0]
    assert lp.text_offset == [0, 3, 4, 5]
    assert lp.top_logprobs[1] == {"q": -0.2, "d": -3.0}
    assert lp.top_logprobs[3] == {"z": -0.5, "b": -1.0}
    # not asked for, or not computed by the engine: no object
    assert srv._logprobs(CompletionRequest(prompt="x"), OUTPUT, res, 0, 0) is None
    no_lp = CompletionOutput(index=0, text="ab", token_ids=[5, 6])
    assert srv._logprobs(req, no_lp, res, 0, 0) is None


def test_chat_logprobs_object():
    srv = _fake_serving(OpenAIServingChat)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    req.top_logprobs = 3
    content = srv._logprobs(req, OUTPUT).model_dump()["content"]
    assert [c["token"] for c in content] == ["a", "b"]
    assert [c["logprob"] for c in content] == [-0.1, -1.0]
    assert content[0]["bytes"] == [97]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["z", "b", "y"]
    assert content[1]["top_logprobs"][2]["logprob"] == -9999.0  # -inf, as JSON allows
    req.logprobs = False
    assert srv._logprobs(req, OUTPUT) is None


def test_bad_words_are_tokenized_in_one_call_and_capped(llm, monkeypatch):
    """The engine thread tokenizes a request's bad words in one batched call (each word with
    and without a leading space, as vLLM), refuses more than MAX_BAD_WORDS words before
    tokenizing any, and refuses words that cannot be encoded, naming bad_words."""
    from pagedjax.engine.input_processor import MAX_BAD_WORDS

    proc = llm.llm_engine.input_processor
    tok = proc.tokenizer
    words = [f"w{i}" for i in range(100)] + ["w0", "  hello", "z"]
    want: dict[tuple[int, ...], None] = {}
    for w in words:
        for prefix in ("", " "):
            want[tuple(tok(prefix + w.lstrip(), add_special_tokens=False).input_ids)] = None
    calls = []

    class Counting:
        def __call__(self, *args, **kwargs):
            calls.append(args)
            return tok(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(tok, name)

    monkeypatch.setattr(proc, "tokenizer", Counting())
    got = proc._bad_words_token_ids(SamplingParams(bad_words=words))
    assert got == [list(w) for w in want]
    assert len(calls) == 1
    calls.clear()
    for bad_words in (["a"] * (MAX_BAD_WORDS + 1), ["ok", "\ud800"]):
        with pytest.raises(InvalidInputError) as info:
            proc.process([5], SamplingParams(bad_words=bad_words))
        assert info.value.param == "bad_words"
    assert len(calls) == 1  # the over-long list was refused before tokenizing
    assert MAX_BAD_WORDS == 1024


def test_vllms_async_names_import_from_the_package():
    """`from vllm import AsyncLLMEngine, AsyncEngineArgs` and vLLM's `AsyncLLM`: the same
    names from `pagedjax` (`AsyncLLM` was only in `pagedjax.engine.async_llm`)."""
    import pagedjax
    from pagedjax import AsyncEngineArgs, AsyncLLMEngine, EngineArgs

    assert pagedjax.AsyncLLM is AsyncLLM is AsyncLLMEngine
    assert AsyncEngineArgs is EngineArgs
