"""The OpenAI-compatible server as clients see it: a real `pagedjax serve` subprocess on
127.0.0.1 with the tiny random model, driven by the `openai` client and httpx. Its answers
must equal the offline `LLM` engine's for the same prompts and parameters, streamed or not;
usage and finish reasons must be right; many clients at once must each get their own
output; clients that go away must leave no request running and no block held; the metrics
must count what happened."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest

import pagedjax
from pagedjax import SamplingParams
from tests.server_utils import RemoteServer, num_blocks, read_metrics, tiny_server_args, wait_idle

PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3,", "a"]
GREEDY = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, compile_cache_dir, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("server") / "server.log"
    names = {"--served-model-name": ["tiny", "tiny-alias"]}  # vLLM's several names
    srv = RemoteServer(tiny_server_args(tiny_llama_dir, compile_cache_dir, **names), log_path=log)
    try:
        request.getfixturevalue("llm")  # built while the server loads
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def llm(make_llm, tiny_llama_dir):
    """The offline engine with the server's settings: the reference outputs."""
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _offline(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_completions_equal_offline_streamed_or_not(server, client, llm):
    ref = _offline(llm, PROMPTS, **GREEDY)
    res = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY)
    assert res.object == "text_completion" and res.model == "tiny"
    assert [c.index for c in res.choices] == list(range(len(PROMPTS)))
    for choice, r in zip(res.choices, ref, strict=True):
        assert choice.text == r.outputs[0].text
        assert choice.finish_reason == "length"
    prompt_tokens = sum(len(r.prompt_token_ids) for r in ref)
    assert res.usage.prompt_tokens == prompt_tokens
    assert res.usage.completion_tokens == 12 * len(PROMPTS)
    assert res.usage.total_tokens == prompt_tokens + 12 * len(PROMPTS)

    stream = client.completions.create(
        model="tiny", prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, finish, usage = [""] * len(PROMPTS), [None] * len(PROMPTS), []
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage.append(chunk.usage)
        for c in chunk.choices:
            assert finish[c.index] is None, "a chunk after the finishing one"
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason
    assert texts == [c.text for c in res.choices]
    assert finish == ["length"] * len(PROMPTS)
    assert len(usage) == 1 and usage[0] == res.usage


def test_token_id_prompts_n_and_echo(server, client, llm):
    ids = [[40, 41, 42, 43], [100, 7]]
    ref = _offline(llm, [{"prompt_token_ids": p} for p in ids], **GREEDY)
    res = client.completions.create(model="tiny", prompt=ids, n=2, echo=True, **GREEDY)
    tok = llm.get_tokenizer()
    assert [c.index for c in res.choices] == [0, 1, 2, 3]  # choice = prompt * n + sample
    for c in res.choices:
        prompt = ids[c.index // 2]
        assert c.text == tok.decode(prompt) + ref[c.index // 2].outputs[0].text
    assert res.usage.prompt_tokens == 6 and res.usage.completion_tokens == 4 * 12


def test_the_engine_truncates_and_usage_counts_the_kept_tokens(server, client, llm):
    ids = list(range(5, 205))  # 200 tokens, more than max_model_len (128)
    ref = _offline(llm, [{"prompt_token_ids": ids[-100:]}], **GREEDY)[0]
    for stream in (False, True):
        res = client.completions.create(
            model="tiny",
            prompt=ids,
            stream=stream,
            echo=True,
            extra_body={"truncate_prompt_tokens": 100},
            **({"stream_options": {"include_usage": True}} if stream else {}),
            **GREEDY,
        )
        if stream:
            chunks = list(res)
            text = "".join(c.text for chunk in chunks for c in chunk.choices)
            usage = chunks[-1].usage
        else:
            text, usage = res.choices[0].text, res.usage
        assert text == llm.get_tokenizer().decode(ids[-100:]) + ref.outputs[0].text
        assert (usage.prompt_tokens, usage.completion_tokens) == (100, 12)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi " * 150}],
        extra_body={"truncate_prompt_tokens": 20},
        **GREEDY,
    )
    assert chat.usage.prompt_tokens == 20 and chat.usage.completion_tokens == 12


def test_seeded_sampling_equals_offline(server, client, llm):
    kw = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    ref = _offline(llm, PROMPTS[:2], **kw)
    res = client.completions.create(
        model="tiny",
        prompt=PROMPTS[:2],
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        max_tokens=16,
        extra_body={"top_k": 50},
    )
    assert [c.text for c in res.choices] == [r.outputs[0].text for r in ref]


def test_stop_string_and_stop_token_finish_with_stop(server, client, llm):
    ref = _offline(llm, [PROMPTS[0]], **GREEDY)[0].outputs[0]
    k = next(i for i in range(1, 10) if ref.text.find(ref.text[i : i + 2]) == i)
    stop = ref.text[k : k + 2]
    for stream in (False, True):
        res = client.completions.create(
            model="tiny", prompt=PROMPTS[0], stop=[stop], stream=stream, **GREEDY
        )
        chunks = list(res) if stream else [res]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c for c in chunks if c.choices][-1].choices[0]
        assert text == ref.text[:k]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    stop_id = ref.token_ids[3]
    res = client.completions.create(
        model="tiny", prompt=PROMPTS[0], extra_body={"stop_token_ids": [stop_id]}, **GREEDY
    )
    first = ref.token_ids.index(stop_id)
    assert res.usage.completion_tokens == first + 1  # the stop token is kept
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].model_extra["stop_reason"] == stop_id


