"""Structured output in a family's own chat format, as a Lark grammar for llguidance.

A required or named tool call is constrained to the syntax the model was trained to write
(Hermes' `<tool_call>`, Harmony's `to=functions.NAME`, Mistral's `[TOOL_CALLS]NAME[ARGS]`,
...: each format's `call_grammar`) rather than to bare JSON, so the model sees its own
format and the format's call parser reads the call back. A JSON schema (`response_format`,
or a call's arguments) applies to the answer after the model's reasoning: the reasoning
block the family writes first stays free text. With tools on offer (`tool_choice` auto)
beside a schema, the output is that answer or a call in the family's syntax, so an agent
that wants typed output can still call its tools.

Formats whose call syntax is not JSON (Qwen3.5's XML parameters, Gemma 4's, DeepSeek V4's
DSML) have no call grammar: their constrained calls are bare JSON, read back by
`tools.parse_calls`.
"""

from __future__ import annotations

from swaserve.chat.lark import Lark
from swaserve.chat.registry import FORMATS, REASONING
from swaserve.chat.tools import ToolPlan

# tool formats whose calls have a grammar
CALL_GRAMMARS = tuple(name for name, f in FORMATS.items() if f.has_call_grammar)


def _calls(plan: ToolPlan) -> dict[str, dict]:
    """The calls the plan allows: tool name -> its arguments' schema."""
    if plan.mode == "named":
        return {plan.name: plan.parameters[plan.name]}
    return dict(plan.parameters)


def answer_grammar(tokenizer, *, reasoning: str | None, tools: str | None,
                   template: str, prompt: str, plan: ToolPlan | None,
                   schema: dict | None, json_bounds: bool = True) -> str | None:
    """The Lark grammar of a constrained answer in the family's format, or None when the
    request's own constraint (if any) applies to the whole output unchanged: a required
    or named call (`plan`) in the tool format's syntax, or `schema` (a JSON schema of the
    answer) after the reasoning block; with tools on offer (`plan` auto) beside a schema,
    either that answer or a call in the tool format's syntax."""
    lk = Lark(tokenizer, json_bounds)
    block = REASONING.get(reasoning) if reasoning is not None else None
    fmt = FORMATS.get(tools) if tools is not None else None
    lead = block.lead(lk, prompt) if block is not None else ""
    if plan is not None and plan.mode in ("named", "required") and fmt is not None \
            and fmt.has_call_grammar:
        if not fmt.constrains_calls(lk):
            return None
        calls = [fmt.call_grammar(lk, name, args, template)
                 for name, args in _calls(plan).items()]
        body = calls[0] if len(calls) == 1 else "(" + " | ".join(calls) + ")"
        return f"start: {lead} {body}" if lead else f"start: {body}"
    if schema is None:
        return None
    body = lk.json(schema)
    if block is not None:
        body = block.answer(lk, body)
    if (plan is not None and plan.mode == "auto" and fmt is not None and fmt.has_call_grammar
            and fmt.constrains_calls(lk)):
        # tools on offer beside a JSON answer: a call in the family's syntax, or the answer
        calls = [fmt.call_grammar(lk, name, args, template)
                 for name, args in _calls(plan).items()]
        call = fmt.repeated_calls("(" + " | ".join(calls) + ")")
        return f"start: {lead} ({body} | {call})"
    if lead:
        return f"start: {lead} {body}"
    return None
