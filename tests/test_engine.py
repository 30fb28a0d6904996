"""The whole offline path on a tiny random Llama (GQA) against Hugging Face transformers:
greedy outputs token for token, whatever the batch, block size or memory pressure; the pool
is whole again afterwards; nothing compiles after warm-up; bad input is refused cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine_args import EngineArgs
from pagedjax.errors import InvalidInputError
from pagedjax.executor.model_runner import compile_count

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_idle_and_whole(llm):
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks, "a block leaked"
    assert all(c == 0 for c in pool.ref_cnt)
    # The runner forgets a finished request's row at the next step, when the scheduler tells
    # it: every row it still holds must be one that the scheduler will tell it to drop.
    runner = eng.runner
    assert set(runner.requests) <= eng.scheduler.finished_req_ids
    assert len(runner._free_slots) + len(runner.requests) == runner.num_slots - 1


@pytest.fixture(scope="module")
def llm16(make_llm, tiny_llama_dir):
    return make_llm(tiny_llama_dir, block_size=16, enforce_eager=False)


@pytest.mark.parametrize(
    "config",
    [
        dict(block_size=16),
        dict(block_size=4),
        # 26 blocks of 4 = 104 tokens, just enough for the longest request (90 + 10 tokens):
        # prompts wait for blocks, and running ones are preempted and recomputed.
        dict(block_size=4, num_gpu_blocks_override=27, enable_prefix_caching=False),
    ],
    ids=["bs16", "bs4", "bs4-small-pool"],
)
def test_greedy_batch_matches_hf(make_llm, tiny_llama_dir, prompts8, hf_greedy_cache, config):
    llm = make_llm(tiny_llama_dir, **config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts8], GREEDY, use_tqdm=False)
    for p, got in zip(prompts8, _tokens(outs), strict=True):
        assert got == hf_greedy_cache(p, 10), f"prompt of {len(p)} tokens"
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
    if "num_gpu_blocks_override" in config:
        stats = llm.llm_engine.scheduler.stats()
        assert stats.num_preemptions > 0, "the small pool should force preemptions"
        # each output counts its own request's preemptions
        assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    _assert_idle_and_whole(llm)


def test_each_prompt_alone_equals_the_batch(llm16, prompts8):
    batch = _tokens(
        llm16.generate([{"prompt_token_ids": p} for p in prompts8], GREEDY, use_tqdm=False)
    )
    for p, want in zip(prompts8, batch, strict=True):
        alone = llm16.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)
        assert alone[0].outputs[0].token_ids == want
    _assert_idle_and_whole(llm16)


def test_requests_wait_for_blocks_when_the_pool_is_small(
    make_llm, tiny_llama_dir, prompts8, hf_greedy_cache
):
    """A pool that holds about two sequences at a time: admission has to wait. Each
    request's timestamps are in order, and the waiting shows in them: some request was
    first scheduled after another had finished (first_scheduled_time was never set)."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_gpu_blocks_override=9)
    eng = llm.llm_engine
    for i, p in enumerate(prompts8):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    waited, results, times = False, {}, []
    while eng.has_unfinished_requests():
        waited |= eng.scheduler.stats().num_waiting_reqs > 0 and bool(eng.scheduler.running)
        for out in eng.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
                times.append(out.metrics)
    assert waited
    for i, p in enumerate(prompts8):
        assert results[i] == hf_greedy_cache(p, 10)
    for m in times:
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert max(m.first_scheduled_time for m in times) > min(m.finished_time for m in times)
    _assert_idle_and_whole(llm)


def test_nothing_compiles_after_warmup(llm16, prompts8):
    before = compile_count()
    rng = np.random.default_rng(3)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, seed=1),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    prompts = [
        {"prompt_token_ids": rng.integers(3, 259, size=n).tolist()}
        for n in (1, 3, 15, 16, 31, 64, 100, 127)
    ]
    llm16.generate(prompts, [params[i % 4] for i in range(8)], use_tqdm=False)
    llm16.generate(prompts[:2], GREEDY, use_tqdm=False)
    llm16.generate(["some text", "more text!"], params[1], use_tqdm=False)
    assert compile_count() == before
    _assert_idle_and_whole(llm16)