def test_chat_equals_offline_streamed_or_not(server, client, llm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    res = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=10
    )
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == ref.outputs[0].text
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=10,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, roles, finish, usage = ["", ""], [[], []], [[], []], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert not finish[c.index], "a chunk after the choice's finish"
            roles[c.index] += [c.delta.role] if c.delta.role else []
            content[c.index] += c.delta.content or ""
            finish[c.index] += [c.finish_reason] if c.finish_reason else []
    assert content == [ref.outputs[0].text] * 2
    assert roles == [["assistant"], ["assistant"]]
    assert finish == [["length"], ["length"]]  # once per choice, in its last chunk
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), 20)


def test_responses_equal_offline_chat_streamed_or_not(server, client, llm):
    """`/v1/responses`: the same reply as the offline chat; a repeated prompt is served
    from the prefix cache and its usage says how much of it."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Which is the largest ocean on Earth?"},
    ]
    ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    kw = dict(model="tiny", instructions="Be brief.", input=messages[1]["content"])
    res = client.responses.create(**kw, temperature=0, max_output_tokens=10)
    assert res.output_text == ref.outputs[0].text and res.status == "incomplete"
    assert res.usage.input_tokens == len(ref.prompt_token_ids)
    assert res.usage.output_tokens == 10
    again = client.responses.create(**kw, temperature=0, max_output_tokens=10)
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < len(ref.prompt_token_ids), cached  # whole blocks of the prompt
    with client.responses.stream(**kw, temperature=0, max_output_tokens=10) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()  # a cut reply ends with response.completed too
    assert text == final.output_text == ref.outputs[0].text
    assert final.status == "incomplete"


def test_chat_without_max_tokens_runs_to_max_model_len(server, client, llm):
    messages = [{"role": "user", "content": "Hi"}]
    ref = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0]
    res = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert res.usage.total_tokens == 128  # max_model_len
    assert res.choices[0].message.content == ref.outputs[0].text


def _top(step: dict, k: int, chosen=None) -> dict[str, float]:
    """An engine logprob dict's k best entries (then the chosen token's) as OpenAI's
    {token: logprob}; of tokens that decode alike, the first is kept."""
    out: dict[str, float] = {}
    for lp in sorted(step.values(), key=lambda lp: lp.rank)[:k] + [chosen] * (chosen is not None):
        out.setdefault(lp.decoded_token, lp.logprob)
    return out


def test_completion_logprobs_equal_the_engine(server, client, llm):
    ref = _offline(llm, [PROMPTS[0]], logprobs=2, **GREEDY)[0].outputs[0]
    for stream in (False, True):
        res = client.completions.create(
            model="tiny", prompt=PROMPTS[0], logprobs=2, stream=stream, **GREEDY
        )
        chunks = [c.choices[0] for c in res if c.choices] if stream else [res.choices[0]]
        tokens = sum((c.logprobs.tokens for c in chunks if c.logprobs), [])
        lps = sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), [])
        tops = sum((c.logprobs.top_logprobs for c in chunks if c.logprobs), [])
        offsets = sum((c.logprobs.text_offset for c in chunks if c.logprobs), [])
        steps = [step[t] for step, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        assert tokens == [lp.decoded_token for lp in steps]
        assert lps == pytest.approx([lp.logprob for lp in steps], abs=1e-4)
        for got, step, t in zip(tops, ref.logprobs, ref.token_ids, strict=True):
            want = _top(step, 2, step[t])
            assert got == pytest.approx(want, abs=1e-4)
        assert offsets == [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]


def test_echo_with_logprobs_includes_the_prompt(server, client, llm):
    ref = _offline(llm, [[40, 41, 42]], logprobs=1, prompt_logprobs=1, **GREEDY)[0]
    res = client.completions.create(
        model="tiny", prompt=[40, 41, 42], echo=True, logprobs=1, **GREEDY
    )
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == 3 + 12
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate([40, 41, 42]) if i]
    assert lp.token_logprobs[1:3] == pytest.approx(want, abs=1e-4)


def test_chat_logprobs_equal_the_engine(server, client, llm):
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    ref = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    res = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = res.choices[0].logprobs.content
    for c, step, t in zip(content, ref.logprobs, ref.token_ids, strict=True):
        assert c.token == step[t].decoded_token
        assert c.logprob == pytest.approx(step[t].logprob, abs=1e-4)
        assert c.bytes == list(c.token.encode())
        best = sorted(step.values(), key=lambda lp: lp.rank)[:3]
        assert [x.token for x in c.top_logprobs] == [lp.decoded_token for lp in best]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(
            [lp.logprob for lp in best], abs=1e-4
        )


def _prompt_logprobs_json(ref) -> list:
    """The engine's prompt logprobs as vLLM's server sends them: None for the first prompt
    token, then {token id (a string key): {"logprob", "rank", "decoded_token"}}."""
    return [
        None
        if step is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in step.items()
        }
        for step in ref.prompt_logprobs
    ]


def _assert_same_prompt_logprobs(got, want):
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert set(g) == set(w)
        for t in w:
            assert g[t]["rank"] == w[t]["rank"]
            assert g[t]["decoded_token"] == w[t]["decoded_token"]
            assert g[t]["logprob"] == pytest.approx(w[t]["logprob"], abs=1e-4)


def test_prompt_logprobs_on_completions_and_chat(server, client, llm):
    """vLLM's `prompt_logprobs` extra: `choices[i].prompt_logprobs` on completions (echo or
    not, streamed or not), the response's `prompt_logprobs` on chat; values are the engine's."""
    ref = _offline(llm, [PROMPTS[0]], prompt_logprobs=2, **GREEDY)[0]
    want = _prompt_logprobs_json(ref)
    res = client.completions.create(
        model="tiny", prompt=PROMPTS[0], n=2, extra_body={"prompt_logprobs": 2}, **GREEDY
    )
    assert [c.text for c in res.choices] == [ref.outputs[0].text] * 2
    for c in res.choices:
        _assert_same_prompt_logprobs(c.model_extra["prompt_logprobs"], want)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], stream=True, extra_body={"prompt_logprobs": 2}, **GREEDY
    )
    got = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert got[0] is not None and all(g is None for g in got[1:])  # once, in the first chunk
    _assert_same_prompt_logprobs(got[0], want)

    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)
    ref = llm.chat(messages, params, use_tqdm=False)[0]
    res = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=6,
        extra_body={"prompt_logprobs": 1},
    )
    assert res.choices[0].message.content == ref.outputs[0].text
    _assert_same_prompt_logprobs(res.model_extra["prompt_logprobs"], _prompt_logprobs_json(ref))


def test_chat_echo_continues_the_final_assistant_message(server, client, llm):
    """vLLM's chat `echo`: with continue_final_message, the reply starts with the final
    assistant message's content (streamed: in the choice's first content chunk)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    ref = llm.chat(
        messages,
        SamplingParams(temperature=0.0, max_tokens=6),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    res = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, extra_body=extra
    )
    assert res.choices[0].message.content == "Hel" + ref.outputs[0].text
    assert res.usage.completion_tokens == len(ref.outputs[0].token_ids)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=6,
        stream=True,
        extra_body=extra,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hel" + ref.outputs[0].text
    # Without echo the reply is only what the model wrote.
    extra["echo"] = False
    res = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, extra_body=extra
    )
    assert res.choices[0].message.content == ref.outputs[0].text


