"""Structured output: JSON schemas, regex and EBNF grammars constrain what is sampled
(greedy, seeded and filtered rows alike), rows with and without grammars share a batch
without changing each other, and bad grammars are clear errors that cost nothing."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from swaserve import LLM, SamplingParams
from swaserve.sampling.grammar import GrammarCompiler
from tests.conftest import TEST_DEVICE

pytest.importorskip("llguidance")

S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -5, "maximum": 300}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


# nested objects, arrays, enums and bounded numbers; every language here is finite, so even
# a random-weight model must close the value within max_tokens (unbounded decimals and free
# keys are left to the real model's test, tests/e2e/test_real_model.py)
SCHEMAS = [
    obj({"a": INT}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    {"enum": ["yes", "no", "maybe"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": INT, "maxItems": 3},
    obj({"user": obj({"id": INT, "tag": S})}),
    obj({"p": obj({"q": obj({"r": {"type": "boolean"}})})}),
    obj({"xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 5}}),
    obj({"score": {"enum": [0.5, 1.25, -3e2]}}),
    obj({"t": {"type": "integer", "exclusiveMinimum": -10, "maximum": 10}}),
    S,
    {"type": "integer", "minimum": 10, "maximum": 20},
    obj({"a": INT, "b": {"type": "null"}}),
    obj({"pt": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj({"kind": {"const": "point"}, "x": INT}),
    {"type": "array", "items": obj({"k": {"enum": ["a", "b"]}}), "maxItems": 2},
    obj({"opt": INT, "req": {"type": "boolean"}}, required=["req"]),
    obj({"v": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}),
]


@pytest.fixture(scope="module")
def llm(tiny_with_tokenizer):
    return LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE)


def test_twenty_schemas_parse_and_validate_greedy_and_seeded(llm):
    assert len(SCHEMAS) == 20
    for mode in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_p": 0.95}):
        outs = llm.generate(["{"] * len(SCHEMAS), [
            SamplingParams(max_tokens=300, json_schema=s, **mode) for s in SCHEMAS])
        for schema, out in zip(SCHEMAS, outs):
            assert out.finish_reason == "stop", (schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    llm.engine.check_integrity()
    assert llm.engine.cache.is_fully_free()


def test_schema_as_text_and_property_order(llm):
    schema = obj({"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}})
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=50,
                                           json_schema=json.dumps(schema)))[0]
    assert list(json.loads(out.text)) == ["zeta", "alpha"]  # the schema's order, not sorted


def test_regex_and_ebnf_outputs_match(llm):
    regex = r"[0-9]{3}-[0-9]{4}"
    ebnf = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,6}'
    for seed in range(4):
        outs = llm.generate(["a", "b"], [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=50, regex=regex),
            SamplingParams(temperature=1.0, seed=seed, max_tokens=50, grammar=ebnf)])
        assert re.fullmatch(regex, outs[0].text) and outs[0].finish_reason == "stop"
        assert re.fullmatch(r"(hello|hi) [a-z]{1,6}", outs[1].text), outs[1].text
    lark = 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'
    out = llm.generate("c", SamplingParams(temperature=0, max_tokens=20, grammar=lark))[0]
    assert re.fullmatch(r"\([0-9]{1,3}\)", out.text)


def test_mixed_batch_rows_equal_alone(llm):
    schema = obj({"name": S, "age": INT})
    params = [
        SamplingParams(temperature=0, max_tokens=40, json_schema=schema),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, seed=5, top_k=20, max_tokens=40, regex=r"[a-z]{2,8}!"),
        SamplingParams(temperature=0.8, seed=6, top_p=0.9, max_tokens=12),
        SamplingParams(temperature=1.0, seed=8, max_tokens=40, json_schema=schema,
                       logit_bias={5: 3.0}, presence_penalty=0.5),
    ]
    prompts = ["alpha", "beta gamma", "{", "[1, 2", "hello"]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate(prompt, p)[0]
        assert alone.token_ids == out.token_ids, prompt
    jsonschema.validate(json.loads(together[0].text), schema)
    jsonschema.validate(json.loads(together[4].text), schema)


@pytest.mark.parametrize("kw, param, words", [
    ({"json_schema": {"type": "objectx"}}, "json_schema", "objectx"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": [1, 2]}, "json_schema", "JSON object"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"grammar": "root ::= ("}, "grammar", "grammar"),
    ({"grammar": "   "}, "grammar", "non-empty"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "grammar", "only one kind"),
])
def test_bad_grammars_are_clear_errors_and_the_engine_keeps_serving(llm, kw, param, words):
    with pytest.raises(ValueError) as e:
        llm.generate("x", SamplingParams(max_tokens=4, **kw))
    assert str(e.value).startswith(f"{param}:") and words in str(e.value)
    assert not llm.engine.has_unfinished() and llm.engine.cache.is_fully_free()
    assert llm.generate("x", SamplingParams(temperature=0, max_tokens=3))[0].finish_reason == "length"


def test_grammars_are_compiled_once(llm):
    schema = obj({"cached": {"type": "boolean"}})
    p = SamplingParams(max_tokens=10, json_schema=schema)
    assert llm.engine.compile_grammar(p) is llm.engine.compile_grammar(p)


def test_missing_llguidance_is_a_clear_error(monkeypatch, llm):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import raises ImportError
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, [1])
    assert not compiler.available()
    with pytest.raises(ValueError, match=r"regex: structured output needs llguidance; install"):
        compiler.compile("regex", "a+")


def test_grammar_needs_a_tokenizer(tiny_hybrid):
    path, _ = tiny_hybrid  # token-id checkpoint without tokenizer files
    llm = LLM(path, dtype="float32", device=TEST_DEVICE)
    with pytest.raises(ValueError, match="json_schema: structured output needs the model's tokenizer"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=4, json_object=True))


def test_n_completions_each_follow_the_grammar(llm):
    schema = obj({"a": INT, "tag": S})
    out = llm.generate("{", SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=60,
                                           json_schema=schema))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # seeds seed + i: different samples


# -- bounds on what a schema leaves open (sampling/json_bounds.py) --------------------------
def accepts(llm, schema: dict, text: str) -> bool:
    """The compiled grammar takes `text` whole and is then complete."""
    m = llm.engine.compile_grammar(SamplingParams(json_schema=schema)).new_matcher()
    return all(m.accept(t) for t in llm.tokenizer.encode(text, add_special_tokens=False)) \
        and m.is_terminated


def test_open_numbers_are_bounded_and_values_within_the_bounds_still_validate(llm):
    from swaserve.sampling.json_bounds import FRACTION_DIGITS, INTEGER_DIGITS

    num = {"type": "object", "properties": {"v": {"type": "number"}}, "required": ["v"]}
    integer = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    big, frac = "9" * INTEGER_DIGITS, "5" * FRACTION_DIGITS  # |x| <= 10**15 - 1
    for schema, text, ok in [
            (integer, f'{{"v": {big}}}', True), (integer, f'{{"v": -{big}}}', True),
            (integer, f'{{"v": {big}9}}', False),
            (num, f'{{"v": {big[:-1]}8.{frac}}}', True), (num, f'{{"v": -0.{frac}5}}', False),
            (num, f'{{"v": {big}9}}', False),
            (num, '{"v": 1e5}', False), (num, '{"v": 0.25}', True),
            (num, '{"v": 3, "w": 4}', False),  # declared properties only
            # a schema's own bounds are kept, past the default ones too
            ({**integer, "properties": {"v": {"type": "integer", "minimum": 10**15}}},
             f'{{"v": {10**15 + 5}}}', True),
            ({**num, "properties": {"v": {"type": "number", "multipleOf": 0.5}}},
             '{"v": 2.5}', True),
            ({**num, "properties": {"v": {"type": "number", "multipleOf": 0.5}}},
             '{"v": 2.25}', False),
            ({**num, "additionalProperties": True}, '{"v": 3, "w": 4}', True)]:
        assert accepts(llm, schema, text) is ok, (schema, text)
        if ok:
            jsonschema.validate(json.loads(text), schema)


def test_free_form_values_are_bounded_in_size():
    from swaserve.sampling.json_bounds import MAX_ITEMS, MAX_PROPERTIES, bound_schema

    b = bound_schema({"type": "object"})
    assert b["maxProperties"] == MAX_PROPERTIES
    b = bound_schema({"type": "array", "minItems": 100})
    assert b["maxItems"] == 100 and b["items"] == {"$ref": "#/$defs/swaserve_any_value"}
    assert bound_schema({"type": "array", "items": INT})["maxItems"] == MAX_ITEMS
    kept = {"type": "array", "items": INT, "maxItems": 2}
    assert bound_schema(kept)["maxItems"] == 2 and kept == {"type": "array", "items": INT,
                                                            "maxItems": 2}  # not mutated


def test_json_bounds_can_be_turned_off(tiny_with_tokenizer):
    off = LLM(tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, json_bounds=False)
    integer = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    assert accepts(off, integer, '{"v": 12345678901234567890}')
    assert accepts(off, integer, '{"v": 1, "w": 2}')