def test_enforce_eager_compiles_each_bucket_at_its_first_step(make_llm, tiny_llama_dir, prompts8):
    """`enforce_eager=True`: no step is compiled at start-up; each bucket compiles once, at
    its first step (of the ladder 1 / 4 / 16 / 32 / 64: 64-token prefill chunks, then decode
    steps of 8 rows while every request runs, fewer as they finish), is kept, and the tokens
    equal the warmed-up engine's."""
    llm = make_llm(tiny_llama_dir, enforce_eager=True, cuda_graph_sizes=None)
    steps = llm.llm_engine.runner.steps
    assert steps.executables == {} and sorted(steps.bucket_of) == [1, 4, 16, 32, 64]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts8], GREEDY, use_tqdm=False)
    assert {16, 64} <= steps.executables.keys() and 32 not in steps.executables
    compiled = dict(steps.executables)
    again = llm.generate([{"prompt_token_ids": prompts8[-1]}], GREEDY, use_tqdm=False)
    assert 1 in steps.executables  # its decode steps: one row
    assert all(steps.executables[k] is compiled[k] for k in compiled)  # kept, not redone
    want = make_llm(tiny_llama_dir, enforce_eager=False, cuda_graph_sizes=None).generate(
        [{"prompt_token_ids": p} for p in prompts8], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert again[0].outputs[0].token_ids == want[-1].outputs[0].token_ids
    _assert_idle_and_whole(llm)


def test_text_prompts_and_detokenized_output(llm16):
    tok = llm16.get_tokenizer()
    out = llm16.generate(["Hello, world", "héllo 世界"], GREEDY, use_tqdm=False)
    for o, text in zip(out, ["Hello, world", "héllo 世界"], strict=True):
        assert o.prompt == text
        assert o.prompt_token_ids == tok(text).input_ids
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_eos_and_stop_token_ids(llm16, hf_greedy_cache, prompts8):
    p = prompts8[3]
    ref = hf_greedy_cache(p, 10)
    stop_at = ref[4]
    out = llm16.generate(
        {"prompt_token_ids": p},
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    k = ref.index(stop_at)
    assert out.token_ids == ref[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def _text(llm, prompt, **kw) -> str:
    params = SamplingParams(temperature=0, **kw)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_token_that_stops_a_request_leaves_its_text_out(
    llm16, hf_greedy_cache, prompts8, skip_special_tokens
):
    """As vLLM: a request that ends on a stop token id or on EOS has the text of the tokens
    before it (the stop token stays in token_ids); `include_stop_str_in_output` keeps its
    text. With skip_special_tokens=False the EOS text was in the answer ("...<|im_end|>"),
    and a stop token's text always was."""
    p = prompts8[3]
    ref = hf_greedy_cache(p, 10)
    k = 4
    kw = dict(skip_special_tokens=skip_special_tokens)
    before, through = _text(llm16, p, max_tokens=k, **kw), _text(llm16, p, max_tokens=k + 1, **kw)
    assert before != through  # the stop token has text of its own
    for include, want in ((False, before), (True, through)):
        got = _text(
            llm16,
            p,
            max_tokens=10,
            stop_token_ids=[ref[k]],
            include_stop_str_in_output=include,
            **kw,
        )
        assert got == want, include
    # EOS: forced by a logit bias once min_tokens = 2 tokens are out
    eos = llm16.llm_engine.eos_token_id
    forced = dict(logit_bias={eos: 100.0}, min_tokens=2, **kw)
    two = _text(llm16, p, max_tokens=2, **forced)
    out = llm16.generate(
        {"prompt_token_ids": p},
        SamplingParams(temperature=0, max_tokens=10, **forced),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 3 and out.finish_reason == "stop"
    assert out.text == two
    kept = _text(llm16, p, max_tokens=10, include_stop_str_in_output=True, **forced)
    eos_text = llm16.get_tokenizer().decode([eos], skip_special_tokens=skip_special_tokens)
    assert kept == two + eos_text and (eos_text != "") == (not skip_special_tokens)


def test_top_k_one_and_tiny_top_p_are_greedy(llm16, prompts8, hf_greedy_cache):
    p = prompts8[5]
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True),
    ):
        out = llm16.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy_cache(p, 10)


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(llm16, prompts8):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    p = {"prompt_token_ids": prompts8[2]}
    alone = llm16.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in prompts8]
    batch = llm16.generate(
        [*others[:3], p, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=5)] * 3
        + [params]
        + [SamplingParams(temperature=0.5, max_tokens=9)] * 5,
        use_tqdm=False,
    )
    assert batch[3].outputs[0].token_ids == alone
    other_seed = llm16.generate(
        p, SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True), use_tqdm=False
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt(llm16, prompts8):
    out = llm16.generate(
        {"prompt_token_ids": prompts8[4]},
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    _assert_idle_and_whole(llm16)


@pytest.mark.parametrize(
    "prompt,params,match,param",
    [
        ("", GREEDY, "empty", "prompt"),
        ({"prompt_token_ids": []}, GREEDY, "empty", "prompt"),
        ({"prompt_token_ids": [5] * 129}, GREEDY, "maximum context length is 128 tokens", "prompt"),
        ({"prompt_token_ids": [5, 100000]}, GREEDY, "vocabulary", "prompt"),
        (3.5, GREEDY, "prompt must be", "prompt"),
        ("hi", SamplingParams(logprobs=21), "max_logprobs", "logprobs"),
        ("hi", SamplingParams(logit_bias={5000: 1.0}), "logit_bias", "logit_bias"),
        ("hi", SamplingParams(truncate_prompt_tokens=129), "truncate", "truncate_prompt_tokens"),
        (
            "hi",
            SamplingParams(min_tokens=1, stop_token_ids=list(range(16))),
            "at most 15",
            "stop_token_ids",
        ),
    ],
)
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(
    llm16, prompts8, hf_greedy_cache, prompt, params, match, param
):
    with pytest.raises(InvalidInputError, match=match) as e:
        llm16.generate([{"prompt_token_ids": prompts8[0]}, prompt], params, use_tqdm=False)
    assert e.value.param == param
    _assert_idle_and_whole(llm16)
    out = llm16.generate({"prompt_token_ids": prompts8[1]}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy_cache(prompts8[1], 10)


def test_bad_engine_and_sampling_arguments_name_the_field(make_llm, tiny_llama_dir):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="not_an_arg"):
        make_llm(tiny_llama_dir, not_an_arg=1)
    with pytest.raises(ValueError, match="block_size"):
        make_llm(tiny_llama_dir, block_size=12)
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(tiny_llama_dir, max_model_len=10_000)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(tiny_llama_dir, gpu_memory_utilization=1.5)
    args = EngineArgs(model=str(tiny_llama_dir), attention_backend="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="attention_backend 'cpu' runs on one CPU device"):
        args.create_engine_config()
    # vLLM's dtype spellings "half" and "float" (they were "dtype must be one of ...")
    for alias, dtype in (("half", "float16"), ("float", "float32")):
        config = EngineArgs(model=str(tiny_llama_dir), dtype=alias).create_engine_config()
        assert config.model_config.dtype == dtype
    # vLLM's load_format / config_format / runner / async_scheduling / compilation_config
    # (each was "unknown engine argument(s)"): checked against what is loaded, or read
    model = str(tiny_llama_dir)
    for kw in (
        {"load_format": "safetensors"},
        {"config_format": "hf"},
        {"runner": "generate"},
        {"structured_outputs_config": '{"backend": "guidance"}'},
        {"structured_outputs_config": {"backend": "xgrammar"}},  # served by llguidance
    ):
        EngineArgs(model=model, **kw).create_engine_config()
    for kw, match in (
        ({"load_format": "gguf"}, "load_format must be the format of"),
        ({"load_format": "pt"}, "load_format must be one of"),
        ({"config_format": "mistral"}, "config_format must be one of"),
        ({"runner": "pooling"}, "runner must be one of"),
        ({"compilation_config": "{level"}, "compilation_config must be a dict"),
        ({"structured_outputs_config": {"backend": "guidance", "x": 1}}, "no other key"),
        ({"structured_outputs_config": "guidance"}, "structured_outputs_config must be"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=model, **kw).create_engine_config()

    def compiled(**kw):
        config = EngineArgs(model=model, max_num_batched_tokens=64, **kw).create_engine_config()
        return config.scheduler_config.cuda_graph_sizes

    assert compiled(compilation_config={"cudagraph_capture_sizes": [8, 2]}) == (2, 8)
    assert compiled(compilation_config='{"cudagraph_capture_sizes": [4]}') == (4,)
    assert compiled(compilation_config=3) is None  # an -O level: nothing to read
    both = {"cudagraph_capture_sizes": [4], "level": 3}
    assert compiled(compilation_config=both, cuda_graph_sizes=[16]) == (16,)
    # vLLM's cpu_offload_gb is accepted (on CPU the weights are in host memory already);
    # it was "unknown engine argument(s)"
    EngineArgs(model=str(tiny_llama_dir), cpu_offload_gb=2).create_engine_config()
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number >= 0"):
        EngineArgs(model=str(tiny_llama_dir), cpu_offload_gb=-1).create_engine_config()
    from pagedjax.config_resolution import _check_cpu_offload

    _check_cpu_offload(0, on_cpu=False)
    with pytest.raises(ValueError, match="cpu_offload_gb=2 is not supported"):
        _check_cpu_offload(2, on_cpu=False)  # an accelerator


def test_cuda_graph_sizes_set_the_step_buckets(tiny_llama_dir):
    """`cuda_graph_sizes` (a list, or comma-separated as on the CLI) replaces the default
    ladder below the token budget, which is always a size; a size that is not a positive
    integer is a ValueError naming the field."""
    import argparse

    from pagedjax.executor.input_batch import BatchBuilder

    def sizes(value):
        args = EngineArgs(model=str(tiny_llama_dir), max_num_batched_tokens=64)
        args.cuda_graph_sizes = value
        return args.create_engine_config().scheduler_config.cuda_graph_sizes

    assert sizes(None) is None
    assert sizes("8, 1") == (1, 8) and sizes([8, 1, 8]) == (1, 8)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--cuda-graph-sizes", "2,128"]).cuda_graph_sizes == "2,128"
    for bad in ("0,4", "a", "", [-1]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            sizes(bad)
    common = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=4)
    assert BatchBuilder(**common, sizes=(1, 8, 128)).buckets == [1, 8, 64]
    assert BatchBuilder(**common).buckets == [1, 4, 16, 32, 64]


def test_auto_attention_backend_is_the_native_kernel_on_one_cpu(llm16):
    """On one CPU device with a C++ compiler (as in CI), "auto" picks the native kernel."""
    assert llm16.llm_engine.config.model_config.attention_backend == "cpu"


def test_abort_frees_blocks_mid_run(llm16, prompts8):
    eng = llm16.llm_engine
    for i, p in enumerate(prompts8):
        eng.add_request(f"a{i}", {"prompt_token_ids": p}, GREEDY)
    eng.step()
    eng.step()
    eng.abort_request([f"a{i}" for i in range(0, 8, 2)])
    while eng.has_unfinished_requests():
        eng.step()
    _assert_idle_and_whole(llm16)


def test_step_timing_splits_the_step(llm16, prompts8):
    """`last_step_timing`: the parts are non-negative and add up to at most the whole step;
    the device part of a step that ran is positive and names its bucket."""
    eng = llm16.llm_engine
    eng.add_request("timing", {"prompt_token_ids": prompts8[0]}, SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
        t = eng.last_step_timing
        parts = (t.schedule_s, t.prepare_s, t.device_s, t.update_s)
        assert min(parts) >= 0 and sum(parts) <= t.total_s * 1.001 + 1e-6
        assert t.device_s > 0 and t.bucket >= t.num_scheduled_tokens > 0
    assert not eng.has_unfinished_requests()


def test_reset_prefix_cache_forgets_cached_blocks_only_when_idle(llm16, prompts8, hf_greedy_cache):
    prompt = {"prompt_token_ids": prompts8[6]}  # 2 full blocks of 16 or more
    assert len(prompts8[6]) > 32
    llm16.generate(prompt, GREEDY, use_tqdm=False)
    again = llm16.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    eng = llm16.llm_engine
    eng.add_request("busy", prompt, GREEDY)
    eng.step()
    assert llm16.reset_prefix_cache() is False  # a request holds blocks
    eng.abort_request("busy")
    assert llm16.reset_prefix_cache() is True
    fresh = llm16.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == hf_greedy_cache(prompts8[6], 10)
    _assert_idle_and_whole(llm16)


def test_served_model_name_takes_one_name_or_several(tiny_llama_dir):
    """vLLM's `--served-model-name a b`: every name is served, the first is the default; no
    name: the model as given (vLLM's default); an empty name is a ValueError naming the field."""
    import argparse

    def names(value):
        args = EngineArgs(model=str(tiny_llama_dir), served_model_name=value)
        mc = args.create_engine_config().model_config
        return mc.served_model_name, mc.served_model_names

    assert names(None) == (str(tiny_llama_dir), (str(tiny_llama_dir),))
    assert names("a") == ("a", ("a",))
    assert names(["a", "b", "a"]) == ("a", ("a", "b"))
    with pytest.raises(ValueError, match="served_model_name must be non-empty strings"):
        names(["a", ""])
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--served-model-name", "a", "b"])
    assert EngineArgs.from_cli_args(ns).served_model_name == ["a", "b"]


def test_the_model_config_is_where_vllm_scripts_read_it(llm16, tiny_llama_dir):
    """`llm.llm_engine.model_config.max_model_len` (and `get_model_config()`), as in vLLM:
    an AttributeError before."""
    eng = llm16.llm_engine
    assert eng.model_config is eng.get_model_config() is eng.config.model_config
    assert eng.model_config.model == str(tiny_llama_dir)
    assert eng.model_config.max_model_len == 128  # make_llm's setting
