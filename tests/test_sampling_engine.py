"""Sampling parameters through the whole engine: logprobs and prompt logprobs against Hugging
Face, repetition penalty against HF's processor, penalties that stay in their own row, seeds,
min_tokens, stop strings inside tokens, incremental detokenization, chat and beam search."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_model

from pagedjax import BeamSearchParams, SamplingParams
from pagedjax.errors import InvalidInputError


@pytest.fixture(scope="module")
def llm(make_llm, tiny_llama_dir):
    return make_llm(tiny_llama_dir, block_size=16)


def _ids(out):
    return out.outputs[0].token_ids


def test_logprobs_match_hf_log_softmax(llm, tiny_hf, prompts8):
    p = prompts8[4]
    out = llm.generate(
        {"prompt_token_ids": p},
        SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    seq = p + _ids(out)
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([seq])).logits[0], -1).numpy()
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(p) - 1 + j]
        top = np.argsort(-row)[:3]
        assert list(lps)[:3] == top.tolist()  # the top 3, in rank order
        for rank, t in enumerate(top, start=1):
            assert lps[t].rank == rank
            assert abs(lps[t].logprob - row[t]) < 1e-4
        assert abs(lps[tok].logprob - row[tok]) < 1e-4  # greedy: the sampled token is top 1
    assert (
        abs(
            comp.cumulative_logprob
            - sum(ref[len(p) - 1 + j][t] for j, t in enumerate(comp.token_ids))
        )
        < 1e-3
    )
    plp = out.prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        row = ref[i - 1]
        entry = plp[i]
        assert abs(entry[p[i]].logprob - row[p[i]]) < 1e-4
        assert entry[p[i]].rank == 1 + int(np.sum(row > row[p[i]]))
        top2 = np.argsort(-row)[:2]
        for t in top2:
            assert abs(entry[t].logprob - row[t]) < 1e-4


def test_logprobs_zero_gives_the_sampled_tokens_logprob(llm, tiny_hf, prompts8):
    """logprobs=0: only the sampled token's logprob and rank (vLLM's meaning), also for a
    sampled (not greedy) token, next to a request that asked for none in the same steps."""
    p, q = prompts8[2], prompts8[3]
    sp0 = SamplingParams(temperature=1.0, seed=7, max_tokens=4, logprobs=0, ignore_eos=True)
    none = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out, other = llm.generate(
        [{"prompt_token_ids": p}, {"prompt_token_ids": q}], [sp0, none], use_tqdm=False
    )
    comp = out.outputs[0]
    seq = p + _ids(out)
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([seq])).logits[0], -1).numpy()
    want = [ref[len(p) - 1 + j][t] for j, t in enumerate(comp.token_ids)]
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert list(lps) == [tok]
        assert abs(lps[tok].logprob - want[j]) < 1e-4
        assert lps[tok].rank == 1 + int(np.sum(ref[len(p) - 1 + j] > want[j]))
    assert abs(comp.cumulative_logprob - sum(want)) < 1e-3
    assert other.outputs[0].logprobs is None and other.outputs[0].cumulative_logprob is None


def test_logprob_entries_decode_each_token_id_once(llm, prompts8, monkeypatch):
    """Every logprob entry (output and prompt, 5 alternatives each) carries its token's text
    alone, `tokenizer.decode([id])`, decoded once per token id for the engine's lifetime:
    two requests over the same prompt add no decode calls the second time."""
    proc = llm.llm_engine.output_processor
    tok = proc.tokenizer
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(tuple(ids))
            return tok.decode(ids)

    monkeypatch.setattr(proc, "tokenizer", Counting())
    monkeypatch.setattr(proc, "_token_text", {}, raising=False)  # forget earlier tests
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5)
    first = llm.generate({"prompt_token_ids": prompts8[7]}, sp, use_tqdm=False)[0]
    entries = [d for d in first.prompt_logprobs[1:] + first.outputs[0].logprobs]
    seen = {t for d in entries for t in d}
    assert sum(len(d) for d in entries) > 2 * len(seen)  # ids repeat (90 prompt positions)
    assert all(lp.decoded_token == tok.decode([t]) for d in entries for t, lp in d.items())
    assert sorted(calls) == sorted((t,) for t in seen)
    n = len(calls)
    again = llm.generate({"prompt_token_ids": prompts8[7]}, sp, use_tqdm=False)[0]
    assert len(calls) == n
    assert again.prompt_logprobs == first.prompt_logprobs


def test_prompt_logprobs_across_chunks_and_with_a_cached_prefix(
    make_llm, tiny_llama_dir, tiny_hf, prompts8
):
    """A 90-token prompt over steps of 32 tokens, after the same prompt filled the cache."""
    llm = make_llm(tiny_llama_dir, block_size=16, max_num_batched_tokens=32)
    p = prompts8[7]
    llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate(
        {"prompt_token_ids": p}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([p])).logits[0], -1).numpy()
    got = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    np.testing.assert_allclose(got, [ref[i - 1][p[i]] for i in range(1, len(p))], atol=1e-4)


def test_repetition_penalty_matches_hf(llm, tiny_hf, prompts8):
    for p in (prompts8[3], prompts8[6]):
        out = llm.generate(
            {"prompt_token_ids": p},
            SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8, ignore_eos=True),
            use_tqdm=False,
        )[0]
        with torch.no_grad():
            ref = tiny_hf.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=1.8,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert _ids(out) == ref[0, len(p) :].tolist()


def test_penalties_do_not_leak_between_batched_requests(llm, prompts8, hf_greedy_cache):
    heavy = SamplingParams(
        temperature=0,
        max_tokens=10,
        ignore_eos=True,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias={5: 3.0},
        bad_words=None,
    )
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts8]
    alone = [_ids(o) for o in llm.generate(prompts[:4], heavy, use_tqdm=False)]
    mixed = llm.generate(prompts, [heavy, plain] * 2 + [plain, heavy] * 2, use_tqdm=False)
    for i, o in enumerate(mixed):
        if i in (0, 2):
            assert _ids(o) == alone[i]
        elif i in (1, 3, 4, 6):
            assert _ids(o) == hf_greedy_cache(prompts8[i], 10)
    # The heavy penalties do change the output of the rows that use them.
    assert alone[0] != hf_greedy_cache(prompts8[0], 10)


def test_logit_bias_allowed_tokens_and_bad_words(llm, prompts8):
    p = {"prompt_token_ids": prompts8[2]}
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=6, logit_bias={77: 100.0}), use_tqdm=False
    )[0]
    assert _ids(out) == [77] * 6
    out = llm.generate(
        p,
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, allowed_token_ids=[40, 41, 42]),
        use_tqdm=False,
    )[0]
    assert set(_ids(out)) <= {40, 41, 42}
    greedy = _ids(llm.generate(p, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0])
    tok = llm.get_tokenizer()
    word = tok.decode(greedy[1:3])  # two byte tokens: a multi-token bad word
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=6, bad_words=[word]), use_tqdm=False
    )[0]
    assert _ids(out)[:2] == greedy[:2] and _ids(out)[2] != greedy[2]


def test_min_tokens_suppresses_stop_tokens(llm, prompts8, hf_greedy_cache):
    p = prompts8[1]
    ref = hf_greedy_cache(p, 10)
    out = llm.generate(
        {"prompt_token_ids": p},
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[0]], min_tokens=3),
        use_tqdm=False,
    )[0]
    toks = _ids(out)
    assert ref[0] not in toks[:3] and len(toks) >= 3


def test_seeded_n4_samples_differ_and_repeat(llm, prompts8):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8)
    p = {"prompt_token_ids": prompts8[5]}
    first = [o.token_ids for o in llm.generate(p, params, use_tqdm=False)[0].outputs]
    second = [o.token_ids for o in llm.generate(p, params, use_tqdm=False)[0].outputs]
    assert first == second
    assert len({tuple(s) for s in first}) == 4


def test_top_p_top_k_min_p_sampling_stays_in_the_kept_set(llm, tiny_hf, prompts8):
    p = prompts8[0]
    with torch.no_grad():
        logits = tiny_hf(torch.tensor([p])).logits[0, -1].numpy()
    order = np.argsort(-logits)
    out = llm.generate(
        {"prompt_token_ids": p},
        SamplingParams(n=8, temperature=1.0, top_k=3, max_tokens=1, seed=5),
        use_tqdm=False,
    )[0]
    assert {o.token_ids[0] for o in out.outputs} <= set(order[:3].tolist())
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = set(np.nonzero(probs >= 0.5 * probs.max())[0].tolist())
    out = llm.generate(
        {"prompt_token_ids": p},
        SamplingParams(n=8, temperature=1.0, min_p=0.5, max_tokens=1, seed=6),
        use_tqdm=False,
    )[0]
    assert {o.token_ids[0] for o in out.outputs} <= keep


@pytest.fixture(scope="module")
def smol_llm(make_llm, smol_vocab_dir):
    return make_llm(smol_vocab_dir, block_size=16, max_model_len=128)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_inside_tokens(smol_llm, include):
    """Stop strings that start and end in the middle of tokens (multi-character tokens)."""
    tok = smol_llm.get_tokenizer()
    prompt = "The weather today is"
    base = smol_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, skip_special_tokens=False),
        use_tqdm=False,
    )[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    text = base.text
    assert text == "".join(pieces)
    # A stop string from the middle of token 6 to the middle of token 8.
    starts = np.cumsum([0] + [len(x) for x in pieces])
    j = next(i for i in range(5, len(pieces)) if len(pieces[i]) >= 2 and len(pieces[i + 2]) >= 2)
    begin, end = starts[j] + 1, starts[j + 2] + 1
    stop = text[begin:end]
    assert stop and text.find(stop) == begin
    out = smol_llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == (text[:end] if include else text[:begin])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[: j + 3]


def test_detokenizer_deltas_join_to_the_full_decode(smol_tokenizer):
    """Random token sequences (emoji, CJK, accents and random ids) streamed one token at a
    time: the joined deltas equal the full decode and hold no U+FFFD it does not have."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pagedjax.engine.detokenizer import IncrementalDetokenizer

    tok = smol_tokenizer
    texts = st.text(alphabet=st.sampled_from(list("aé çñü漢字日本語😀🎉👍🏽 ,.!Zz\n")), max_size=20)
    ids = st.lists(st.integers(0, tok.vocab_size - 1), max_size=12)

    @settings(max_examples=120, deadline=None)
    @given(texts, ids, st.booleans())
    def check(text, extra, skip_special):
        tokens = tok(text).input_ids + extra
        prompt = tok("Hi").input_ids
        d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip_special))
        deltas = []
        for i in range(len(tokens)):
            d.update(tokens[: i + 1])
            deltas.append(d.get_text(False, True))
        d.flush(tokens)
        deltas.append(d.get_text(True, True))
        full = tok.decode(prompt + tokens, skip_special_tokens=skip_special)[
            len(tok.decode(prompt, skip_special_tokens=skip_special)) :
        ]
        joined = "".join(deltas)
        assert joined == full
        for delta in deltas[:-1]:
            assert "\ufffd" not in delta or "\ufffd" in full

    check()


