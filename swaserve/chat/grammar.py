"""Structured output in a family's own chat format, as a Lark grammar for llguidance.

A required or named tool call is constrained to the syntax the model was trained to write
(Hermes' `<tool_call>`, Harmony's `to=functions.NAME`, Mistral's `[TOOL_CALLS]NAME[ARGS]`,
...) rather than to bare JSON, so the model sees its own format and the family's tool
parser reads the call back. A JSON schema (`response_format`, or a call's arguments)
applies to the answer after the model's reasoning: the reasoning block the family writes
first stays free text. With tools on offer (`tool_choice` auto) beside a schema, the output
is that answer or a call in the family's syntax, so an agent that wants typed output can
still call its tools.

A marker that is one token of the tokenizer is written as that token (`<[id]>`: llguidance
holds every added token apart from the text), so the model is held to the token it was
trained on, never to the marker spelled out in pieces. Families whose call syntax is not
JSON (Qwen3.5's XML parameters, Gemma 4's, DeepSeek V4's DSML) get no grammar here: their
constrained calls are bare JSON, as before, read back by `tools.parse_calls`.
"""

from __future__ import annotations

import json

from swaserve.sampling.grammar import JSON_DEFAULTS
from swaserve.sampling.json_bounds import bound_schema
from swaserve.server.tools import ToolPlan

# tool formats whose calls have a grammar below
CALL_GRAMMARS = ("harmony", "hermes", "llama3_json", "mistral", "deepseek")
_ANY_TEXT = "/(?s:.*)/"


class _Lark:
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


def _object(props: dict[str, dict]) -> dict:
    """A JSON object of exactly these properties, in this order."""
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _calls(plan: ToolPlan) -> dict[str, dict]:
    """The calls the plan allows: tool name -> its arguments' schema."""
    if plan.mode == "named":
        return {plan.name: plan.parameters[plan.name]}
    return dict(plan.parameters)


def _call(fmt: str, lk: _Lark, name: str, args: dict, template: str) -> str:
    """One call of `name` in the format's syntax, as the family's template writes it."""
    if fmt == "hermes":
        return " ".join([lk.mark("<tool_call>"), txt("\n"), lk.json(_object(
            {"name": {"const": name}, "arguments": args})), txt("\n"), lk.mark("</tool_call>")])
    if fmt == "llama3_json":
        return lk.json(_object({"name": {"const": name}, "parameters": args}))
    if fmt == "mistral":
        if "[ARGS]" in template:  # Small 3.2 and later: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{}
            call_id = (f" {lk.mark('[CALL_ID]')} /[a-zA-Z0-9]{{9}}/" if "[CALL_ID]" in template
                       else "")
            return " ".join([lk.mark("[TOOL_CALLS]"), txt(name) + call_id, lk.mark("[ARGS]"),
                             lk.json(args)])
        listed = {"type": "array", "minItems": 1, "maxItems": 1,
                  "items": _object({"name": {"const": name}, "arguments": args})}
        return " ".join([lk.mark("[TOOL_CALLS]"), lk.json(listed)])
    if fmt == "deepseek":
        return " ".join([lk.mark("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), txt(name),
                         lk.mark("<｜tool▁sep｜>"), lk.json(args),
                         lk.mark("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")])
    if fmt == "harmony":  # the recipient in the header, as gpt-oss's template writes calls
        return " ".join([txt(f" to=functions.{name}"), lk.mark("<|channel|>"),
                         txt("commentary json"), lk.mark("<|message|>"), lk.json(args)])
    raise ValueError(f"no call grammar for tool format {fmt!r}")


_HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")


def _reasoning(reasoning: str | None, lk: _Lark, prompt: str) -> str:
    """What the output may start with before the answer: the family's reasoning block
    (free text), or nothing (the format writes none, or its markers are not tokens here)."""
    if reasoning == "harmony" and lk.has_tokens(*_HARMONY):
        return (f"({lk.mark('<|channel|>')} {txt('analysis')} {lk.mark('<|message|>')} "
                f"{_ANY_TEXT} {lk.mark('<|end|>', '<|start|>')} {txt('assistant')})?")
    if reasoning in ("qwen3", "deepseek_r1") and lk.has_tokens("<think>", "</think>"):
        block = f"{_ANY_TEXT} {lk.mark('</think>')} /[ \\n]*/"
        if prompt.rstrip().endswith("<think>"):  # the template opened the block
            return block
        return f"({lk.mark('<think>')} {block})?"
    return ""


def answer_grammar(tokenizer, *, reasoning: str | None, tools: str | None,
                   template: str, prompt: str, plan: ToolPlan | None,
                   schema: dict | None, json_bounds: bool = True) -> str | None:
    """The Lark grammar of a constrained answer in the family's format, or None when the
    request's own constraint (if any) applies to the whole output unchanged: a required
    or named call (`plan`) in the tool format's syntax, or `schema` (a JSON schema of the
    answer) after the reasoning block; with tools on offer (`plan` auto) beside a schema,
    either that answer or a call in the tool format's syntax."""
    lk = _Lark(tokenizer, json_bounds)
    lead = _reasoning(reasoning, lk, prompt)
    if plan is not None and plan.mode in ("named", "required") and tools in CALL_GRAMMARS:
        if tools == "harmony" and not lk.has_tokens(*_HARMONY):
            return None
        calls = [_call(tools, lk, name, args, template) for name, args in _calls(plan).items()]
        body = calls[0] if len(calls) == 1 else "(" + " | ".join(calls) + ")"
        return f"start: {lead} {body}" if lead else f"start: {body}"
    if schema is None:
        return None
    body = lk.json(schema)
    if reasoning == "harmony":
        body = f"{lk.mark('<|channel|>')} {txt('final')} {lk.mark('<|message|>')} {body}"
    if (plan is not None and plan.mode == "auto" and tools in CALL_GRAMMARS
            and (tools != "harmony" or lk.has_tokens(*_HARMONY))):
        # tools on offer beside a JSON answer: a call in the family's syntax, or the answer
        calls = [_call(tools, lk, name, args, template) for name, args in _calls(plan).items()]
        call = "(" + " | ".join(calls) + ")"
        if tools == "hermes":  # parallel calls, one block a line
            call = f"{call} ({txt(chr(10))} {call})*"
        return f"start: {lead} ({body} | {call})"
    if lead:
        return f"start: {lead} {body}"
    return None
