"""The slow-grammar check: what a large schema's compile costs the streams already running.

    python -m benchmarks.slow_grammar [--reps 4] [--served-reps 6] [--json-form]
        [--out benchmarks/results/slow_grammar.json]

8 unconstrained streams decode on the default model (SmolLM2-135M-Instruct; 32-token prompts
of the standard workload, greedy, 60 tokens each); after 10 steps a request with a large
schema (`big_schema(400)`: 400 nested objects, 265 kB, 0.2-0.5 s to compile; a new one each
run, so no cache hit) is added. The gaps between the streams' tokens while the grammar
compiles are compared with the median step before it: the goal is that no gap exceeds two
step times (no stream's next token delayed by more than one step). The same with the compile
done synchronously on the engine thread (as it would be without the pool) gives the contrast.

`--reps N` runs the check N times with the native kernels leaving the compile a core (the
engine's default) and N times without (alternating), on `LLMEngine` driven in this thread,
and summarises both: the largest gap over the median step, how long the request waited for
its grammar, and the time the streams lost in all (in steps). It also reports what adding
such a request costs the engine's thread (`add_request` against `add_processed` of an input
checked elsewhere). `--served-reps N` then runs the check N times each way through `AsyncLLM`
(the server's engine): requests checked on its inputs thread, as served, or on the engine
thread, as before (gaps between the first stream's tokens as its coroutine receives them).

`--json-form` compiles large schemas from llguidance's JSON grammar form, which llguidance
parses holding the GIL, as the engine did before it inlined them in Lark
(`structured_output.grammar`). Running with `GLIBC_TUNABLES=glibc.malloc.arena_max=16` keeps
glibc's default arena limit of a 2-core machine (`pagedjax.malloc_arenas` leaves an operator's
limit alone); the result's `env` records both.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import STANDARD_WORKLOAD, environment, load_workload

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


def use_json_form() -> None:
    """Large schemas compile from llguidance's JSON grammar form (the engine's before)."""
    import llguidance as llg

    from pagedjax.structured_output import grammar

    def json_form(schema: str, parsed: dict, options: dict | None) -> str:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)

    grammar._inline_json = json_form


def run(llm, reqs: list[dict], reps: int, served_reps: int) -> tuple[list[dict], dict]:
    """The check `reps` times each way in process (then once synchronously), the add's cost,
    and `served_reps` times each way through AsyncLLM (which takes the engine over from `llm`:
    call last). Returns the runs and their summary."""
    slow = []
    for rep in range(reps):  # alternating which setting goes first
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
    if served_reps:
        served = slow_grammar_served(llm, reqs, served_reps)
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
    return slow, slow_summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(STANDARD_WORKLOAD))
    ap.add_argument("--reps", type=int, default=4, help="in-process runs each way")
    ap.add_argument("--served-reps", type=int, default=6, help="runs each way through AsyncLLM")
    ap.add_argument("--json-form", action="store_true", help="large schemas in the JSON form")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/slow_grammar.json")
    ns = ap.parse_args(argv)
    if ns.json_form:
        use_json_form()

    from benchmarks.structured_outputs import run_variant
    from pagedjax import LLM

    reqs = load_workload(ns.workload)[:8]
    llm = LLM(max_model_len=ns.max_model_len, disable_log_stats=True, use_tqdm_on_load=False)
    run_variant(llm, reqs[:1], every=1)  # warm: the llguidance tokenizer, the step shapes
    slow, summary = run(llm, reqs, ns.reps, ns.served_reps)
    env = environment() | {
        "json_form": ns.json_form,
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"),
        "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),
    }
    result = {"slow_grammar": slow, "slow_grammar_summary": summary, "env": env}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
