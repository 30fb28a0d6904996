"""The slow-grammar check: what a large schema's compile costs the streams already running.

    python -m benchmarks.slow_grammar [--reps 8] [--served-reps 6] [--json-form]
        [--equal-objects]
        [--out benchmarks/results/slow_grammar.json]

8 unconstrained streams decode on the default model (SmolLM2-135M-Instruct; 32-token prompts
of the standard workload, greedy, 60 tokens each); after 10 steps a request with a large
schema (`big_schema(400)`: 400 nested objects, no two equal, 265 kB, 0.2-0.6 s to compile
alone; a new one each run, so no cache hit) is added. The gaps between the streams' tokens
from the add until the grammar is ready are compared with the median step before it: the goal
is that no gap exceeds two step times (no stream's next token delayed by more than one step).

`--reps N` runs the check N times for each of these variants, in turn, on `LLMEngine` driven
in this thread:
    idle     the engine as it is: the compile on the pool's thread, in Linux's idle class
    before   the engine before it moved there: the compile thread at nice + 10, and the native
             kernels leaving it a core (`cpu_kernels.set_thread_limit`) from the add until the
             grammar is ready. Moving a thread out of the idle class needs CAP_SYS_NICE: without
             it this variant is skipped.
    none     no grammar: an unconstrained request added at the same step, and the gaps of the
             50 steps that follow: this machine's own spread of step times, to read the
             others against.
    loop     no grammar, and a process in the idle class that only spins (no memory, no GIL,
             nothing shared with the engine) from the add for those 50 steps: what any CPU
             work in the idle class costs the steps on this machine, to read `idle` against.
The variants of one repetition run in turn, in an order that alternates between repetitions,
so that the machine's drift over the run falls on all of them alike.
It summarises each: the largest gap over the median step (median, worst, runs over 2), the
gaps' 90th and 99th percentiles and how many exceed two steps, how long the request waited
for its grammar, and the time the streams lost in all (in steps). Then one run with the
compile done synchronously on the engine thread (as it would be without the pool) gives the
contrast, and what adding such a request costs the engine's thread (`add_request` against
`add_processed` of an input checked elsewhere), and what sharing repeated subschemas through
`$defs` saves a schema of 400 equal objects (`shared_subschemas_gain`).
`--served-reps N` runs `idle` and `before` N times each through `AsyncLLM` (the server's
engine, its heap frozen as the server freezes it; gaps between the first stream's tokens as
its coroutine receives them, until the big request's first token).

With `PAGEDJAX_CPU_NUM_OF_RESERVED_CPU=1` in the environment the steps run on the other cores
and the compile on the last one (`pagedjax.reserved_cpus`); the result's `env` records it.

`--equal-objects` runs the checks with `big_schema(400, distinct=False)`: 400 equal objects,
which the manager shares through `$defs` before the compile (`structured_output.shared_subschemas`).

`--json-form` compiles large schemas from llguidance's JSON grammar form, which llguidance
parses holding the GIL, as the engine did before it inlined them in Lark
(`structured_output.grammar`). Running with `GLIBC_TUNABLES=glibc.malloc.arena_max=16` keeps
glibc's default arena limit of a 2-core machine (`pagedjax.malloc_arenas` leaves an operator's
limit alone); the result's `env` records both.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import STANDARD_WORKLOAD, environment, load_workload

_schemas_made = 0
_EQUAL_OBJECTS = False  # --equal-objects: the checks' schemas repeat one object (shared in $defs)


def big_schema(n: int, distinct: bool = True) -> dict:
    """n required nested objects (5 patterned strings, a 30-value enum, a bounded number).
    `distinct`: object i's number is at most 1000 + i, so that no two objects are equal and
    none is shared through `$defs` (`structured_output.shared_subschemas`): each compiles."""
    item = {
        "type": "object",
        "properties": {
            **{f"s{j}": {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,4}"} for j in range(5)},
            "e": {"enum": [f"v{k}" for k in range(30)]},
            "n": {"type": "number", "minimum": -5, "maximum": 1000},
        },
        "required": ["e"],
    }
    props = {}
    for i in range(n):
        props[f"field_{i}"] = dict(item)
        if distinct:
            bounded = {"type": "number", "minimum": -5, "maximum": 1000 + i}
            props[f"field_{i}"]["properties"] = item["properties"] | {"n": bounded}
    return {"type": "object", "properties": props, "required": list(props)}


def shared_subschemas_gain(mgr, n: int = 400, reps: int = 3) -> dict:
    """A schema of n equal objects (`big_schema(n, distinct=False)`): its compile as written
    out and with the objects shared through `$defs` (`shared_form`, what the manager
    compiles), median seconds over `reps` (a new schema each time), and the rewrite's own
    milliseconds (`shared_form`: read, rewritten, written)."""
    import llguidance as llg

    from pagedjax.sampling_params import StructuredOutputsParams
    from pagedjax.structured_output import grammar
    from pagedjax.structured_output.shared_subschemas import shared_form

    global _schemas_made
    tok = mgr._tokenizer.result()
    plain, shared, rewrite = [], [], []
    for _ in range(reps):
        _schemas_made += 1
        schema = big_schema(n + _schemas_made, distinct=False)
        text = grammar.grammar_text(StructuredOutputsParams(json=schema))
        t0 = time.perf_counter()
        text_shared = shared_form(text)
        rewrite.append(time.perf_counter() - t0)
        for out, t in ((plain, text), (shared, text_shared)):
            t0 = time.perf_counter()
            llg.LLMatcher(tok, t, log_level=0)
            out.append(time.perf_counter() - t0)
    return {
        "objects": n,
        "compile_written_out_s": statistics.median(plain),
        "compile_shared_s": statistics.median(shared),
        "rewrite_ms": 1e3 * statistics.median(rewrite),
    }


VARIANTS = ("idle", "before", "none", "loop")
NO_GRAMMAR = ("none", "loop")  # variants whose request has no grammar
# the `loop` variant's process: it waits for a byte on stdin, then spins until killed
SPIN = "import sys\nsys.stdin.buffer.read(1)\nwhile True: pass"


def set_compile_class(mgr, variant: str) -> None:
    """Puts the manager's compile threads in the idle class (`idle`), or at normal priority,
    nice + 10 (`before`). Raises PermissionError where leaving the idle class is not allowed."""
    for t in list(mgr._pools.idle._threads):
        if variant == "before":
            os.sched_setscheduler(t.native_id, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, t.native_id, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        else:
            os.sched_setscheduler(t.native_id, os.SCHED_IDLE, os.sched_param(0))


def leave_a_core(on: bool) -> None:
    """The kernels leave a core (`before`, while the grammar compiles), or keep every core."""
    from pagedjax.ops import cpu_kernels

    cores = len(os.sched_getaffinity(0))
    cpu_kernels.set_thread_limit(max(cores - 1, 1) if on else 0)


def slow_grammar(
    llm, reqs: list[dict], synchronous: bool, variant: str = "idle", none_gaps: int = 50
) -> dict:
    """8 unconstrained streams; a large-schema request added after 10 steps. Gaps between the
    streams' steps while its grammar compiles, against the median step before (`VARIANTS`;
    `none`, `loop`: the first `none_gaps` gaps after an unconstrained request is added)."""
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import StructuredOutputsParams

    eng = llm.llm_engine
    mgr = eng.structured_output
    set_compile_class(mgr, variant)
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
    schema = big_schema(400 + _schemas_made, not _EQUAL_OBJECTS)  # new each time: no cache hit
    so = None if variant in NO_GRAMMAR else StructuredOutputsParams(json=schema)
    # started now, as forking this process takes the engine thread tens of milliseconds
    spinner = spin_in_idle_class() if variant == "loop" else None
    compiles0 = mgr.stats["compile_s"]
    try:
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            if any(o.request_id.startswith("s") for o in outs):
                stamps.append(now)
            if len(stamps) == 10 and added_at is None:
                added_at = time.perf_counter()
                params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
                eng.add_request("big", "Fill the form:", params)
                leave_a_core(variant == "before")
                if spinner is not None:  # it spins from now on
                    spinner.stdin.write(b"x")
                    spinner.stdin.flush()
                if synchronous:  # what the engine thread would pay without the pool
                    mgr.wait_any([eng.scheduler.requests["big"].structured_output], 60)
            waiting = eng.scheduler.stats().num_waiting_for_grammar
            if added_at is not None and ready_at is None and waiting == 0:
                ready_at = now
                leave_a_core(False)
            if spinner is not None and len(stamps) > 10 + none_gaps:
                spinner.kill()
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        leave_a_core(False)
        set_compile_class(mgr, "idle")
    before = [b - a for a, b in zip(stamps[:9], stamps[1:10], strict=True)]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    if variant in NO_GRAMMAR:
        during = gaps[9 : 9 + none_gaps]
    else:
        during = [g for g, b in zip(gaps, stamps[1:], strict=True) if added_at <= b <= ready_at]
        during = during or [stamps[10] - stamps[9]]
    step = statistics.median(before)
    return {
        "variant": variant,
        "synchronous_compile": synchronous,
        "median_step_before_s": step,
        "compile_s": mgr.stats["compile_s"] - compiles0,
        "grammar_wait_s": 0.0 if variant in NO_GRAMMAR else ready_at - added_at,
        "max_gap_while_compiling_s": max(during),
        "gaps_while_compiling_s": during,
        "max_gap_over_median_step": max(during) / step,
    }


def spin_in_idle_class() -> subprocess.Popen:
    """A process in Linux's idle class that spins on one thread from the first byte written
    to its stdin until killed (`loop`)."""

    def idle_class() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    return subprocess.Popen(
        [sys.executable, "-c", SPIN], stdin=subprocess.PIPE, preexec_fn=idle_class
    )


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
            compiling.append(eng.scheduler.requests[rid].structured_output.compilation)
            eng.abort_request(rid)
    for c in compiling:  # so that no compile runs beside what follows
        c.result()
    return {
        "add_request_ms": 1e3 * statistics.median(whole),
        "add_processed_ms": 1e3 * statistics.median(queued),
    }


def slow_grammar_served(llm, reqs: list[dict], reps: int, variants: tuple) -> list[dict]:
    """The slow-grammar check through `AsyncLLM` (the server's engine), `reps` times for each of
    `variants` ("idle", "before"), in turn. Gaps between the first stream's tokens as its
    coroutine receives them, from the big request's add until its first token, against the
    median gap before. Takes the engine over from `llm`."""
    import asyncio

    from pagedjax import SamplingParams
    from pagedjax.engine.async_llm import AsyncLLM
    from pagedjax.sampling_params import StructuredOutputsParams

    eng = AsyncLLM(llm.llm_engine)
    mgr = llm.llm_engine.structured_output
    gc.collect()  # the heap out of the collector's way, as the server freezes it after start-up
    gc.freeze()  # (`api_server._freeze_gc_heap`; a full collection here took 270 ms)

    async def once(tag: str, variant: str) -> dict:
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
        so = StructuredOutputsParams(json=big_schema(400 + _schemas_made, not _EQUAL_OBJECTS))
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
        added_at, first = time.perf_counter(), None
        leave_a_core(variant == "before")
        async for _ in eng.generate("Fill the form:", params, f"{tag}-big"):
            if first is None:
                first = time.perf_counter()
                leave_a_core(False)
        await asyncio.gather(*tasks)
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        step = statistics.median(gaps[:9])
        during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if added_at <= b <= first]
        return {
            "variant": variant,
            "median_step_before_s": step,
            "gaps_while_compiling_s": during,
            "grammar_wait_s": first - added_at,
            "max_gap_over_median_step": max(during) / step,
        }

    runs = []
    try:
        for rep in range(reps):
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                set_compile_class(mgr, variant)
                runs.append(asyncio.run(once(f"served-{rep}-{variant}", variant)))
    finally:
        leave_a_core(False)
        set_compile_class(mgr, "idle")
        eng.shutdown()
    return runs


def summarize(runs: list[dict]) -> dict:
    """One variant's runs: the largest gap over the median step (median, worst, runs over 2),
    the gaps' 90th and 99th percentiles and how many of them exceed two steps, the grammar's
    wait, and the streams' lost time in steps."""
    ratios = [r["max_gap_over_median_step"] for r in runs]
    rel = sorted(g / r["median_step_before_s"] for r in runs for g in r["gaps_while_compiling_s"])
    # the time the streams lost while it compiled, in steps: sum over gaps of (gap - step)
    extra = [
        sum(g - r["median_step_before_s"] for g in r["gaps_while_compiling_s"])
        / r["median_step_before_s"]
        for r in runs
    ]
    return {
        "runs": len(ratios),
        "median_max_gap_over_median_step": statistics.median(ratios),
        "worst": max(ratios),
        "runs_over_2": sum(x > 2.0 for x in ratios),
        "gap_p90_over_median_step": rel[int(0.9 * (len(rel) - 1))],
        "gap_p99_over_median_step": rel[int(0.99 * (len(rel) - 1))],
        "gaps_over_2": f"{sum(x > 2.0 for x in rel)} of {len(rel)}",
        "median_gaps": statistics.median(len(r["gaps_while_compiling_s"]) for r in runs),
        "median_grammar_wait_s": statistics.median(r["grammar_wait_s"] for r in runs),
        "median_extra_steps": statistics.median(extra),
    }


def can_leave_idle_class(mgr) -> bool:
    """Whether this process may move a thread out of the idle class (the `before` variant)."""
    try:
        set_compile_class(mgr, "before")
    except PermissionError:
        return False
    finally:
        set_compile_class(mgr, "idle")
    return True


def use_json_form() -> None:
    """Large schemas compile from llguidance's JSON grammar form (the engine's before)."""
    import llguidance as llg

    from pagedjax.structured_output import grammar

    def json_form(schema: str, parsed: dict, options: dict | None) -> str:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)

    grammar._inline_json = json_form