def test_models_health_version_tokenize(server, client, llm):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].model_extra["max_model_len"] == 128
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": pagedjax.__version__}
    tok = llm.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}).json()
    assert r["tokens"] == tok("Hello").input_ids and r["count"] == 5 and r["max_model_len"] == 128
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok("<|user|>Hi</s><|assistant|>").input_ids
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "<|user|>Hi</s><|assistant|>"


def test_a_response_reports_the_served_name_its_request_used(server, client, tiny_llama_dir):
    """`--served-model-name tiny tiny-alias`: either name is accepted and echoed (vLLM's
    rule); a request that names no model gets the first; the outputs are the same."""
    body = {"prompt": [50, 51, 52], "temperature": 0, "max_tokens": 4}
    alias = client.completions.create(model="tiny-alias", **body)
    first = client.completions.create(model="tiny", **body)
    assert (alias.model, first.model) == ("tiny-alias", "tiny")
    assert alias.choices[0].text == first.choices[0].text
    chat = client.chat.completions.create(
        model="tiny-alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.model == "tiny-alias"
    unnamed = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert unnamed["model"] == "tiny"
    # "" is the default as in vLLM, and the path the server was started with is accepted
    # (vLLM's default name); both were 404s
    empty = httpx.post(server.url + "/v1/completions", json={**body, "model": ""}, timeout=60)
    assert empty.status_code == 200 and empty.json()["model"] == "tiny"
    path = client.completions.create(model=str(tiny_llama_dir), **body)
    assert path.model == str(tiny_llama_dir) and path.choices[0].text == first.choices[0].text


def test_metrics_count_one_request_exactly(server, client, llm):
    before = wait_idle(server.url)
    ids = [50, 51, 52, 53, 54, 55, 56]
    client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=9)
    after = read_metrics(server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:prompt_tokens_total"] == 7
    assert delta["vllm:generation_tokens_total"] == 9
    assert delta["vllm:request_success_total{length}"] == 1
    assert delta["vllm:request_success_total{abort}"] == 0
    assert delta["vllm:time_to_first_token_seconds_count"] == 1
    assert delta["vllm:inter_token_latency_seconds_count"] == 8
    assert delta["vllm:e2e_request_latency_seconds_count"] == 1
    assert delta["vllm:request_prompt_tokens_sum"] == 7
    assert delta["vllm:request_generation_tokens_sum"] == 9
    assert delta["vllm:request_max_num_generation_tokens_sum"] == 9
    assert delta["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(
        delta["vllm:request_decode_time_seconds_sum"] / 8
    )
    # one step of the 7 prompt tokens, then 8 of one token each
    assert delta["vllm:iteration_tokens_total_count"] == 9
    assert delta["vllm:iteration_tokens_total_sum"] == 7 + 8
    assert delta["vllm:request_params_n_sum"] == 1
    assert delta["vllm:request_params_max_tokens_sum"] == 9
    assert delta["vllm:request_num_preemptions_count"] == 1
    assert delta["vllm:request_num_preemptions_sum"] == 0
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta[f"vllm:request_{phase}_time_seconds_count"] == 1, phase
    assert delta["vllm:request_prefill_time_seconds_sum"] > 0
    assert delta["vllm:request_decode_time_seconds_sum"] > 0
    assert delta["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        delta["vllm:request_prefill_time_seconds_sum"]
        + delta["vllm:request_decode_time_seconds_sum"]
    )
    assert delta["vllm:prefix_cache_queries_total"] == 7
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["pagedjax:kv_cache_free_blocks"] == num_blocks(server.url) > 0
    # A 40-token prompt fills 2 blocks of 16: run again, it finds both in the prefix cache.
    long = list(range(60, 100))
    client.completions.create(model="tiny", prompt=long, temperature=0, max_tokens=1)
    mid = read_metrics(server.url)
    client.completions.create(model="tiny", prompt=long, temperature=0, max_tokens=1)
    end = read_metrics(server.url)
    assert end["vllm:prefix_cache_hits_total"] - mid["vllm:prefix_cache_hits_total"] == 32
    assert end["vllm:prefix_cache_queries_total"] - mid["vllm:prefix_cache_queries_total"] == 40
    assert end["vllm:prompt_tokens_cached_total"] - mid["vllm:prompt_tokens_cached_total"] == 32
    computed = "vllm:request_prefill_kv_computed_tokens_sum"
    assert end[computed] - mid[computed] == 40 - 32


def test_64_concurrent_streaming_clients(server, llm):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 259, size=int(rng.integers(1, 40))).tolist() for _ in range(64)]
    max_tokens = [int(x) for x in rng.integers(4, 20, size=64)]
    ref = [
        o.outputs[0].text
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens],
            use_tqdm=False,
        )
    ]
    aclient = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
    )

    async def one(i):
        stream = await aclient.completions.create(
            model="tiny", prompt=prompts[i], temperature=0, max_tokens=max_tokens[i], stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 300)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert [t for t, _ in results] == ref
    assert all(r == "length" for _, r in results)
    m = wait_idle(server.url)
    assert m["vllm:num_requests_running"] == 0


