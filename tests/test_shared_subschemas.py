"""Repeated subschemas moved into `$defs` (`structured_output.shared_subschemas`): hand-built
cases of what moves and what must not, the same token masks as the schema written out along
random walks, the same verdicts from `jsonschema_rs`, and the manager compiling a large
schema's shared form (`shared_form`) on its normal-priority thread."""

from __future__ import annotations

import copy
import json
import threading

import jsonschema_rs
import llguidance as llg
import llguidance.hf
import orjson
import pytest
from transformers import AutoTokenizer

from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output import grammar as grammar_mod
from pagedjax.structured_output import manager as manager_mod
from pagedjax.structured_output.compilation import NORMAL_THREAD_NAME
from pagedjax.structured_output.shared_subschemas import (
    DEF_PREFIX,
    MIN_SHARED_CHARS,
    hoist_shared_subschemas,
    shared_form,
)
from tests.test_structured_large_schema import _walk

ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "[0-9]{5}"},
        "kind": {"enum": ["home", "work", "other"]},
    },
    "required": ["street", "kind"],
    "additionalProperties": False,
}
SMALL = {"type": "integer", "minimum": 0}


def ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


def test_two_equal_objects_share_one_def_and_the_input_is_untouched():
    schema = {
        "type": "object",
        "properties": {"home": ADDRESS, "work": copy.deepcopy(ADDRESS), "n": SMALL, "m": SMALL},
    }
    before = copy.deepcopy(schema)
    out = hoist_shared_subschemas(schema, min_chars=100)
    assert schema == before
    name = DEF_PREFIX + "0"
    assert out == {
        "type": "object",
        "properties": {"home": ref(name), "work": ref(name), "n": SMALL, "m": SMALL},
        "$defs": {name: ADDRESS},
    }
    assert len(json.dumps(ADDRESS)) >= 100 > len(json.dumps(SMALL))  # SMALL stayed inline


def test_nothing_repeated_or_too_small_returns_the_same_object():
    schema = {"type": "object", "properties": {"a": ADDRESS, "n": SMALL, "m": SMALL}}
    assert hoist_shared_subschemas(schema, min_chars=100) is schema
    assert len(json.dumps(ADDRESS)) < MIN_SHARED_CHARS
    twice = {"type": "object", "properties": {"a": ADDRESS, "b": ADDRESS}}
    assert hoist_shared_subschemas(twice) is twice  # the default floor: left inline


def test_key_order_matters_and_data_keywords_are_not_schemas():
    reordered = dict(reversed(list(ADDRESS.items())))
    schema = {
        "type": "object",
        "properties": {"a": ADDRESS, "b": reordered},  # same schema, another output order
        "default": {"x": ADDRESS, "y": ADDRESS},
        "examples": [ADDRESS, ADDRESS],
        "anyOf": [{"const": ADDRESS}, {"enum": [ADDRESS, ADDRESS]}],
    }
    assert hoist_shared_subschemas(schema, min_chars=50) is schema


@pytest.mark.parametrize(
    "extra",
    [
        {"$id": "https://example.com/s"},
        {"properties": {"c": {"$anchor": "here", "type": "string"}}},
        {"properties": {"c": {"$ref": "#/properties/a"}}},  # a path that moving would break
        {"properties": {"c": {"$ref": "#/$defs/x/properties/y"}}},
        {"properties": {"c": {"$ref": "other.json#/$defs/x"}}},
    ],
)
def test_scopes_and_path_references_leave_the_schema_as_it_is(extra):
    plain = {"type": "object", "properties": {"a": ADDRESS, "b": ADDRESS}}
    assert hoist_shared_subschemas(plain, min_chars=50) is not plain  # shared without `extra`
    schema = plain | extra | {"properties": plain["properties"] | extra.get("properties", {})}
    assert hoist_shared_subschemas(schema, min_chars=50) is schema


