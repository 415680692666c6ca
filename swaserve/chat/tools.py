"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in OpenAI's shapes.

- `"none"` (or no tools): the tools are not shown to the model; plain chat.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is
  constrained (sampling/grammar.py) to that function's `parameters` schema, so the
  arguments always parse and validate; the answer is one call of it.
- `"required"`: constrained to `{"name": <one of the tools>, "arguments": <its schema>}`;
  the answer is one call.
- `"auto"` (the default with tools): the model writes what it likes, and the calls in it
  are parsed (`parse_auto`): a JSON object `{"name": ..., "arguments": {...}}` (or
  `"parameters"`), or a list of them, on its own or inside a ```` ``` ```` fence
  (```` ```json ````, ```` ```tool_code ````, ```` ```tool_call ````) or a
  `<tool_call>...</tool_call>` block (the Hermes / Qwen format), naming a declared tool.
  Anything else is the message's content.

The tools reach the prompt through the chat template: a model's own template gets them as
its `tools` variable (the Hugging Face convention); the built-in Gemma template, which has
none, gets a system instruction listing them and the call format above. Earlier turns go
back the same way: an assistant turn's `tool_calls` and `tool` turns (`tool_call_id`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

NO_ARGUMENTS = {"type": "object", "properties": {}}
_FENCE = re.compile(r"```(?:json|tool_code|tool_call|python)?\s*(.*?)```", re.S)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolPlan:
    """How a request's tools are offered and its calls constrained (server/chat_path.py
    builds it from the body's `tools` and `tool_choice`)."""

    mode: str  # "named" | "required" | "auto"
    parameters: dict[str, dict]  # tool name -> its arguments' JSON schema
    specs: list[dict]  # the tools as the request gave them (for the template)
    name: str | None = None  # mode "named": the function
    schema: dict | None = None  # the schema the output is constrained to (named, required)


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(text: str, plan: ToolPlan) -> list[dict] | None:
    """The tool calls in a finished output, or None when it is not (or not wholly) one."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None  # cut short (max_tokens): no call
        return [new_call(plan.name, text)]
    if plan.mode == "required":
        try:
            obj = json.loads(text)
            return [new_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))]
        except (ValueError, KeyError, TypeError):
            return None
    return parse_auto(text, plan.parameters)


def parse_auto(text: str, tools: dict[str, dict]) -> list[dict] | None:
    """Calls written in one of the formats the module docstring lists."""
    stripped = text.strip()
    candidates = _TAGGED.findall(stripped) or _FENCE.findall(stripped) or [stripped]
    calls = []
    for c in candidates:
        try:
            obj = json.loads(c)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or item.get("name") not in tools:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(new_call(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def tool_instruction(specs: list[dict]) -> str:
    """The built-in template's system text: the tools and the call format it parses."""
    listed = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in specs)
    return ("You can call these functions:\n" + listed + "\nTo call one, reply with only a "
            'JSON object {"name": <function name>, "arguments": <an object of its '
            "parameters>} and nothing else. Otherwise reply normally.")


def template_messages(messages: list[dict], plan: ToolPlan | None,
                      builtin: bool) -> list[dict]:
    """The chat's messages as the template reads them. Content is text: OpenAI's text
    parts are joined, and a missing or null content is "" (an assistant turn that only
    calls tools sends null; templates such as Qwen3's fail on a turn without content).
    Tool calls' arguments become objects (templates write them with `tojson`); for the
    built-in template, which knows no tools, a call is written in the format above and a
    tool result as a user turn."""
    names = {}
    out = []
    for m in messages:
        m = {**m, "content": _text(m.get("content"))}
        calls = m.get("tool_calls") or []
        for c in calls:
            names[c["id"]] = c["function"]["name"]
            try:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            except (ValueError, RecursionError):
                pass  # kept as the text it was
        if builtin and calls:
            written = [json.dumps({"name": c["function"]["name"],
                                   "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                       for c in calls]
            m["content"] = "\n".join(filter(None, [_text(m.get("content")), *written]))
        if builtin and m["role"] == "tool":
            who = names.get(m.get("tool_call_id"), m.get("name") or "the function")
            m = {"role": "user", "content": f"Result of {who}: {_text(m.get('content'))}"}
        out.append(m)
    if builtin and plan is not None:
        out.insert(0, {"role": "system", "content": tool_instruction(plan.specs)})
    return out


def _text(content) -> str:
    """A message's content as text (OpenAI's text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""
