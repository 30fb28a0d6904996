"""Structured outputs: what a JSON-schema constraint costs, and what a slow grammar costs others.

    python -m benchmarks.structured_outputs [--num-requests 64] [--reps 1] [--slow-reps 1]
        [--slow-only] [--served-reps 0]
        [--out benchmarks/results/structured_outputs.json]

One engine on the default model (SmolLM2-135M-Instruct) runs the standard workload
(`workloads/standard.json`: exact prompt token ids, greedy, EOS ignored, output_len tokens
each) in three variants, interleaved `--reps` times:

    none      no request constrained
    all       every request constrained by `SCHEMA` (a list of at least 64 person records:
              strings with a length bound and a pattern, a bounded integer, an enum array, a
              boolean), which cannot complete within 256 tokens, so each request still makes
              exactly output_len tokens
    one_in_8  requests 0, 8, 16, ... constrained, the others not

For each: output tok/s, the mean step time, the time spent filling bitmasks (per step that had
one, and its share of the wall time), and the grammar compile time (one compile: the schema is
the same, the others hit the cache). The variants share one engine, and each runs once untimed
first, so compilation (XLA's step shapes, the grammar) is paid outside the timed runs. The
summary gives the medians over the reps and each rep's ratio to the unconstrained run of the
same rep.

The device side alone (`mask_apply`): the jitted `ops.bitmask.maybe_apply_token_bitmask` on
[S, 49152] float32 logits for S = 16, 64, 256, with the flag off (what a step without a
constrained row runs) and on; medians of 50 calls after a warm-up.

Then the slow-grammar check (`benchmarks/slow_grammar.py`, which can also run alone):
`--slow-reps N` runs it N times for each variant in process (the engine as it is, as it was
before its compiles moved to the idle class, and with no grammar), `--served-reps N` N times
each way through `AsyncLLM`; `--slow-only` runs just that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import slow_grammar
from benchmarks.common import STANDARD_WORKLOAD, environment, load_workload

SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z]{2,12}\\.(com|org|net)$"},
            "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "tags", "active"],
        "additionalProperties": False,
    },
}


def run_variant(llm, reqs: list[dict], every: int) -> dict:
    """The workload with requests i % every == 0 constrained (every=0: none)."""
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import StructuredOutputsParams

    eng = llm.llm_engine
    mgr = eng.structured_output
    stats0 = dict(mgr.stats)
    so = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        constrained = every and i % every == 0
        eng.add_request(
            str(i),
            {"prompt_token_ids": r["prompt_token_ids"]},
            SamplingParams(
                temperature=0.0,
                ignore_eos=True,
                max_tokens=r["output_len"],
                structured_outputs=so if constrained else None,
            ),
        )
    lens, texts, steps, step_s = {}, {}, 0, 0.0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                lens[out.request_id] = len(out.outputs[0].token_ids)
                texts[out.request_id] = out.outputs[0].text
        steps += 1
        step_s += eng.last_step_timing.total_s
    wall = time.perf_counter() - t0
    assert [lens[str(i)] for i in range(len(reqs))] == [r["output_len"] for r in reqs]
    fills = mgr.stats["fills"] - stats0["fills"]
    fill_s = mgr.stats["fill_s"] - stats0["fill_s"]
    out_tokens = sum(r["output_len"] for r in reqs)
    return {
        "constrained_requests": sum(1 for i in range(len(reqs)) if every and i % every == 0),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "steps": steps,
        "mean_step_s": step_s / steps,
        "steps_with_bitmask": fills,
        "bitmask_fill_s_per_step": fill_s / fills if fills else 0.0,
        "bitmask_fill_share_of_wall": fill_s / wall,
        "grammar_compiles": mgr.stats["compiles"] - stats0["compiles"],
        "grammar_compile_s": mgr.stats["compile_s"] - stats0["compile_s"],
        "sample_output": texts.get("0", "")[:200],
    }


def mask_apply(rows=(16, 64, 256), vocab: int = 49152, calls: int = 30) -> list[dict]:
    """Seconds per call of greedy sampling (an argmax over [S, V] float32 logits) alone
    (`base_s`), behind the step's masking with the flag off and an all-ones mask already on
    the device (`off_s`, a step without constrained rows), and with the flag on and a mask
    sent from the host (`on_s`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.ops.bitmask import maybe_apply_token_bitmask

    base = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    masked = jax.jit(lambda x, m, f: jnp.argmax(maybe_apply_token_bitmask(x, m, f), axis=-1))
    out = []
    for S in rows:
        rng = np.random.default_rng(S)
        logits = jax.device_put(rng.standard_normal((S, vocab)).astype(np.float32))
        host_mask = rng.integers(-(2**31), 2**31, size=(S, (vocab + 31) // 32)).astype(np.int32)
        ones = jax.device_put(np.full(host_mask.shape, -1, np.int32))
        calls_ = {
            "base_s": (base, (logits,)),
            "off_s": (masked, (logits, ones, False)),
            "on_s": (masked, (logits, host_mask, True)),
        }
        row = {"rows": S}
        for fn, args in calls_.values():
            fn(*args).block_until_ready()
        times = {name: [] for name in calls_}
        for _ in range(calls):  # interleaved, so that the machine's load hits all three alike
            for name, (fn, args) in calls_.items():
                t0 = time.perf_counter()
                fn(*args).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        row.update({name: statistics.median(t) for name, t in times.items()})
        out.append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(STANDARD_WORKLOAD))
    ap.add_argument("--num-requests", type=int, default=64, help="the first N requests")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--slow-reps",
        type=int,
        default=1,
        help="pairs of slow-grammar runs, with and without leaving a core to the compile",
    )
    ap.add_argument("--slow-only", action="store_true", help="only the slow-grammar check")
    ap.add_argument(
        "--served-reps",
        type=int,
        default=0,
        help="pairs of slow-grammar runs through AsyncLLM (inputs checked off / on the engine "
        "thread), at the end",
    )
    ap.add_argument("--out", default="benchmarks/results/structured_outputs.json")
    ns = ap.parse_args(argv)
    if ns.slow_only:
        ns.reps = 0

    from pagedjax import LLM

    reqs = load_workload(ns.workload)[: ns.num_requests]
    llm = LLM(max_model_len=ns.max_model_len, disable_log_stats=True, use_tqdm_on_load=False)
    # Warm the llguidance tokenizer, the schema's grammar and every step shape of the three
    # variants (with and without a bitmask) outside the timed runs.
    warm = run_variant(llm, reqs[:1], every=1)
    for every in (0, 1, 8) if ns.reps else ():
        run_variant(llm, reqs, every)
    runs: dict[str, list[dict]] = {"none": [], "all": [], "one_in_8": []}
    for _ in range(ns.reps):
        for name, every in (("none", 0), ("all", 1), ("one_in_8", 8)):
            runs[name].append(run_variant(llm, reqs, every))
            print(
                name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "sample_output"})
            )
    slow, slow_summary = slow_grammar.run(llm, reqs, ns.slow_reps, ns.served_reps)
    if ns.slow_only:
        result = {"slow_grammar": slow, "slow_grammar_summary": slow_summary, "env": environment()}
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=1))
        return
    masking = mask_apply()
    print("mask apply", json.dumps(masking))

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    summary = {
        name: {
            k: med(name, k)
            for k in (
                "output_tokens_per_s",
                "mean_step_s",
                "bitmask_fill_s_per_step",
                "bitmask_fill_share_of_wall",
                "grammar_compile_s",
            )
        }
        for name in runs
    }
    summary["all_over_none_tok_s"] = (
        summary["all"]["output_tokens_per_s"] / summary["none"]["output_tokens_per_s"]
    )
    summary["one_in_8_over_none_tok_s"] = (
        summary["one_in_8"]["output_tokens_per_s"] / summary["none"]["output_tokens_per_s"]
    )
    summary["one_in_8_over_none_step_time"] = (
        summary["one_in_8"]["mean_step_s"] / summary["none"]["mean_step_s"]
    )
    for name in ("all", "one_in_8"):  # each rep against the unconstrained run just before it
        summary[f"{name}_over_none_tok_s_per_rep"] = [
            a["output_tokens_per_s"] / b["output_tokens_per_s"]
            for a, b in zip(runs[name], runs["none"], strict=True)
        ]
    result = {
        "workload": ns.workload,
        "num_requests": len(reqs),
        "schema": SCHEMA,
        "schema_compile_s": warm["grammar_compile_s"],
        "reps": ns.reps,
        "summary": summary,
        "runs": runs,
        "slow_grammar": slow,
        "slow_grammar_summary": slow_summary,
        "mask_apply": masking,
        "env": environment(),
    }
    print(json.dumps(summary, indent=1))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
