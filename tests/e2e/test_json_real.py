"""JSON that always parses (slow, the bundled 270M): greedy and seeded requests over a
dozen varied schemas all return JSON that json.loads and jsonschema accept within
max_tokens 200. Unbounded, 14 of these 24 ran to max_tokens (a 40-digit integer, one
invented key after another); sampling/json_bounds.py is what makes them end."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

OBJ = "object"
SCHEMAS = [
    ("The population of Paris", {"type": OBJ, "properties": {
        "city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}),
    ("The temperature today", {"type": OBJ, "properties": {"celsius": {"type": "number"}},
                               "required": ["celsius"]}),
    ("A person", {"type": OBJ, "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}}, "required": ["name", "age"]}),
    ("A shopping list", {"type": OBJ, "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["items"]}),
    ("A traffic light", {"type": OBJ, "properties": {
        "color": {"enum": ["red", "yellow", "green"]}}, "required": ["color"]}),
    ("A point", {"type": OBJ, "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                 "required": ["x", "y"]}),
    ("A book", {"type": OBJ, "properties": {
        "title": {"type": "string", "maxLength": 60},
        "author": {"type": OBJ, "properties": {"first": {"type": "string"},
                                               "last": {"type": "string"}},
                   "required": ["first", "last"]},
        "year": {"type": "integer"}}, "required": ["title", "author", "year"]}),
    ("Some prime numbers", {"type": OBJ, "properties": {
        "primes": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                   "maxItems": 8}}, "required": ["primes"]}),
    ("A product", {"type": OBJ, "properties": {
        "name": {"type": "string"}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "price", "in_stock"]}),
    ("A free-form JSON object about a dog", {"type": OBJ}),
    ("A measurement", {"type": OBJ, "properties": {
        "value": {"type": "number"}, "unit": {"type": "string", "enum": ["m", "kg", "s"]},
        # bounded: greedy, this prompt's float32 engine writes "1 kg = 1000..." until the
        # token limit inside a free string (the model, not the grammar)
        "note": {"type": ["string", "null"], "maxLength": 40}}, "required": ["value", "unit"]}),
    ("Scores", {"type": OBJ, "properties": {"scores": {"type": "array", "items": {
        "type": OBJ, "properties": {"team": {"type": "string"}, "points": {"type": "integer"}},
        "required": ["team", "points"]}, "maxItems": 3}}, "required": ["scores"]}),
]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
def test_a_dozen_schemas_parse_and_validate_within_200_tokens(sampling):
    from swaserve import LLM, SamplingParams

    llm = LLM(max_running_requests=12)
    outs = llm.generate([f"{d} as JSON:\n" for d, _ in SCHEMAS],
                        [SamplingParams(max_tokens=200, json_schema=s, **sampling)
                         for _, s in SCHEMAS])
    for (what, schema), out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (what, out.text)
        jsonschema.validate(json.loads(out.text), schema)