def test_chat_renders_the_template_exactly(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert tok.decode(out.prompt_token_ids) == want
    assert out.prompt_token_ids == tok(want, add_special_tokens=False).input_ids
    assert out.prompt == want  # vLLM's chat outputs carry the rendered text
    cont = llm.chat(
        conv + [{"role": "assistant", "content": "Hel"}],
        SamplingParams(max_tokens=2),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    assert tok.decode(cont.prompt_token_ids).endswith("<|assistant|>Hel")
    assert cont.prompt.endswith("<|assistant|>Hel")


@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_matches_hf(llm, tiny_llama_dir, prompts8, beams):
    hf = hf_model(tiny_llama_dir)
    for p in (prompts8[2], prompts8[5]):
        out = llm.beam_search(
            [{"prompt_token_ids": p}],
            BeamSearchParams(beam_width=beams, max_tokens=6, ignore_eos=True),
        )
        best = out[0].sequences[0]
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                num_beams=beams,
                do_sample=False,
                max_new_tokens=6,
                eos_token_id=None,
                pad_token_id=0,
                early_stopping=False,
                length_penalty=1.0,
            )
        assert best.tokens[len(p) :] == ref[0, len(p) :].tolist()
        assert len(out[0].sequences) == beams
        scores = [s.cum_logprob for s in out[0].sequences]
        assert scores == sorted(scores, reverse=True)
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_streamed_text_holds_back_a_possible_stop_string(llm):
    """The last len(longest stop string) - 1 characters are not streamed, since they could
    still become a stop string; they are released when the request ends another way."""
    from pagedjax.engine.detokenizer import IncrementalDetokenizer

    tok = llm.get_tokenizer()
    d = IncrementalDetokenizer(tok, [5], SamplingParams(stop=["STOP!"]))
    deltas, output = [], []
    for ch in "go STO":
        output += tok(ch, add_special_tokens=False).input_ids
        deltas.append(d.get_text(False, True) if d.update(output) is None else None)
    assert "".join(deltas) == "go"  # 4 characters held back: " STO"
    output += tok("P", add_special_tokens=False).input_ids
    assert d.update(output) is None
    assert d.get_text(False, True) == " "
    d.flush(output)
    assert d.get_text(True, True) == "STOP"  # ended another way: everything is released
    d2 = IncrementalDetokenizer(tok, [5], SamplingParams(stop=["STOP!"]))
    assert d2.update(tok("a STOP! b", add_special_tokens=False).input_ids) == "STOP!"
    assert d2.get_text(True, False) == "a "


def test_seeds_differing_above_bit_31_sample_differently_and_each_repeats(llm, prompts8):
    """All 64 bits of a seed count: 5 and 5 + 2**32 share their low 32 bits but draw
    differently; each draws the same tokens alone and inside a batch of other requests."""
    p = {"prompt_token_ids": prompts8[1]}

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)

    low = _ids(llm.generate(p, params(5), use_tqdm=False)[0])
    high = _ids(llm.generate(p, params(5 + 2**32), use_tqdm=False)[0])
    assert low != high
    others = [{"prompt_token_ids": q} for q in prompts8[2:6]]
    batch = llm.generate(
        [others[0], p, others[1], p, *others[2:]],
        [
            SamplingParams(temperature=1.0, max_tokens=5, seed=9),
            params(5 + 2**32),
            SamplingParams(temperature=0.7, max_tokens=6),
            params(5),
            SamplingParams(temperature=0, max_tokens=3),
            SamplingParams(temperature=1.0, max_tokens=7),
        ],
        use_tqdm=False,
    )
    assert _ids(batch[1]) == high
    assert _ids(batch[3]) == low


