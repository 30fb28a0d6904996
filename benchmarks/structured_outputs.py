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

Then the slow-grammar check: 8 unconstrained streams decode; a request with a large schema
(`big_schema(400)`: 400 nested objects, 0.2-0.5 s to compile) is added mid-stream. The gaps
between consecutive tokens of the streams while the grammar compiles are compared with the
median step time before it: the goal is that no gap exceeds one step time more than usual
(the grammar compiles on the worker pool; the steps go on). The same with the compile done
synchronously on the engine thread (as it would be without the pool) gives the contrast.
`--slow-reps N` runs the check N times with the native kernels leaving the compile a core
(the engine's default) and N times without (alternating), and summarises both: the largest
gap over the median step, how long the request waited for its grammar, and the time the
streams lost in all (in steps). `--slow-only` runs just that. It also reports what adding
such a request costs the engine's thread (`add_request` against `add_processed` of an input
checked elsewhere). `--served-reps N` then runs the check N times each way through `AsyncLLM`
(the server's engine): requests checked on its inputs thread, as served, or on the engine
thread, as before (gaps between the first stream's tokens as its coroutine receives them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
from pathlib import Path

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


_schemas_made = 0


def big_schema(n: int) -> dict:
    """n required nested objects (5 patterned strings, a 30-value enum, a bounded number)."""
    item = {
        "type": "object",
        "properties": {
            **{f"s{j}": {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,4}"} for j in range(5)},
            "e": {"enum": [f"v{k}" for k in range(30)]},
            "n": {"type": "number", "minimum": -5, "maximum": 1000},
        },
        "required": ["e"],
    }
    props = {f"field_{i}": dict(item) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


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


def slow_grammar(llm, reqs: list[dict], synchronous: bool, leave_cores: bool = True) -> dict:
    """8 unconstrained streams; a large-schema request added after 10 steps. Gaps between the
    streams' steps while its grammar compiles, against the median step before. `leave_cores`
    False: the native kernels keep every thread while the grammar compiles (the engine's
    `on_compiling` hook unset for this run)."""

    eng = llm.llm_engine
    mgr = eng.structured_output
    hook = mgr.on_compiling
    if not leave_cores:
        mgr.on_compiling = None
    try:
        return _slow_grammar(eng, mgr, reqs, synchronous) | {"leave_cores": leave_cores}
    finally:
        mgr.on_compiling = hook


def _slow_grammar(eng, mgr, reqs: list[dict], synchronous: bool) -> dict:
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import StructuredOutputsParams

    for i, r in enumerate(reqs[:8]):
        eng.add_request(
            f"s{i}",
            {"prompt_token_ids": r["prompt_token_ids"][:32]},
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=60),
        )
    stamps: list[float] = []  # when each step that gave the streams a token returned
    added_at = ready_at = None
    global _schemas_made
    _schemas_made += 1
    schema = big_schema(400 + _schemas_made)  # a new schema each time: no cache hit
    so = StructuredOutputsParams(json=schema)
    compiles0 = mgr.stats["compile_s"]
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("s") for o in outs):
            stamps.append(now)
        if len(stamps) == 10 and added_at is None:
            added_at = time.perf_counter()
            params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
            eng.add_request("big", "Fill the form:", params)
            if synchronous:  # what the engine thread would pay without the pool
                mgr.wait_any([eng.scheduler.requests["big"].structured_output], 60)
        waiting = eng.scheduler.stats().num_waiting_for_grammar
        if added_at is not None and ready_at is None and waiting == 0:
            ready_at = now
    before = [b - a for a, b in zip(stamps[:9], stamps[1:10], strict=True)]
    during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if added_at <= b <= ready_at]
    during = during or [stamps[10] - stamps[9]]
    step = statistics.median(before)
    return {
        "synchronous_compile": synchronous,
        "median_step_before_s": step,
        "compile_s": mgr.stats["compile_s"] - compiles0,
        "grammar_wait_s": ready_at - added_at,
        "max_gap_while_compiling_s": max(during),
        "gaps_while_compiling_s": during,
        "max_gap_over_median_step": max(during) / step,
    }


def add_cost(eng, reps: int = 5) -> dict:
    """What adding a request with a new `big_schema(400)` costs the thread that drives the
    engine (median ms over `reps`): `add_request` (checks, schema serialised, grammar text,
    queued) against `add_processed` of an input already checked elsewhere (as the server's
    inputs thread does)."""
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import StructuredOutputsParams

    global _schemas_made
    whole, queued, compiling = [], [], []
    for _ in range(reps):
        for processed in (False, True):
            _schemas_made += 1
            so = StructuredOutputsParams(json=big_schema(400 + _schemas_made))
            params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
            rid = f"add-{_schemas_made}"
            if processed:
                inp = eng.input_processor.process("Fill the form:", params)
                t0 = time.perf_counter()
                eng.add_processed(rid, inp)
                queued.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                eng.add_request(rid, "Fill the form:", params)
                whole.append(time.perf_counter() - t0)
            compiling.append(eng.scheduler.requests[rid].structured_output.compiled)
            eng.abort_request(rid)
    concurrent.futures.wait(compiling)  # so that no compile runs beside what follows
    return {
        "add_request_ms": 1e3 * statistics.median(whole),
        "add_processed_ms": 1e3 * statistics.median(queued),
    }


def slow_grammar_served(llm, reqs: list[dict], reps: int) -> list[dict]:
    """The slow-grammar check through `AsyncLLM` (the server's engine), `reps` times each way,
    alternating: requests checked on the inputs thread (as served), or on the engine thread
    (the server before: `add_processed` patched to run the checks there). Gaps between the
    first stream's tokens as its coroutine receives them, from the big request's add until
    its first token, against the median gap before. Takes the engine over from `llm`."""
    import asyncio

    from pagedjax import SamplingParams
    from pagedjax.engine.async_llm import AsyncLLM
    from pagedjax.sampling_params import StructuredOutputsParams

    eng = AsyncLLM(llm.llm_engine)
    core = llm.llm_engine
    processed_add = core.add_processed

    def checks_on_engine_thread(on: bool) -> None:
        if on:  # the inputs thread passes the raw request; the engine thread checks it
            eng._process_inputs = lambda rs, check: [(rid, (p, sp, check)) for rid, p, sp in rs]

            def add_processed(rid, raw, arrival_time=None, priority=0):
                inp = core.input_processor.process(*raw)
                processed_add(rid, inp, arrival_time, priority)

            core.add_processed = add_processed
        else:
            eng.__dict__.pop("_process_inputs", None)
            core.add_processed = processed_add

    async def once(tag: str) -> dict:
        global _schemas_made
        stamps: list[float] = []

        async def stream(i: int, r: dict) -> None:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=60)
            prompt = {"prompt_token_ids": r["prompt_token_ids"][:32]}
            async for _ in eng.generate(prompt, params, f"{tag}-{i}"):
                if i == 0:
                    stamps.append(time.perf_counter())

        tasks = [asyncio.create_task(stream(i, r)) for i, r in enumerate(reqs[:8])]
        while len(stamps) < 10:
            for t in tasks:
                if t.done():  # a stream failed (or ended) before its 10th token
                    t.result()
                    raise RuntimeError("a stream ended before its 10th token")
            await asyncio.sleep(0.0005)
        _schemas_made += 1
        so = StructuredOutputsParams(json=big_schema(400 + _schemas_made))
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
        added_at, first = time.perf_counter(), None
        async for _ in eng.generate("Fill the form:", params, f"{tag}-big"):
            first = first or time.perf_counter()
        await asyncio.gather(*tasks)
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        step = statistics.median(gaps[:9])
        during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if added_at <= b <= first]
        return {
            "median_step_before_s": step,
            "gaps_while_compiling_s": during,
            "max_gap_over_median_step": max(during) / step,
            "first_gap_over_median_step": during[0] / step,
        }

    runs = []
    try:
        for rep in range(reps):
            for on_engine in (False, True) if rep % 2 == 0 else (True, False):
                checks_on_engine_thread(on_engine)
                tag = f"served-{rep}-{on_engine}"
                runs.append(asyncio.run(once(tag)) | {"checks_on_engine_thread": on_engine})
    finally:
        checks_on_engine_thread(False)
        eng.shutdown()
    return runs


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
    slow = []
    for rep in range(ns.slow_reps):  # alternating which setting goes first
        for leave in (True, False) if rep % 2 == 0 else (False, True):
            slow.append(slow_grammar(llm, reqs, False, leave_cores=leave))
    slow.append(slow_grammar(llm, reqs, True))
    for s in slow:
        print(
            "slow grammar",
            json.dumps({k: v for k, v in s.items() if k != "gaps_while_compiling_s"}),
        )
    slow_summary = {}
    for leave in (True, False):
        runs_ = [s for s in slow if s["leave_cores"] == leave and not s["synchronous_compile"]]
        ratios = [s["max_gap_over_median_step"] for s in runs_]
        # the time the streams lost while it compiled, in steps: sum over gaps of (gap - step)
        extra = [
            sum(g - s["median_step_before_s"] for g in s["gaps_while_compiling_s"])
            / s["median_step_before_s"]
            for s in runs_
        ]
        slow_summary["leave_cores" if leave else "all_cores"] = {
            "runs": len(ratios),
            "median_max_gap_over_median_step": statistics.median(ratios),
            "worst": max(ratios),
            "runs_over_2": sum(r > 2.0 for r in ratios),
            "median_grammar_wait_s": statistics.median(s["grammar_wait_s"] for s in runs_),
            "median_extra_steps": statistics.median(extra),
        }
    print("slow grammar summary", json.dumps(slow_summary))
    slow_summary["engine_thread_add"] = add_cost(llm.llm_engine)
    print("engine thread's cost of an add", json.dumps(slow_summary["engine_thread_add"]))
    if ns.served_reps:
        served = slow_grammar_served(llm, reqs, ns.served_reps)
        slow_summary["served"] = {
            where: {
                k: statistics.median(r[k] for r in served if r["checks_on_engine_thread"] == on)
                for k in ("max_gap_over_median_step", "first_gap_over_median_step")
            }
            | {
                "runs_over_2": sum(
                    r["max_gap_over_median_step"] > 2.0
                    for r in served
                    if r["checks_on_engine_thread"] == on
                )
            }
            for where, on in (("inputs_thread", False), ("engine_thread", True))
        }
        slow_summary["served_runs"] = served
        print("served slow grammar", json.dumps(slow_summary["served"]))
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
