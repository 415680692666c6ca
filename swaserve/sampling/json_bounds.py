"""Bounds that make a schema-constrained JSON answer end. Without them a small model
writes `100000000000…` into an integer field, or one invented key after another into an
object, until max_tokens runs out (llama.cpp bounds its JSON numbers for the same reason).

- a number the schema leaves open: at most INTEGER_DIGITS digits before the point,
  FRACTION_DIGITS after it, no exponent;
- an object that declares `properties`: only those (additionalProperties false), unless the
  schema says otherwise; a free-form object: at most MAX_PROPERTIES members;
- an array: at most MAX_ITEMS items (or its minItems, if that is more);
- free whitespace: none (grammar.JSON_DEFAULTS).

The bounds only narrow what may be generated: every value they allow still validates
against the schema as given, and a schema's own `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` / `multipleOf` / `additionalProperties` /
`maxProperties` / `maxItems` are kept. Values without a type (`{}`, a free-form object's
members, an array's undeclared items) are any JSON value, bounded the same way.

`multipleOf` 1e-10 is how the fraction is bounded: llguidance compiles a `multipleOf` as a
digit pattern, exactly down to 1e-10 (not below: at 1e-12 it rejects `0.5`). Integer bounds
are float64 inside llguidance, so they stay below 2**53 (15 digits, exact).

A schema itself is bounded too (`check_schema_size`), before anything walks it: at most
MAX_SCHEMA_DEPTH nested objects and arrays and MAX_SCHEMA_NODES values in all. Real schemas
sit far inside both; past them, the compiler and this module's own recursion would fail.
"""

from __future__ import annotations

import copy
from typing import Any

INTEGER_DIGITS = 15
FRACTION_DIGITS = 10
MAX_PROPERTIES = 16
MAX_ITEMS = 64
LIMIT = 10**INTEGER_DIGITS - 1
FRACTION_STEP = 10.0**-FRACTION_DIGITS
ANY = "swaserve_any_value"  # the $defs entry for a value of any type

MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 10_000
SCHEMA_LIMITS = (f"at most {MAX_SCHEMA_DEPTH} levels of nested objects and arrays and "
                 f"{MAX_SCHEMA_NODES} values")

_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def check_schema_size(schema: Any, param: str) -> None:
    """ValueError("<param>: ...") when `schema` (parsed JSON) nests deeper or holds more
    values than a schema may."""
    excess = json_excess(schema, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES)
    if excess is not None:
        raise ValueError(f"{param}: the schema {excess} ({SCHEMA_LIMITS})")


def json_excess(value: Any, max_depth: int, max_nodes: int | None = None) -> str | None:
    """"nests too deeply" when JSON-shaped `value` has more than `max_depth` levels of
    nested dicts and lists, "is too large" when it holds more than `max_nodes` values, else
    None. Iterative, so any depth is measured safely."""
    stack, nodes = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        children = (node.values() if isinstance(node, dict) else
                    node if isinstance(node, (list, tuple)) else ())
        for child in children:
            if isinstance(child, (dict, list, tuple)):
                if depth >= max_depth:
                    return "nests too deeply"
                stack.append((child, depth + 1))
            else:
                nodes += 1
        if max_nodes is not None and nodes > max_nodes:
            return "is too large"
    return None


def bound_schema(schema: Any) -> Any:
    """A copy of `schema` with its open numbers and untyped values bounded."""
    any_ref = {"$ref": f"#/$defs/{ANY}"}
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    out = _bound(copy.deepcopy(schema), any_ref)
    defs = out.setdefault("$defs", {})
    if isinstance(defs, dict):
        defs[ANY] = _any_value(any_ref)
    return out


def _any_value(ref: dict) -> dict:
    return {"anyOf": [{"type": ["null", "boolean", "string"]}, _number({"type": "number"}),
                      {"type": "array", "items": ref, "maxItems": MAX_ITEMS},
                      {"type": "object", "additionalProperties": ref,
                       "maxProperties": MAX_PROPERTIES}]}


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _number(node: dict) -> dict:
    """Bound the integer part both ways (leaving room above a lower bound past LIMIT, and
    below an upper one) and, for non-integers, the fraction."""
    lower = next((node[k] for k in _LOWER if isinstance(node.get(k), (int, float))), None)
    upper = next((node[k] for k in _UPPER if isinstance(node.get(k), (int, float))), None)
    if upper is None:
        node["maximum"] = max(LIMIT, int(lower) + LIMIT) if lower is not None else LIMIT
    if lower is None:
        node["minimum"] = min(-LIMIT, int(upper) - LIMIT) if upper is not None else -LIMIT
    if "integer" not in _types(node) and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP
    return node


def _bound(node: Any, any_ref: dict) -> Any:
    if node is True:
        return dict(any_ref)
    if not isinstance(node, dict):
        return node
    if node == {}:
        return dict(any_ref)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_bound(s, any_ref) for s in node[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {k: _bound(s, any_ref) for k, s in node[key].items()}
    for key in _SCHEMA_ONE:
        if key in node and node[key] is not False:
            node[key] = _bound(node[key], any_ref)
    types = _types(node)
    if types & {"integer", "number"} and "enum" not in node and "const" not in node:
        _number(node)
    if "object" in types and "additionalProperties" not in node:
        if "properties" in node or "patternProperties" in node:
            node["additionalProperties"] = False
        else:  # free-form: any members, not endlessly many
            node["additionalProperties"] = dict(any_ref)
            if "maxProperties" not in node:
                node["maxProperties"] = max(MAX_PROPERTIES, node.get("minProperties", 0))
    if "array" in types:
        if "items" not in node and "prefixItems" not in node:
            node["items"] = dict(any_ref)
        if "maxItems" not in node:
            node["maxItems"] = max(MAX_ITEMS, node.get("minItems", 0))
    return node
