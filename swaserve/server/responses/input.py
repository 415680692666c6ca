"""A Responses body as the chat request it means (protocol.ChatCompletionRequest), so the
chat path (chat_path.prepare_chat) renders, constrains and admits it as it does chat.

- `instructions` is a system message first; `input` a user message (a string) or items:
  messages (text parts joined), `function_call` items (an assistant turn's tool calls,
  consecutive ones in one turn), `function_call_output` items (tool messages, answering a
  call made earlier in `input`), `reasoning` items (the next assistant turn's reasoning,
  which templates that keep reasoning write back).
- function `tools` become chat tools; a built-in tool (web_search, file_search, ...) is a
  400 naming its type. `tool_choice`, `parallel_tool_calls`, `text.format` (as
  `response_format`), `reasoning.effort` (as `reasoning_effort`), `max_output_tokens`,
  `temperature` and `top_p` map one to one.

Every 400 names the Responses field (`input.2.call_id`, `tools.0.type`): errors of the chat
request are renamed back (`rename`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from swaserve.server.errors import APIError, validation_error
from swaserve.server.openai.protocol import ChatCompletionRequest
from swaserve.server.responses.protocol import (
    ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextContent,
)

# chat fields a Responses body may carry as extras, passed through as they are
_PASSED_THROUGH = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "min_tokens", "ignore_eos", "chat_template_kwargs")
# Responses fields this server has no counterpart for: (field, why)
_REFUSED = (("conversation", "this server keeps no conversations; send the whole "
             "conversation in input"),
            ("prompt", "this server keeps no prompt templates; send instructions and input"))


@dataclass
class ChatRequest:
    """The chat request of a Responses body, and where each of its messages came from
    (`instructions`, `input`, `input.3`): the field a 400 about that message names."""

    body: ChatCompletionRequest
    sources: list[str]


def _checked(model: type[BaseModel], raw: Any, at: str) -> Any:
    """`raw` as `model`, or a 400 naming the field under `at`."""
    if not isinstance(raw, dict):
        raise APIError(400, f"{at}: must be an object", at)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = [{**err, "loc": (*at.split("."), *err["loc"])} for err in e.errors()]
        raise validation_error(errors) from None


def _text(content: str | list[dict], at: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    out = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise APIError(400, f"{at}.content.{j}.type: only text parts (input_text, "
                           f"output_text) are supported, got {kind!r}",
                           f"{at}.content.{j}.type")
        part = _checked(TextContent, raw, f"{at}.content.{j}")
        text = part.refusal if kind == "refusal" else part.text
        if text is None:
            field = "refusal" if kind == "refusal" else "text"
            raise APIError(400, f"{at}.content.{j}.{field}: required", f"{at}.content.{j}.{field}")
        out.append(text)
    return "".join(out)


def _messages(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    messages: list[dict] = []
    sources: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        sources.append("instructions")
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}], sources + ["input"]
    turn: dict | None = None  # the open assistant turn: reasoning, content, calls
    calls: set[str] = set()
    for i, raw in enumerate(body.input):
        at = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None) \
            if isinstance(raw, dict) else None
        if kind not in ITEMS:
            why = ("this server stores no items; send the item itself"
                   if kind == "item_reference" else
                   "must be one of message, function_call, function_call_output, reasoning")
            raise APIError(400, f"{at}.type: {why} (got {kind!r})", f"{at}.type")
        item = _checked(ITEMS[kind], raw, at)
        if isinstance(item, MessageItem) and item.role != "assistant":
            turn = None
            messages.append({"role": item.role, "content": _text(item.content, at)})
            sources.append(at)
            continue
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"{at}.call_id: no function_call earlier in input has "
                               f"call_id {item.call_id!r}", f"{at}.call_id")
            turn = None
            output = item.output if isinstance(item.output, str) else _text(item.output, at)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            sources.append(at)
            continue
        # the assistant's side: reasoning, then its message, then its calls, in one turn
        said = turn is not None and (turn["content"] is not None or turn["tool_calls"])
        if turn is None or (said and not isinstance(item, FunctionCallItem)):
            turn = {"role": "assistant", "content": None, "tool_calls": []}
            messages.append(turn)
            sources.append(at)
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            turn["reasoning_content"] = "".join(p.text for p in parts)
        elif isinstance(item, MessageItem):
            turn["content"] = _text(item.content, at)
        else:
            calls.add(item.call_id)
            turn["tool_calls"].append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    for m in messages:
        if m["role"] == "assistant" and not m["tool_calls"]:
            del m["tool_calls"]
    return messages, sources


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    out = []
    for k, raw in enumerate(body.tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise APIError(400, f"tools.{k}.type: {kind!r} is not a tool this server runs; "
                           "only function tools are supported", f"tools.{k}.type")
        tool = _checked(FunctionTool, raw, f"tools.{k}")
        spec = tool.model_dump(include={"name", "description", "parameters", "strict"},
                               exclude_none=True)
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema: a json_schema format needs its schema",
                       "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                   "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def check_unsupported(body: ResponsesRequest) -> None:
    """A 400 for what asks for state this server does not keep (see routes.py)."""
    if body.store:
        raise APIError(400, "store: this server keeps no responses; leave store unset or "
                       "false, and send the whole conversation in input", "store")
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id: this server keeps no responses; send "
                       "the whole conversation in input", "previous_response_id")
    if body.background:
        raise APIError(400, "background: responses run in the foreground only", "background")
    extra = body.model_extra or {}
    for field, why in _REFUSED:
        if extra.get(field) is not None:
            raise APIError(400, f"{field}: {why}", field)


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request of a Responses body; a 400 names the Responses field at fault."""
    check_unsupported(body)
    messages, sources = _messages(body)
    if not messages:
        raise APIError(400, "input: must not be empty", "input")
    extra = body.model_extra or {}
    chat = {"model": body.model, "messages": messages, "tools": _tools(body),
            "tool_choice": _tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body),
            "reasoning_effort": body.reasoning.effort if body.reasoning else None,
            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "user": body.user,
            **{k: extra[k] for k in _PASSED_THROUGH if k in extra}}
    try:
        return ChatRequest(ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}), sources)
    except ValidationError as e:
        raise rename(validation_error(e.errors()), sources) from None


_RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format", "json_schema": "text.format.schema",
            "reasoning_effort": "reasoning.effort", "messages": "input"}


def _field(param: str, sources: list[str]) -> str:
    head, _, rest = param.partition(".")
    if head == "messages" and rest:
        k, _, _ = rest.partition(".")
        return sources[int(k)] if k.isdigit() and int(k) < len(sources) else "input"
    if head == "tools" and rest:  # tools.0.function.name -> tools.0.name
        return param.replace(".function.", ".", 1)
    if head == "tool_choice":
        return "tool_choice"
    return _RENAMED.get(param, param)


def rename(e: APIError, sources: list[str]) -> APIError:
    """A chat request's error as the Responses body's: its field renamed, in its message
    too."""
    if e.param is None:
        return e
    param = _field(e.param, sources)
    message = e.message
    if message.startswith(e.param + ":"):
        message = param + message[len(e.param):]
    return APIError(e.status, message, param, e.type, e.code, e.headers)
