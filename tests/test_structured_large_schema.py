"""A schema too large to validate at add time compiles from its Lark form (`start: %json ...`,
which llguidance reads without holding the GIL): the same token masks as llguidance's own
JSON-schema grammar, step by step along random walks, with and without llguidance options."""

from __future__ import annotations

import json
import random

import llguidance as llg
import llguidance.hf
import llguidance.numpy as llg_np
import numpy as np
import pytest
from transformers import AutoTokenizer

from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output import grammar as grammar_mod


def large_schema(n: int) -> dict:
    """n required properties whose names, patterns and enums hold Lark's comment and brace
    characters, quotes, escapes and non-ASCII text; nested arrays, objects and bounded numbers."""
    props = {}
    for i in range(n):
        props[f"p{i}#//}}"] = {
            "type": "object",
            "properties": {
                "s": {"type": "string", "pattern": "^#[0-9a-f]{1,2}//[}{]?$"},
                "e": {"enum": ['x"}', "y\\z", "é✓ {", f"v{i}"]},
                "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "n": {"type": "number", "minimum": -5, "maximum": 10},
            },
            "required": ["s", "e"],
        }
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.fixture(scope="module")
def lltok(tiny_llama_dir):
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_llama_dir), n_vocab=320)


def _walk(lltok, text_a: str, text_b: str, seed: int, steps: int = 200) -> int:
    """Draws a random token allowed by both matchers at each step (EOS now and then where the
    grammar may end), asserting that their masks are equal. Returns the steps walked."""
    a = llg.LLMatcher(lltok, text_a, log_level=0)
    b = llg.LLMatcher(lltok, text_b, log_level=0)
    assert not a.is_error() and not b.is_error(), (a.get_error(), b.get_error())
    rng = random.Random(seed)
    mask_a = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
    mask_b = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
    for step in range(steps):
        llg_np.fill_next_token_bitmask(a, mask_a, 0)
        llg_np.fill_next_token_bitmask(b, mask_b, 0)
        np.testing.assert_array_equal(mask_a, mask_b, err_msg=f"seed {seed} step {step}")
        bits = np.unpackbits(mask_a[0].view(np.uint8), bitorder="little")[: lltok.vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        if a.is_stopped() or not allowed:
            return step
        eos = lltok.eos_token
        tok = eos if eos in allowed and rng.random() < 0.1 else rng.choice(allowed)
        assert a.consume_token(tok) and b.consume_token(tok)
    return steps


@pytest.mark.parametrize(
    "whitespace_pattern, own_options",
    [(None, None), ("", None), (r"[ \n]{0,2}", None), ("", {"whitespace_pattern": " ?"})],
)
def test_large_schema_lark_form_gives_the_same_masks(lltok, whitespace_pattern, own_options):
    schema = large_schema(60)
    if own_options is not None:  # the schema's own options win over whitespace_pattern
        schema["x-guidance"] = own_options
    so = SO(json=schema, whitespace_pattern=whitespace_pattern)
    text = grammar_mod.grammar_text(so)
    assert text.startswith(grammar_mod.INLINE_JSON)
    assert len(text) > grammar_mod.SYNC_VALIDATION_MAX_CHARS
    defaults = None if whitespace_pattern is None else {"whitespace_pattern": whitespace_pattern}
    json_form = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    walked = [_walk(lltok, text, json_form, seed) for seed in range(6)]
    assert sum(walked) > 300  # the walks went into the schema, not stopping at once


def test_large_schema_given_as_text_takes_the_lark_form(lltok):
    schema = large_schema(60)
    text = grammar_mod.grammar_text(SO(json=json.dumps(schema, indent=2)))
    assert text.startswith(grammar_mod.INLINE_JSON)
    _walk(lltok, text, llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)), seed=0)


def test_small_schema_keeps_the_json_form():
    text = grammar_mod.grammar_text(SO(json=large_schema(1)))
    assert not text.startswith(grammar_mod.INLINE_JSON)
    assert not llg.LLMatcher.validate_grammar(text)
