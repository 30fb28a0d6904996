"""Repeated subschemas of a large JSON schema moved into `$defs`, so that each compiles once.

llguidance compiles a JSON schema node by node, and a subschema written out N times costs N
times its compilation: a schema of 400 identical 9-property objects (265 kB) compiled in 0.25-0.6
s, and the same schema with the object in `$defs` and 400 `$ref`s to it in 0.01-0.04 s (Zen 3,
llguidance 1.x; benchmarks/README.md, "Shared subschemas"). Schemas written by hand, or
generated without references, repeat themselves this way (the same address, item or enum
object under many properties); while such a grammar compiles, its request waits and the
compile takes CPU time from the steps of the others.

`hoist_shared_subschemas` does this rewrite; `shared_form` applies it to a large schema's
grammar text (`grammar.INLINE_JSON`) just before it compiles. The rewrite is Python and holds
the GIL (6-21 ms for a 265 kB schema, whether or not anything repeats), so the manager runs it
on the normal-priority compile thread (`CompilePools.run_holding_gil`): neither on the thread
that adds the request (often the engine's) nor on an idle-class thread, which could be starved
while holding the GIL.

Only the JSON text of a node decides whether two nodes are the same (key order included: the
order of properties is the output's), so a rewritten schema accepts exactly the same documents
in the same property order, and its grammar gives the same token masks
(tests/test_shared_subschemas.py walks both side by side). It walks only the keywords whose
values are schemas (never `enum`, `const`, `default` or `examples` data), and leaves the schema
as it is where moving a node could change what a reference means: a `$ref` other than `#`,
`#/$defs/<name>` or `#/definitions/<name>`, or a base-URI or anchor keyword (`$id`, `$anchor`,
`$dynamicRef`, ...) anywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

from pagedjax.structured_output.grammar import INLINE_JSON

MIN_SHARED_CHARS = 256  # smaller repeated subschemas stay inline: little to save
DEF_PREFIX = "pagedjax_shared_"

_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_SCHEMA_VALUES = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP, _VALUE, _LIST = 1, 2, 4
_KIND = {  # keyword: what its value holds (`items`: a schema or a list of them)
    kw: _MAP * (kw in _SCHEMA_MAPS)
    + _VALUE * (kw in _SCHEMA_VALUES)
    + _LIST * (kw in _SCHEMA_LISTS)
    for kw in _SCHEMA_MAPS + _SCHEMA_VALUES + _SCHEMA_LISTS
}
_SCOPE_KEYWORDS = frozenset(
    {"$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"}
)


def _children(node: dict) -> list[dict]:
    """The subschemas directly under schema `node` (dicts only: boolean schemas have nothing to
    share)."""
    out = []
    for kw, value in node.items():
        kind = _KIND.get(kw)
        if kind is None:
            continue
        if isinstance(value, dict):
            if kind & _MAP:
                out += [v for v in value.values() if isinstance(v, dict)]
            elif kind & _VALUE:
                out.append(value)
        elif isinstance(value, list) and kind & _LIST:
            out += [v for v in value if isinstance(v, dict)]
    return out


def _movable(ref: Any) -> bool:
    """Whether a `$ref` means the same wherever its node stands: the root or a top-level def."""
    if not isinstance(ref, str):
        return False
    if ref == "#":
        return True
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix) and "/" not in ref[len(prefix) :]:
            return True
    return False


def _survey(root: dict) -> dict[bytes, int] | None:
    """How often each subschema's JSON text occurs below the root; None where a node carries a
    scope keyword or a `$ref` that moving nodes could break."""
    counts: dict[bytes, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if not _SCOPE_KEYWORDS.isdisjoint(node) or ("$ref" in node and not _movable(node["$ref"])):
            return None
        for child in _children(node):
            text = orjson.dumps(child)
            counts[text] = counts.get(text, 0) + 1
            stack.append(child)
    return counts


def hoist_shared_subschemas(schema: dict, min_chars: int = MIN_SHARED_CHARS) -> dict:
    """`schema` with each subschema that occurs more than once (as the same JSON text, at
    least `min_chars` long) moved into the root's `$defs` and referenced from where it stood.

    Args:
        schema: a JSON schema object (not modified).
        min_chars: the smallest subschema (its JSON text, in characters) worth sharing.

    Returns:
        A new schema, or `schema` itself where nothing repeats, nothing may move (see the
        module docstring) or it is nested too deeply to rewrite. The outermost repeated node is
        shared, top-down, and a shared node's own repeated parts inside it are shared in turn.
        New defs are named `DEF_PREFIX` + a number not already in `$defs`; the root's `$defs`,
        if any, keeps its entries.
    """
    if not isinstance(schema.get("$defs", {}), dict):
        return schema
    try:
        counts = _survey(schema)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: left as it is
        return schema
    if counts is None:
        return schema
    shared = {t for t, c in counts.items() if c > 1 and len(t) >= min_chars}
    if not shared:
        return schema
    defs: dict[str, Any] = {}  # the new ones
    taken = set(schema.get("$defs", {}))
    names: dict[bytes, str] = {}

    def def_ref(text: bytes, node: dict) -> dict:
        if text not in names:
            k = len(names)
            while f"{DEF_PREFIX}{k}" in taken or f"{DEF_PREFIX}{k}" in defs:
                k += 1
            names[text] = f"{DEF_PREFIX}{k}"
            defs[names[text]] = None  # claimed before its own children are rewritten
            defs[names[text]] = rewrite(node)
        return {"$ref": f"#/$defs/{names[text]}"}

    def rewrite(node: dict) -> dict:
        """A copy of `node` whose shared subschemas are references (copies only what changes).
        A def stays where it is (references name it), its insides are rewritten."""
        out = dict(node)
        for kw, value in node.items():
            kind = _KIND.get(kw)
            if kind is None:
                continue
            if isinstance(value, dict) and kind & _VALUE:
                out[kw] = swap(value)
            elif isinstance(value, dict) and kind & _MAP:
                keep = kw in ("$defs", "definitions")
                out[kw] = {
                    k: (rewrite(v) if keep else swap(v)) if isinstance(v, dict) else v
                    for k, v in value.items()
                }
            elif isinstance(value, list) and kind & _LIST:
                out[kw] = [swap(v) if isinstance(v, dict) else v for v in value]
        return out

    def swap(node: dict) -> dict:
        text = orjson.dumps(node)
        return def_ref(text, node) if text in shared else rewrite(node)

    try:
        body = rewrite(schema)
    except (RecursionError, orjson.JSONEncodeError):  # nested too deeply: left as it is
        return schema
    return body | {"$defs": body.get("$defs", {}) | defs}


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400: orjson would write null
        raise ValueError(f"{text} is out of range")
    return x


def shared_form(text: str) -> str:
    """Grammar text `text` to compile: a schema inlined in Lark (`INLINE_JSON` + its JSON) with
    its shared subschemas in `$defs` (`hoist_shared_subschemas`); any other text, or one whose
    schema needs no rewrite, or whose numbers would not be written back as they were read (an
    integer beyond 64 bits, NaN, 1e400), as it is. (Read with `json`, which keeps every
    integer; orjson would read a large one as a float.)"""
    if not text.startswith(INLINE_JSON):
        return text
    try:
        schema = json.loads(
            text[len(INLINE_JSON) :], parse_constant=_no_constant, parse_float=_finite
        )
    except ValueError:
        return text
    if not isinstance(schema, dict):
        return text
    out = hoist_shared_subschemas(schema)
    if out is schema:
        return text
    try:
        return INLINE_JSON + orjson.dumps(out).decode()
    except orjson.JSONEncodeError:  # an integer beyond 64 bits
        return text
