"""Speculative decoding: single-request decode speed with and without it, acceptance, and the
host cost of n-gram proposals (also `pagedjax bench spec-decode`).

    python -m benchmarks.spec_decode [--speculative-config JSON] [--num-prompts 4]
        [--output-len 128] [--reps 2] [--out benchmarks/results/spec_decode.json]

Two workloads of single requests on the default model (SmolLM2-135M-Instruct), greedy, EOS
ignored, `--output-len` tokens each:
    copy: few-shot prompts "Text: A / Copy: A / Text: B / Copy:" over paragraphs of the GPL-3
        text (the answer copies what the prompt holds: the case n-gram lookup is made for);
    standard: the first `--num-prompts` prompts of workloads/standard.json.
Each request runs alone, on two engines in one process (speculation off, and
`--speculative-config`), alternating request by request, `--reps` times; decode tok/s =
(output tokens - 1) / (time from the first token to the last). Both engines must give the same
tokens (greedy is exact). Reported: medians per workload, the speed-up, the acceptance (mean
acceptance length, per-position rates) and the microseconds per `NgramProposer.propose` call
at several history lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import timeit
from pathlib import Path

import numpy as np

from benchmarks.common import STANDARD_WORKLOAD, environment, load_workload, median

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    """Few-shot copying prompts over the GPL-3 text: a paragraph and its copy, then another
    paragraph to copy (~60 words each); the answer repeats what the prompt holds."""
    words = Path("/usr/share/common-licenses/GPL-3").read_text().split()

    def para(i: int) -> str:
        return " ".join(words[400 + 80 * i : 400 + 80 * i + 60])

    out = []
    for i in range(n):
        text = f"Text: {para(2 * i)}\nCopy: {para(2 * i)}\n\nText: {para(2 * i + 1)}\nCopy:"
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def decode_one(llm, prompt: list[int], output_len: int) -> tuple[list[int], float]:
    """Runs one request alone; returns its tokens and its decode tok/s."""
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    eng.add_request("r", {"prompt_token_ids": prompt}, params)
    t_first = None
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens = o.outputs[0].token_ids
            if t_first is None and tokens:
                t_first = time.perf_counter()
    t_end = time.perf_counter()
    return list(tokens), (len(tokens) - 1) / (t_end - t_first)


def ngram_cost(lengths=(256, 1024, 4096), k: int = 4) -> dict[int, float]:
    """Microseconds per `NgramProposer.propose` call on a random history of each length (a
    fresh token appended before each call, as in decoding)."""
    from pagedjax.engine.spec_decode.ngram import NgramProposer

    rng = np.random.default_rng(0)
    out = {}
    for n in lengths:
        toks = rng.integers(0, 49152, size=n).tolist()
        prop = NgramProposer(1, 4)
        prop.propose("r", toks, k)

        def call(toks=toks, prop=prop):
            toks.append(toks[-7])
            prop.propose("r", toks, k)

        reps = 2000
        out[n] = 1e6 * timeit.timeit(call, number=reps) / reps
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/spec_decode.json")
    ns = p.parse_args(argv)

    from pagedjax import LLM

    kw = dict(
        **({"model": ns.model} if ns.model else {}),
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        disable_log_stats=True,
        use_tqdm_on_load=False,
    )
    base = LLM(**kw)
    spec = LLM(speculative_config=ns.speculative_config, **kw)
    tok = base.get_tokenizer()
    workloads = {
        "copy": copy_prompts(tok, ns.num_prompts),
        "standard": [r["prompt_token_ids"] for r in load_workload(STANDARD_WORKLOAD)][
            : ns.num_prompts
        ],
    }
    rows = []
    for name, prompts in workloads.items():
        sp = spec.llm_engine.speculator.stats
        before = (sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens)
        pos0 = list(sp.num_accepted_tokens_per_pos)
        off, on, same = [], [], True
        for rep in range(ns.reps + 1):  # the first pass warms both engines up
            for prompt in prompts:
                a, tps_off = decode_one(base, prompt, ns.output_len)
                b, tps_on = decode_one(spec, prompt, ns.output_len)
                same &= a == b
                if rep:
                    off.append(tps_off)
                    on.append(tps_on)
        drafts = sp.num_drafts - before[0]
        accepted = sp.num_accepted_tokens - before[2]
        row = {
            "workload": name,
            "num_prompts": len(prompts),
            "prompt_len_median": median([len(x) for x in prompts]),
            "output_len": ns.output_len,
            "decode_tok_s_off": median(off),
            "decode_tok_s_on": median(on),
            "speedup": median(on) / median(off),
            "identical_outputs": bool(same),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "draft_acceptance_rate": accepted / (sp.num_draft_tokens - before[1])
            if drafts
            else None,
            "per_position_acceptance": [
                (n - n0) / drafts
                for n, n0 in zip(sp.num_accepted_tokens_per_pos, pos0, strict=True)
            ]
            if drafts
            else None,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    cost = ngram_cost()
    print(f"ngram propose: {cost} us per call", file=sys.stderr)
    result = {
        "benchmark": "spec_decode",
        "speculative_config": json.loads(ns.speculative_config),
        "rows": rows,
        "ngram_propose_us": cost,
        "env": environment(),
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