def test_seed_minus_one_means_no_seed(llm, prompts8):
    """vLLM: seed=-1 is no seed, so two such requests draw differently; seed=7 repeats."""
    from pagedjax.server.protocol import ChatCompletionRequest, CompletionRequest

    assert SamplingParams(seed=-1).seed is None
    assert CompletionRequest(prompt="x", seed=-1).to_sampling_params().seed is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], seed=-1)
    assert chat.to_sampling_params().seed is None
    p = {"prompt_token_ids": prompts8[6]}

    def run(seed):
        sp = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        return _ids(llm.generate(p, sp, use_tqdm=False)[0])

    assert run(-1) != run(-1)
    assert run(7) == run(7)


def test_priority_without_the_priority_policy_is_refused(llm):
    """vLLM's rule: a priority the fcfs scheduler would ignore is an error naming the field,
    and nothing is queued."""
    with pytest.raises(InvalidInputError) as e:
        llm.generate(
            [{"prompt_token_ids": [10, 11]}, {"prompt_token_ids": [12, 13]}],
            SamplingParams(max_tokens=1),
            priority=[0, 3],
            use_tqdm=False,
        )
    assert e.value.param == "priority" and "scheduling_policy" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [10, 11]}], SamplingParams(max_tokens=1), priority=[0])
    assert len(out[0].outputs[0].token_ids) == 1