def test_references_to_the_root_or_a_def_may_move():
    node = {"type": "array", "items": {"$ref": "#"}, "maxItems": 2, "description": "x" * 40}
    schema = {
        "$defs": {"node": {"type": "string"}, DEF_PREFIX + "0": {"type": "null"}},
        "type": "object",
        "properties": {"a": node, "b": node, "c": {"$ref": "#/$defs/node"}},
    }
    out = hoist_shared_subschemas(schema, min_chars=50)
    new = DEF_PREFIX + "1"  # the user's DEF_PREFIX + "0" kept its name and content
    assert out["properties"] == {"a": ref(new), "b": ref(new), "c": ref("node")}
    assert out["$defs"] == schema["$defs"] | {new: node}


def test_outer_repeats_move_first_and_inner_repeats_inside_them():
    item = {"type": "object", "properties": {"home": ADDRESS, "tags": {"type": "array"}}}
    schema = {
        "type": "object",
        "properties": {"x": item, "y": item, "z": ADDRESS},
        "additionalProperties": {"anyOf": [ADDRESS, {"type": "null"}]},
    }
    out = hoist_shared_subschemas(schema, min_chars=50)
    d_item, d_addr = DEF_PREFIX + "0", DEF_PREFIX + "1"
    assert out["properties"] == {"x": ref(d_item), "y": ref(d_item), "z": ref(d_addr)}
    assert out["$defs"][d_item]["properties"]["home"] == ref(d_addr)
    assert out["$defs"][d_addr] == ADDRESS
    assert out["additionalProperties"] == {"anyOf": [ref(d_addr), {"type": "null"}]}


def test_every_schema_keyword_is_walked():
    schema = {
        "type": "array",
        "prefixItems": [ADDRESS],
        "items": ADDRESS,
        "contains": ADDRESS,
        "not": {"oneOf": [ADDRESS], "allOf": [ADDRESS]},
        "if": ADDRESS,
        "then": ADDRESS,
        "else": ADDRESS,
        "patternProperties": {"^a": ADDRESS},
        "dependentSchemas": {"a": ADDRESS},
        "propertyNames": ADDRESS,
        "unevaluatedItems": ADDRESS,
        "unevaluatedProperties": ADDRESS,
        "additionalItems": ADDRESS,
        "definitions": {"kept": ADDRESS},
    }
    out = hoist_shared_subschemas(schema, min_chars=50)
    r = ref(DEF_PREFIX + "0")
    assert out["$defs"] == {DEF_PREFIX + "0": ADDRESS}
    assert out["definitions"] == {"kept": ADDRESS}  # a def stays where references name it
    assert out["prefixItems"] == [r] and out["not"] == {"oneOf": [r], "allOf": [r]}
    assert out["patternProperties"] == {"^a": r} and out["dependentSchemas"] == {"a": r}
    for kw in ("items", "contains", "if", "then", "else", "propertyNames", "additionalItems"):
        assert out[kw] == r, kw
    assert out["unevaluatedItems"] == r and out["unevaluatedProperties"] == r


def test_too_deep_to_write_is_left_as_it_is():
    schema: dict = {"type": "string"}
    for _ in range(300):  # deeper than orjson writes
        schema = {"type": "array", "items": schema}
    schema = {"type": "object", "properties": {"a": schema, "b": schema}}
    assert hoist_shared_subschemas(schema) is schema


