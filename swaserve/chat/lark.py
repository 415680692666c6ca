"""Lark pieces for the grammars of a family's chat format (llguidance's Lark dialect): a
marker that is one token of the tokenizer is written as that token (`<[id]>`: llguidance
holds every added token apart from the text), so the model is held to the token it was
trained on, never to the marker spelled out in pieces."""

from __future__ import annotations

import json

from swaserve.sampling.grammar import JSON_DEFAULTS
from swaserve.sampling.json_bounds import bound_schema

ANY_TEXT = "/(?s:.*)/"


class Lark:
    """Lark pieces for one tokenizer: markers as tokens where they are one."""

    def __init__(self, tokenizer, json_bounds: bool):
        self.tok = tokenizer
        self.json_bounds = json_bounds

    def mark(self, *markers: str) -> str:
        """Markers in order, each as its token where it is one, else as its text."""
        ids = [self.tok.token_to_id(m) for m in markers]
        return " ".join(f"<[{i}]>" if i is not None else txt(m) for i, m in zip(ids, markers))

    def has_tokens(self, *markers: str) -> bool:
        return all(self.tok.token_to_id(m) is not None for m in markers)

    def json(self, schema: dict) -> str:
        if self.json_bounds:
            schema = bound_schema(schema)
        return "%json " + json.dumps({**schema, "x-guidance": JSON_DEFAULTS},
                                     ensure_ascii=False)


def txt(text: str) -> str:
    """Plain text as a Lark string."""
    return json.dumps(text, ensure_ascii=False)


def exact_object(props: dict[str, dict]) -> dict:
    """A JSON object of exactly these properties, in this order."""
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}