def run(llm, reqs: list[dict], reps: int, served_reps: int) -> tuple[list[dict], dict]:
    """The check `reps` times for each variant in process (then once synchronously), the add's
    cost, and `served_reps` times each way through AsyncLLM (which takes the engine over from
    `llm`: call last). Returns the runs and their summary."""
    mgr = llm.llm_engine.structured_output
    variants = VARIANTS
    if not can_leave_idle_class(mgr):
        variants = tuple(v for v in VARIANTS if v != "before")
    timed = [v for v in variants if v not in NO_GRAMMAR]
    slow = []
    for rep in range(reps):  # in turn, the order alternating
        for variant in variants if rep % 2 == 0 else variants[::-1]:
            slow.append(slow_grammar(llm, reqs, False, variant))
    slow.append(slow_grammar(llm, reqs, True))
    for s in slow:
        print(
            "slow grammar",
            json.dumps({k: v for k, v in s.items() if k != "gaps_while_compiling_s"}),
        )
    slow_summary = {
        v: summarize([s for s in slow if s["variant"] == v and not s["synchronous_compile"]])
        for v in variants
    }
    if "before" not in variants:
        slow_summary["before"] = "skipped: moving a thread out of the idle class is not allowed"
    print("slow grammar summary", json.dumps(slow_summary))
    slow_summary["engine_thread_add"] = add_cost(llm.llm_engine)
    print("engine thread's cost of an add", json.dumps(slow_summary["engine_thread_add"]))
    slow_summary["shared_subschemas"] = shared_subschemas_gain(mgr)
    print("shared subschemas", json.dumps(slow_summary["shared_subschemas"]))
    if served_reps:
        served = slow_grammar_served(llm, reqs, served_reps, tuple(timed))
        slow_summary["served"] = {
            v: summarize([r for r in served if r["variant"] == v]) for v in timed
        }
        slow_summary["served_runs"] = served
        print("served slow grammar", json.dumps(slow_summary["served"]))
    return slow, slow_summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(STANDARD_WORKLOAD))
    ap.add_argument("--reps", type=int, default=8, help="in-process runs of each variant")
    ap.add_argument("--served-reps", type=int, default=6, help="runs each way through AsyncLLM")
    ap.add_argument("--json-form", action="store_true", help="large schemas in the JSON form")
    ap.add_argument("--equal-objects", action="store_true", help="schemas of 400 equal objects")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/slow_grammar.json")
    ns = ap.parse_args(argv)
    if ns.json_form:
        use_json_form()
    global _EQUAL_OBJECTS
    _EQUAL_OBJECTS = ns.equal_objects

    from benchmarks.structured_outputs import run_variant
    from pagedjax import LLM

    reqs = load_workload(ns.workload)[:8]
    llm = LLM(max_model_len=ns.max_model_len, disable_log_stats=True, use_tqdm_on_load=False)
    run_variant(llm, reqs[:1], every=1)  # warm: the llguidance tokenizer, the step shapes
    slow, summary = run(llm, reqs, ns.reps, ns.served_reps)
    env = environment() | {
        "json_form": ns.json_form,
        "equal_objects": ns.equal_objects,
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"),
        "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),
        "PAGEDJAX_CPU_NUM_OF_RESERVED_CPU": os.environ.get("PAGEDJAX_CPU_NUM_OF_RESERVED_CPU"),
        "steps_cpus": sorted(os.sched_getaffinity(0)),
    }
    result = {"slow_grammar": slow, "slow_grammar_summary": summary, "env": env}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