def repetitive_schema(n: int) -> dict:
    """n properties, each one of two equal objects (with nested arrays of equal addresses)."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "[A-Z][a-z]{1,6}"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "addresses": {"type": "array", "items": ADDRESS, "maxItems": 2},
            "backup": {"anyOf": [ADDRESS, {"type": "null"}]},
        },
        "required": ["name", "addresses"],
    }
    props = {f"p{i}": person if i % 3 else {"type": "array", "items": person} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[:4]}


@pytest.fixture(scope="module")
def lltok(tiny_llama_dir):
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_llama_dir), n_vocab=320)


@pytest.mark.parametrize("min_chars", [1, MIN_SHARED_CHARS])
def test_shared_defs_give_the_same_masks(lltok, min_chars):
    schema = repetitive_schema(6)
    out = hoist_shared_subschemas(schema, min_chars=min_chars)
    assert len(out["$defs"]) >= 2  # the person and, inside it, the address
    plain = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    shared = llg.LLMatcher.grammar_from_json_schema(json.dumps(out))
    walked = [_walk(lltok, plain, shared, seed) for seed in range(6)]
    assert sum(walked) > 300


def test_shared_defs_give_the_same_validation_verdicts():
    schema = repetitive_schema(4)
    out = hoist_shared_subschemas(schema, min_chars=1)
    addr = {"street": "Main 1", "kind": "home", "zip": "12345"}
    person = {"name": "Ann", "age": 30, "addresses": [addr], "backup": None}
    good = {"p0": [person], "p1": person, "p2": person, "p3": []}
    bad = [
        good | {"p1": person | {"age": 130}},
        good | {"p2": person | {"addresses": [addr | {"kind": "x"}]}},
        good | {"p0": [person | {"backup": addr | {"extra": 1}}]},
        good | {"p3": [person | {"name": "ann"}]},
    ]
    for doc in [good, *bad]:
        want = jsonschema_rs.validator_for(schema).is_valid(doc)
        assert jsonschema_rs.validator_for(out).is_valid(doc) == want
    assert jsonschema_rs.validator_for(schema).is_valid(good)
    assert not any(jsonschema_rs.validator_for(schema).is_valid(d) for d in bad)


def test_a_large_schema_compiles_its_shared_form(lltok):
    schema = repetitive_schema(80)
    text = grammar_mod.grammar_text(SO(json=schema))
    assert len(json.dumps(schema)) > grammar_mod.SYNC_VALIDATION_MAX_CHARS
    assert text == grammar_mod.INLINE_JSON + json.dumps(schema, separators=(",", ":"))
    shared = shared_form(text)
    assert (
        shared == grammar_mod.INLINE_JSON + orjson.dumps(hoist_shared_subschemas(schema)).decode()
    )
    assert len(shared) < len(text) / 10
    _walk(lltok, shared, llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)), seed=1)


def _text_with(number: str) -> str:
    """A large repetitive schema as text, with a number orjson would not write back as it is."""
    schema = repetitive_schema(80)
    schema["properties"]["big"] = {"const": 0}
    return json.dumps(schema).replace('{"const": 0}', '{"const": ' + number + "}")


@pytest.mark.parametrize(
    "so",
    [
        SO(json=repetitive_schema(2)),  # small: llguidance's JSON form
        SO(regex="[a-z]{3}"),
        SO(json=_text_with("1" + "0" * 30)),  # beyond 64 bits
        SO(json=_text_with("1e400")),  # beyond a double
        SO(
            json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(900)}}
        ),
    ],
    ids=["small", "regex", "bigint", "huge-float", "nothing-repeated"],
)
def test_other_texts_compile_as_they_are(so):
    text = grammar_mod.grammar_text(so)
    assert shared_form(text) is text


def test_the_manager_shares_them_on_the_normal_priority_thread(tiny_llama_dir, monkeypatch):
    seen = []

    def spy(text: str) -> str:
        out = shared_form(text)
        seen.append((threading.current_thread().name, out != text))
        return out

    monkeypatch.setattr(manager_mod, "shared_form", spy)
    mgr = manager_mod.StructuredOutputManager(
        AutoTokenizer.from_pretrained(tiny_llama_dir), vocab_size=320, eos_token_id=2
    )
    try:
        req = mgr.new_request(SO(json=repetitive_schema(80)))
        assert not req.compilation.result(60).is_error()
        small = mgr.new_request(SO(regex="[a-c]{2}"))  # compiles without a hop
        assert not small.compilation.result(60).is_error()
    finally:
        mgr.shutdown()
    assert len(seen) == 1 and seen[0][0].startswith(NORMAL_THREAD_NAME) and seen[0][1]


def test_the_manager_releases_an_evicted_grammar_off_its_thread(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(manager_mod, "CACHE_SIZE", 1)
    mgr = manager_mod.StructuredOutputManager(
        AutoTokenizer.from_pretrained(tiny_llama_dir), vocab_size=320, eos_token_id=2
    )
    released = []
    monkeypatch.setattr(mgr._pools, "release", released.append)
    try:
        first = mgr.new_request(SO(regex="[a-c]{2}")).compilation
        mgr.new_request(SO(regex="[a-c]{2}"))  # a hit: nothing evicted
        assert released == []
        mgr.new_request(SO(regex="[d-f]{2}"))
        assert released == [[first]]
    finally:
        mgr.shutdown()