def _reason_delta(before, after, reason):
    key = f"vllm:request_success_total{{{reason}}}"
    return after[key] - before[key]


def test_disconnecting_streaming_clients_abort_and_free_every_block(server, client, llm):
    before = wait_idle(server.url)
    body = {"model": "tiny", "prompt": "Tell me", "max_tokens": 110, "ignore_eos": True}

    async def streaming(http):
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    return  # leaves the stream: the connection is closed mid-response

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.wait_for(asyncio.gather(*(streaming(http) for _ in range(50))), 120)

    asyncio.run(main())
    after = wait_idle(server.url)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["pagedjax:kv_cache_free_blocks"] == num_blocks(server.url)
    assert _reason_delta(before, after, "abort") == 50
    assert _reason_delta(before, after, "length") == 0
    # The server still answers correctly afterwards.
    ref = _offline(llm, [PROMPTS[1]], **GREEDY)[0].outputs[0].text
    res = client.completions.create(model="tiny", prompt=PROMPTS[1], **GREEDY)
    assert res.choices[0].text == ref


def test_sigterm_finishes_in_flight_requests_and_exits_0(server, llm):
    """Last in this module: it stops the module's server (the fixture then finds it gone)."""
    ref = _offline(llm, ["Once upon"], temperature=0.0, max_tokens=100, ignore_eos=True)
    body = {"prompt": "Once upon", "temperature": 0, "max_tokens": 100, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data:"))
        server.proc.terminate()  # SIGTERM while the request is in flight
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting connections
            httpx.get(server.url + "/health", timeout=5)
        rest = [x for x in lines if x.startswith("data:")]
    chunks = [first, *rest]
    assert chunks[-1] == "data: [DONE]"
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1])
    assert text == ref[0].outputs[0].text  # finished, not cut
    assert server.proc.wait(60) == 0
