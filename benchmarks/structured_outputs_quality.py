"""Constrained outputs and tool calls on the real model, through the server: does what comes
back parse, validate and match?

    python -m benchmarks.structured_outputs_quality [--url http://host:port] [--model PATH]
        [--concurrency 8] [--out benchmarks/results/structured_outputs_quality.json]

Without `--url` it starts `pagedjax serve` on the default model (SmolLM2-135M-Instruct) with
`--chat-template` set to `TOOLS_TEMPLATE` below (ChatML, SmolLM2's default system prompt,
and, when a request has tools, a system prompt listing them in Hermes' `<tools>` format:
the model's own template ignores tools), `--enable-auto-tool-choice --tool-call-parser hermes`.

Requests (all through `/v1/chat/completions`, each prompt asking for what the constraint
enforces):
- json_schema: 50 schemas of 10 families (objects with nested arrays of objects, enums,
  required and optional fields, integers and numbers with bounds, strings with and without
  a maxLength), `response_format` json_schema, temperature 0.7 (seeded): the share of
  outputs that parse as JSON and validate against their schema (`jsonschema_rs`), and why
  the others failed (finish_reason "length": the model ran out of tokens inside the JSON);
- regex: 20 patterns (`structured_outputs.regex`), greedy: the share that fully match;
- choice: 20 classification prompts (`structured_outputs.choice`), greedy: the share whose
  reply is one of the choices;
- tool_choice="required" with 3 tools, 20 requests, greedy: the share that parse into calls
  of known tools whose arguments validate against that tool's parameters; the same requests
  streamed: the share whose tool-call deltas concatenate to exactly the non-streamed calls;
  the share that picked the tool the prompt asks for (the model's judgement, not enforced);
  again with `parallel_tool_calls: false` (exactly one call: the array cannot run on);
- tool_choice="auto" (hermes parser), the same 20 requests: how many came back as calls
  (the model's choice: informational).
Writes the counts, shares, elapsed seconds and the failing outputs to JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import jsonschema_rs

from benchmarks.common import environment
from benchmarks.serving import start_server

TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You are a helpful assistant that can call functions. The functions:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
To call a function, reply with <tool_call>{"name": <function name>, "arguments": <arguments \
object>}</tool_call><|im_end|>
{% elif messages[0].role != 'system' %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and tools and loop.first %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls %}<tool_call>
{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _s(max_length: int | None = 40) -> dict:
    return {"type": "string", **({"maxLength": max_length} if max_length else {})}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def _arr(items: dict, lo: int = 0, hi: int = 4) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def json_schema_cases() -> list[tuple[str, dict]]:
    """50 (prompt, schema): 10 families, 5 subjects each; each family varies its bounds,
    string limits and required fields with the subject."""
    days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
    cases = []
    families = [
        (
            "a fictional person: {}",
            ["a chef from Lyon", "a retired pilot", "a young chess player", "a nurse", "a poet"],
            lambda i: _obj(
                {
                    "name": _s(40 if i % 2 else None),
                    "age": _int(0, 110 + i),
                    "occupation": _s(),
                    "hobbies": _arr(_s(20), 1, 3 + i % 2),
                },
                ["name", "age", "hobbies"] if i % 2 else None,
            ),
        ),
        (
            "a product in an online shop: {}",
            ["a laptop", "running shoes", "a coffee grinder", "a board game", "a desk lamp"],
            lambda i: _obj(
                {
                    "id": _int(1, 9999),
                    "title": _s(60),
                    "price": _num(0, 500 * (i + 1)),
                    "in_stock": {"type": "boolean"},
                    "tags": _arr({"enum": ["new", "sale", "popular", "eco"]}, 0, 3),
                }
            ),
        ),
        (
            "an order of {} with its items",
            ["fruit", "office supplies", "books", "garden tools", "pet food"],
            lambda i: _obj(
                {
                    "order_id": _int(1000, 99999),
                    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                    "items": _arr(
                        _obj(
                            {
                                "name": _s(30),
                                "quantity": _int(1, 10 + i),
                                "unit_price": _num(0.5, 200),
                            }
                        ),
                        1,
                        3,
                    ),
                }
            ),
        ),
        (
            "the weather forecast for {}",
            ["Paris", "Tokyo", "Cairo", "Oslo", "Lima"],
            lambda i: _obj(
                {
                    "city": _s(30),
                    "temperature_c": _num(-40, 50),
                    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "windy"]},
                    "forecast": _arr(
                        _obj(
                            {"day": {"enum": days}, "high_c": _num(-40, 50), "low_c": _num(-50, 40)}
                        ),
                        1,
                        2 + i % 2,
                    ),
                },
                ["city", "temperature_c", "conditions", "forecast"],
            ),
        ),
        (
            "a book: {}",
            ["a mystery novel", "a cookbook", "a history of Rome", "a space opera", "a memoir"],
            lambda i: _obj(
                {
                    "title": _s(60),
                    "author": _s(40),
                    "year": _int(1500, 2025),
                    "genres": _arr(
                        {
                            "enum": [
                                "fiction",
                                "mystery",
                                "history",
                                "science",
                                "cooking",
                                "biography",
                            ]
                        },
                        1,
                        2,
                    ),
                    "rating": _num(0, 5),
                },
                ["title", "author", "year"] if i % 2 == 0 else None,
            ),
        ),
        (
            "an event: {}",
            ["a team meeting", "a wedding", "a marathon", "a concert", "a science fair"],
            lambda i: _obj(
                {
                    "name": _s(40),
                    "date": {"type": "string", "pattern": "^20[2-3][0-9]-[01][0-9]-[0-3][0-9]$"},
                    "attendees": _arr(
                        _obj({"name": _s(30), "role": {"enum": ["host", "guest", "speaker"]}}), 1, 3
                    ),
                    "capacity": _int(1, 500 * (i + 1)),
                }
            ),
        ),
        (
            "a recipe for {}",
            ["pancakes", "tomato soup", "a green salad", "bread", "lemonade"],
            lambda i: _obj(
                {
                    "name": _s(40),
                    "servings": _int(1, 12),
                    "difficulty": {"enum": ["easy", "medium", "hard"]},
                    "ingredients": _arr(
                        _obj({"item": _s(30), "grams": _num(0, 2000)}), 1, 3 + i % 3
                    ),
                }
            ),
        ),
        (
            "a review of {}",
            ["a comedy film", "a horror film", "a documentary", "an animated film", "a western"],
            lambda i: _obj(
                {
                    "movie": _s(50),
                    "score": _int(1, 10),
                    "sentiment": {"enum": ["positive", "neutral", "negative"]},
                    "highlights": _arr(_s(40), 0, 3),
                    "recommended": {"type": "boolean"},
                },
                ["movie", "score", "sentiment"],
            ),
        ),
        (
            "the deployment configuration of {}",
            ["a web server", "a database", "a cache", "a message queue", "a search index"],
            lambda i: _obj(
                {
                    "service": _s(30),
                    "replicas": _int(1, 16),
                    "ports": _arr(_int(1, 65535), 1, 3),
                    "environment": {"enum": ["dev", "staging", "prod"]},
                    "debug": {"type": "boolean"},
                }
            ),
        ),
        (
            "facts about {}",
            ["France", "Japan", "Brazil", "Kenya", "Canada"],
            lambda i: _obj(
                {
                    "country": _s(40),
                    "capital": _s(40),
                    "population_millions": _num(0, 2000),
                    "continent": {
                        "enum": [
                            "Africa",
                            "Asia",
                            "Europe",
                            "North America",
                            "South America",
                            "Oceania",
                        ]
                    },
                    "languages": _arr(_s(20), 1, 3),
                }
            ),
        ),
    ]
    for template, subjects, schema_fn in families:
        for i, subject in enumerate(subjects):
            cases.append((template.format(subject), schema_fn(i)))
    return cases


REGEX_CASES = [
    ("Give a US phone number.", r"\d{3}-\d{3}-\d{4}"),
    ("Name a famous scientist (first and last name).", r"[A-Z][a-z]+ [A-Z][a-z]+"),
    (
        "When did the Apollo 11 landing happen (YYYY-MM-DD)?",
        r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    ),
    ("Give the hex code of a dark blue color.", r"#[0-9a-fA-F]{6}"),
    (
        "Give an example IPv4 address.",
        r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}",
    ),
    ("Write an email address for a support team.", r"[a-z]{2,20}@[a-z]{2,20}\.(com|org|net)"),
    ("Is the sun a star? Answer and say why.", r"(Yes|No), because [a-z ,]{5,60}\."),
    ("What is 12 plus 30? Write the sum.", r"\d{1,3} \+ \d{1,3} = \d{1,4}"),
    ("Give the IATA code of an airport in London.", r"[A-Z]{3}"),
    (
        "Which day comes after Tuesday?",
        r"(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)",
    ),
    ("How much does a cup of coffee cost?", r"\$\d{1,3}\.\d{2}"),
    ("Give a five-digit ZIP code.", r"\d{5}"),
    ("Give the address of a search engine's website.", r"https://www\.[a-z]{3,15}\.com"),
    ("Name one or two primary colors.", r"(red|green|blue|yellow)( and (red|green|blue|yellow))?"),
    (
        "How many fruits are in a basket? Say the number and the fruit.",
        r"[1-9]\d{0,2} (apples|oranges|pears|bananas)",
    ),
    ("What time do shops open?", r"(1[0-2]|[1-9]):[0-5]\d (AM|PM)"),
    ("Give a semantic version number for a software release.", r"v\d{1,2}\.\d{1,2}\.\d{1,3}"),
    ("Name a city and its country.", r"[A-Z][a-z]{2,12}, [A-Z][a-z]{2,12}"),
    ("Is water wet? Answer true or false.", r"(true|false)"),
    ("How many legs does a spider have?", r"The answer is \d{1,3}\."),
]

CHOICE_CASES = [
    ("Review: 'I loved every minute of it.' Sentiment?", ["positive", "negative", "neutral"]),
    ("Review: 'Terrible service, never again.' Sentiment?", ["positive", "negative", "neutral"]),
    ("Is a whale a fish or a mammal?", ["fish", "mammal"]),
    ("What color is the sky on a clear day?", ["red", "blue", "green", "yellow"]),
    ("Which is bigger, the Earth or the Moon?", ["the Earth", "the Moon"]),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Is 17 a prime number?", ["yes", "no"]),
    ("Which language is spoken in Brazil?", ["Spanish", "Portuguese", "French"]),
    ("What do bees make?", ["honey", "milk", "silk"]),
    ("Which season comes after winter?", ["spring", "summer", "autumn", "winter"]),
    ("What is H2O?", ["water", "salt", "oxygen"]),
    ("Email: 'Win a free iPhone now!!!' Spam or not?", ["spam", "not spam"]),
    ("Which planet is known as the red planet?", ["Mars", "Venus", "Jupiter", "Saturn"]),
    ("How many days are in a week?", ["five", "six", "seven", "eight"]),
    ("Topic of: 'The team scored in the last minute.'", ["sports", "politics", "science"]),
    ("Is ice hot or cold?", ["hot", "cold"]),
    ("Which animal says 'meow'?", ["dog", "cat", "cow"]),
    ("What is 2 + 2?", ["3", "4", "5"]),
    ("Which is a fruit?", ["carrot", "apple", "potato"]),
    ("Priority of: 'The server is down for all users.'", ["low", "medium", "high", "critical"]),
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": _obj(
                {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                ["city"],
            ),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web and return the top results.",
            "parameters": _obj(
                {
                    "query": {"type": "string", "maxLength": 80},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                ["query"],
            ),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email.",
            "parameters": _obj(
                {
                    "to": {"type": "string", "maxLength": 60},
                    "subject": {"type": "string", "maxLength": 80},
                    "body": {"type": "string", "maxLength": 200},
                },
            ),
        },
    },
]

TOOL_CASES = [
    ("What's the weather like in Berlin?", "get_weather"),
    ("Is it raining in London right now? Use fahrenheit.", "get_weather"),
    ("How hot is it in Madrid today?", "get_weather"),
    ("Tell me the temperature in Sydney.", "get_weather"),
    ("Do I need an umbrella in Seattle?", "get_weather"),
    ("Weather in Tokyo, in celsius please.", "get_weather"),
    ("Find recent news about electric cars.", "search_web"),
    ("Search for the best pizza recipes, 3 results.", "search_web"),
    ("Look up who won the 2018 World Cup.", "search_web"),
    ("Search the web for Python tutorials.", "search_web"),
    ("Find information about the Eiffel Tower.", "search_web"),
    ("What are the top 5 results for 'jazz festivals'?", "search_web"),
    ("Look up the population of Canada.", "search_web"),
    ("Email bob@example.com that the meeting moved to 3pm.", "send_email"),
    ("Send alice@example.org a thank-you note for the gift.", "send_email"),
    ("Write to support@shop.com that my order is late.", "send_email"),
    ("Email my boss at boss@work.com that I am sick today.", "send_email"),
    ("Send an email to team@corp.com with subject 'Release' saying v2 is out.", "send_email"),
    ("Let carol@example.net know dinner is at 7.", "send_email"),
    ("Notify admin@site.io by email that the backup finished.", "send_email"),
]
TOOL_VALIDATORS = {
    t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS
}


async def _post(http, sem, body) -> dict:
    async with sem:
        res = await http.post("/v1/chat/completions", json=body)
        return {"status": res.status_code, "body": res.json()}


async def _stream(http, sem, body) -> dict:
    """A streamed chat completion: the tool calls rebuilt from the deltas."""
    calls, finish = [], None
    async with (
        sem,
        http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as res,
    ):
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                for t in choice["delta"].get("tool_calls") or []:
                    if "id" in t:
                        calls.append([t["function"]["name"], t["function"]["arguments"]])
                    else:
                        calls[t["index"]][1] += t["function"]["arguments"]
                finish = choice.get("finish_reason") or finish
    return {"calls": calls, "finish_reason": finish}


def _msg(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _share(ok: int, total: int) -> float:
    return round(100.0 * ok / total, 1) if total else 0.0


async def _required(http, sem, bodies: list[dict]) -> dict:
    """tool_choice="required" requests, whole and streamed: valid calls, streamed calls equal
    to the whole ones, and the tool the prompt asks for."""
    t0 = time.perf_counter()
    whole = await asyncio.gather(*[_post(http, sem, b) for b in bodies])
    streamed = await asyncio.gather(*[_stream(http, sem, b) for b in bodies])
    valid = equal = right = 0
    rows = []
    for (p, expected), w, s in zip(TOOL_CASES, whole, streamed, strict=True):
        choice = w["body"]["choices"][0] if w["status"] == 200 else {}
        msg = choice.get("message", {})
        calls = [
            [c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls") or []
        ]
        ok = bool(calls)
        for name, arguments in calls:
            try:
                TOOL_VALIDATORS[name].validate(json.loads(arguments))
            except (KeyError, ValueError, jsonschema_rs.ValidationError):
                ok = False
        valid += ok
        equal += s["calls"] == calls
        right += bool(calls) and calls[0][0] == expected
        rows.append(
            {
                "prompt": p,
                "calls": calls,
                "valid": ok,
                "finish_reason": choice.get("finish_reason"),
                "streamed_equal": s["calls"] == calls,
                "content": msg.get("content"),
            }
        )
    return {
        "requests": len(rows),
        "tools": len(TOOLS),
        "valid_calls": valid,
        "valid_calls_pct": _share(valid, len(rows)),
        "streamed_equal": equal,
        "streamed_equal_pct": _share(equal, len(rows)),
        "expected_tool": right,
        "expected_tool_pct": _share(right, len(rows)),
        "seconds": round(time.perf_counter() - t0, 1),
        "outputs": rows,
    }


async def run(url: str, ns) -> dict:
    sem = asyncio.Semaphore(ns.concurrency)
    limits = httpx.Limits(max_connections=ns.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        out: dict = {}

        # json_schema
        t0 = time.perf_counter()
        cases = json_schema_cases()
        bodies = [
            {
                "messages": _msg(
                    f"Describe {prompt} as JSON following this schema: {json.dumps(schema)}"
                ),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": f"case{i}", "schema": schema},
                },
                "temperature": 0.7,
                "seed": i,
                "max_tokens": ns.max_tokens,
            }
            for i, (prompt, schema) in enumerate(cases)
        ]
        results = await asyncio.gather(*[_post(http, sem, b) for b in bodies])
        parsed = valid = 0
        failures = []
        for (prompt, schema), r in zip(cases, results, strict=True):
            choice = r["body"]["choices"][0] if r["status"] == 200 else None
            text = choice["message"]["content"] if choice else json.dumps(r["body"])
            try:
                value = json.loads(text)
                parsed += 1
                jsonschema_rs.validator_for(schema).validate(value)
                valid += 1
            except (ValueError, jsonschema_rs.ValidationError) as e:
                failures.append(
                    {
                        "prompt": prompt,
                        "finish_reason": choice and choice["finish_reason"],
                        "error": str(e)[:200],
                        "output": text[-300:],
                    }
                )
        out["json_schema"] = {
            "requests": len(cases),
            "parse": parsed,
            "validate": valid,
            "parse_pct": _share(parsed, len(cases)),
            "validate_pct": _share(valid, len(cases)),
            "seconds": round(time.perf_counter() - t0, 1),
            "failures": failures,
            "example": results[0]["body"]["choices"][0]["message"]["content"]
            if results[0]["status"] == 200
            else None,
        }

        # regex
        t0 = time.perf_counter()
        bodies = [
            {
                "messages": _msg(p),
                "structured_outputs": {"regex": rx},
                "temperature": 0,
                "max_tokens": 64,
            }
            for p, rx in REGEX_CASES
        ]
        results = await asyncio.gather(*[_post(http, sem, b) for b in bodies])
        ok, rows = 0, []
        for (p, rx), r in zip(REGEX_CASES, results, strict=True):
            text = r["body"]["choices"][0]["message"]["content"] if r["status"] == 200 else None
            match = text is not None and re.fullmatch(rx, text) is not None
            ok += match
            rows.append({"prompt": p, "regex": rx, "output": text, "match": match})
        out["regex"] = {
            "requests": len(rows),
            "full_match": ok,
            "full_match_pct": _share(ok, len(rows)),
            "seconds": round(time.perf_counter() - t0, 1),
            "outputs": rows,
        }

        # choice
        t0 = time.perf_counter()
        bodies = [
            {
                "messages": _msg(p),
                "structured_outputs": {"choice": c},
                "temperature": 0,
                "max_tokens": 16,
            }
            for p, c in CHOICE_CASES
        ]
        results = await asyncio.gather(*[_post(http, sem, b) for b in bodies])
        ok, rows = 0, []
        for (p, c), r in zip(CHOICE_CASES, results, strict=True):
            text = r["body"]["choices"][0]["message"]["content"] if r["status"] == 200 else None
            ok += text in c
            rows.append({"prompt": p, "output": text, "in_choices": text in c})
        out["choice"] = {
            "requests": len(rows),
            "in_choices": ok,
            "in_choices_pct": _share(ok, len(rows)),
            "seconds": round(time.perf_counter() - t0, 1),
            "outputs": rows,
        }

        # tools: required (whole and streamed; parallel calls allowed, then not), then auto
        base = [
            {
                "messages": _msg(p),
                "tools": TOOLS,
                "tool_choice": "required",
                "temperature": 0,
                "max_tokens": ns.max_tokens,
            }
            for p, _ in TOOL_CASES
        ]
        out["tool_choice_required"] = await _required(http, sem, base)
        out["tool_choice_required_one_call"] = await _required(
            http, sem, [{**b, "parallel_tool_calls": False} for b in base]
        )
        t0 = time.perf_counter()
        auto = await asyncio.gather(
            *[_post(http, sem, {**b, "tool_choice": "auto", "max_tokens": 100}) for b in base]
        )
        called = sum(
            bool(r["status"] == 200 and r["body"]["choices"][0]["message"].get("tool_calls"))
            for r in auto
        )
        out["tool_choice_auto"] = {
            "requests": len(auto),
            "answered_with_calls": called,
            "seconds": round(time.perf_counter() - t0, 1),
            "example": auto[0]["body"]["choices"][0]["message"]
            if auto[0]["status"] == 200
            else auto[0]["body"],
        }
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/structured_outputs_quality.json")
    p.add_argument("--url", default=None, help="A running server (default: start one).")
    p.add_argument("--model", default=None, help="Model for the started server.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900.0, help="server start-up limit (s)")
    ns = p.parse_args(argv)
    proc, startup = None, None
    url = ns.url
    if url is None:
        ns.extra_server_args = [
            "--chat-template",
            TOOLS_TEMPLATE,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
        proc, url, startup = start_server(ns)
    try:
        t0 = time.perf_counter()
        results = asyncio.run(run(url, ns))
        elapsed = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary = {
        "json_schema_validate_pct": results["json_schema"]["validate_pct"],
        "regex_full_match_pct": results["regex"]["full_match_pct"],
        "choice_in_choices_pct": results["choice"]["in_choices_pct"],
        "tool_required_valid_pct": results["tool_choice_required"]["valid_calls_pct"],
        "tool_streamed_equal_pct": results["tool_choice_required"]["streamed_equal_pct"],
        "tool_required_one_call_valid_pct": results["tool_choice_required_one_call"][
            "valid_calls_pct"
        ],
        "tool_auto_answered_with_calls": results["tool_choice_auto"]["answered_with_calls"],
    }
    doc = {
        "benchmark": "structured_outputs_quality",
        "environment": environment(),
        "server": {
            "url": ns.url,
            "model": ns.model or "default (SmolLM2-135M-Instruct)",
            "max_model_len": ns.max_model_len,
            "startup_s": startup,
            "concurrency": ns.concurrency,
        },
        "seconds": round(elapsed, 1),
        "summary": summary,
        **results,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
