"""Anthropic's Messages API bodies (pydantic, strict as openai/protocol.py's), and their
mapping to a `ChatCompletionRequest`, so that /v1/messages runs on the chat path
(chat_path.py `prepare_chat`): the same template, tool plan, output constraint and parsers.

The mapping: `system` becomes a system turn; a user turn's `tool_result` blocks become
`tool` turns (`tool_call_id`, the result's text, "Error: " before it when `is_error`) ahead
of its text; an assistant turn's `thinking` blocks become its reasoning, its `tool_use`
blocks its `tool_calls`. A conversation that ends on an assistant turn is continued
(`continue_final_message`). `tool_choice` any / tool / none are required / named / none,
`disable_parallel_tool_use` is `parallel_tool_calls: false`, and `thinking` sets the
template's switches (`enable_thinking`, Qwen3's; `thinking`, DeepSeek's).

A string where blocks may come is one text block. A block's loc in a validation error is
its place in the list (`messages.0.content.1.tool_use_id`): the tags that choose a block's
model are not identifiers, so errors.py leaves them out of the field's name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)

from swaserve.server.errors import APIError, validation_error
from swaserve.server.openai.protocol import (
    MAX_STOP,
    ChatCompletionRequest,
    Flag,
    Integer,
    JSONObject,
    Number,
    Text,
)


def _blocks(v: Any) -> Any:
    """A string where blocks may come: one text block."""
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, unused


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Annotated[list[TextBlock], BeforeValidator(_blocks)] | None = None
    is_error: Flag | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: Text | None = None


_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_type(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return f"{kind} block" if kind in _TYPES else None


Block = Annotated[
    Annotated[TextBlock, Tag("text block")]
    | Annotated[ToolUseBlock, Tag("tool_use block")]
    | Annotated[ToolResultBlock, Tag("tool_result block")]
    | Annotated[ThinkingBlock, Tag("thinking block")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking block")],
    Discriminator(_block_type, custom_error_type="block_type",
                  custom_error_message="a block's type must be one of " + ", ".join(_TYPES)
                  + " (images and documents are not supported)")]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: Annotated[list[Block], BeforeValidator(_blocks)]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    input_schema: JSONObject
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not run here


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: Flag | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[Integer, Field(ge=1)] | None = None


class CountTokensRequest(BaseModel):
    """The body of /v1/messages/count_tokens: a message's, less `max_tokens` and `stream`."""

    model_config = ConfigDict(extra="allow")  # fields of newer API versions are accepted

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_blocks)] | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[Integer, Field(ge=1)]
    stop_sequences: Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Integer | None = None
    metadata: dict[str, Any] | None = None
    stream: Flag = False


# -- to a chat body ---------------------------------------------------------------------------

# a chat body's fields, and the names they go by in a messages body (for a 400's field)
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
           "chat_template_kwargs": "thinking", "continue_final_message": "messages"}


def messages_field(e: APIError) -> APIError:
    """An error of the chat path with the field named as a messages body names it."""
    if e.param is None:
        return e
    head = e.param.split(".", 1)[0]
    if head not in _FIELDS and not (head == "tool_choice" and "is not among" in e.message):
        return e
    name = "tool_choice.name" if head == "tool_choice" else _FIELDS[head] + e.param[len(head):]
    message = e.message.replace(f"{e.param}:", f"{name}:", 1)
    return APIError(e.status, message, name, e.type, e.code, e.headers)


def _text(blocks: list[TextBlock] | None) -> str:
    return "\n".join(b.text for b in blocks or [])


def _turns(body: CountTokensRequest) -> list[dict]:
    """The messages body's turns as chat messages; a block in the wrong turn, or a result
    of no earlier call, is a 400 naming it."""
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    called: set[str] = set()
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        last_assistant = i == len(body.messages) - 1 and m.role == "assistant"
        if not last_assistant and all(isinstance(b, TextBlock) and not b.text
                                      for b in m.content):  # as Anthropic's API refuses
            raise APIError(400, f"{where}: must not be empty (only a final assistant "
                           "message may be)", where)
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(m.content):
            wrong = (b.type in ("tool_use", "thinking", "redacted_thinking")
                     if m.role == "user" else b.type == "tool_result")
            if wrong:
                raise APIError(400, f"{where}.{j}.type: a {b.type} block cannot be in a "
                               f"{m.role} turn", f"{where}.{j}.type")
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ThinkingBlock):
                reasoning.append(b.thinking)
            elif isinstance(b, ToolUseBlock):
                called.add(b.id)
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, ToolResultBlock):
                if b.tool_use_id not in called:
                    raise APIError(400, f"{where}.{j}.tool_use_id: no earlier tool_use block "
                                   f"has the id {b.tool_use_id!r}", f"{where}.{j}.tool_use_id")
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        turn: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        if texts or reasoning or calls or not any(
                isinstance(b, ToolResultBlock) for b in m.content):
            out.append(turn)
    return out


def _tool_choice(choice: ToolChoice | None) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None \
        else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice.name: a choice of type tool names the tool",
                           "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat body a messages body asks for (a 400 names the messages body's field)."""
    messages = _turns(body)
    choice, parallel = _tool_choice(body.tool_choice)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in body.tools]
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    budget = body.thinking.budget_tokens if body.thinking is not None else None
    if (budget is not None and isinstance(body, MessagesRequest)
            and body.thinking.type == "enabled" and budget >= body.max_tokens):  # as Anthropic's
        raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens "
                       f"({body.max_tokens})", "thinking.budget_tokens")
    if body.thinking is not None and body.thinking.type != "adaptive":
        on = body.thinking.type == "enabled"
        chat["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    if messages[-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise messages_field(validation_error(e.errors())) from None
