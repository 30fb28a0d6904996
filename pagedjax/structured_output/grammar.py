"""From a `StructuredOutputsParams` to an llguidance grammar, and its synchronous validation.

Each kind becomes llguidance's grammar text (`llguidance.LLMatcher.grammar_from_*`):
    json         a JSON schema (llguidance's JSON-schema compiler; `whitespace_pattern`, when
                 given, is the regex of the whitespace allowed between JSON tokens)
    json_object  the schema {"type": "object"}
    regex        the regex must match the whole output (Rust `regex` syntax)
    choice       a Lark rule with one literal alternative per choice
    grammar      Lark (llguidance's dialect), or GBNF (llama.cpp's), which llguidance converts
                 to Lark

`validate_structured_outputs` runs when a request is added, on the engine thread: it builds
the grammar text and lets llguidance check it (no tokenizer needed) when the constraint is at
most `SYNC_VALIDATION_MAX_CHARS` long, which costs about a millisecond; a larger one is
checked when it compiles on the worker pool (about as long as its compilation: 0.2 s for a
260 kB schema), and an error there ends only that request (finish_reason "error"), with the
reason `compile_error_message` gives.

A schema longer than `SYNC_VALIDATION_MAX_CHARS` is inlined in a Lark grammar (`start: %json
<schema>`, llguidance's syntax for it) rather than wrapped in llguidance's JSON grammar list:
llguidance parses the JSON form while it holds the GIL, before it compiles (5-8 ms for a 265
kB schema, which stalled the engine thread's step by that much), and reads the Lark form
without parsing it, parsing it later with the GIL dropped. Both forms give the same token
masks (tests/test_structured_large_schema.py walks them side by side). When such a schema compiles,
its repeated subschemas are first moved into its `$defs` (`shared_subschemas.shared_form`).
"""

from __future__ import annotations

import json

import llguidance as llg
import orjson

from pagedjax.errors import InvalidInputError
from pagedjax.sampling_params import StructuredOutputsParams

PARAM = "structured_outputs"
SYNC_VALIDATION_MAX_CHARS = 16_384  # constraints up to this size are validated at add time
INLINE_JSON = "start: %json "  # the Lark form of a schema longer than that


def _constraint_value(so: StructuredOutputsParams) -> tuple[str, str, str | None]:
    """(kind, the constraint as text, whitespace_pattern).

    Raises:
        InvalidInputError (param "structured_outputs"): a schema dict that is not JSON data.
    """
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json" and not isinstance(value, str):
        try:  # not sorted: the schema's property order is the output's
            value = orjson.dumps(value).decode()
        except (TypeError, ValueError) as e:  # orjson.JSONEncodeError is a TypeError
            raise InvalidInputError(
                f"structured_outputs.json is not JSON data: {e}", PARAM
            ) from None
    elif kind == "json_object":
        value = ""
    ws = so.whitespace_pattern if kind in ("json", "json_object") else None
    return kind, value, ws


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint (equal texts compile to the same grammar:
    the text is the compile cache's key). A schema dict is serialised once here, on the
    thread that adds the request, with orjson (0.25 ms for a 265 kB schema, against 3.4 ms
    for `json.dumps`, holding the GIL either way).

    Raises:
        InvalidInputError (param "structured_outputs"): JSON text that does not parse, or a
            GBNF grammar llguidance cannot convert.
    """
    kind, value, ws = _constraint_value(so)
    options = {"whitespace_pattern": ws} if ws is not None else None
    try:
        if kind in ("json", "json_object"):
            schema = value if kind == "json" else '{"type": "object"}'
            parsed = json.loads(schema) if isinstance(so.json, str) else so.json  # clear errors
            if len(schema) > SYNC_VALIDATION_MAX_CHARS and isinstance(parsed, dict):
                return _inline_json(schema, parsed, options)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in so.choice)
            )
        return llg.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise InvalidInputError(f"structured_outputs.{kind} is invalid: {e}", PARAM) from None


def _inline_json(schema: str, parsed: dict, options: dict | None) -> str:
    """A JSON-schema object as Lark (`INLINE_JSON` + the schema): llguidance's options go into
    its "x-guidance" key, under those the schema sets itself, as
    `grammar_from_json_schema(defaults=options)` merges them."""
    if options is not None:
        own = parsed.get("x-guidance")
        merged = {**parsed, "x-guidance": options | (own if isinstance(own, dict) else {})}
        schema = orjson.dumps(merged).decode()
    return INLINE_JSON + schema


def compile_error_message(text: str, error: str) -> str:
    """The reason grammar `text` does not compile, as llguidance gave it (`error`), or, for a
    schema inlined in Lark, as its JSON-schema compiler gives it for the JSON form (without the
    Lark position and the source line, which would repeat the whole schema). The latter
    compiles the schema again (about as long as its compilation): call it only on failure."""
    if not text.startswith(INLINE_JSON):
        return error
    plain = llg.LLMatcher.grammar_from_json_schema(text[len(INLINE_JSON) :])
    return llg.LLMatcher.validate_grammar(plain).strip() or error


def validate_structured_outputs(so: StructuredOutputsParams) -> str:
    """Builds and (up to SYNC_VALIDATION_MAX_CHARS) checks a constraint's grammar.

    Returns:
        The llguidance grammar text.

    Raises:
        InvalidInputError (param "structured_outputs"): an invalid JSON schema, regex or
            grammar, naming the kind and llguidance's reason.
    """
    text = grammar_text(so)
    if len(text) <= SYNC_VALIDATION_MAX_CHARS:
        error = llg.LLMatcher.validate_grammar(text)
        if error:
            raise InvalidInputError(
                f"structured_outputs.{so.kind} is invalid: {error.strip()}", PARAM
            )
    return text
