"""OpenAI Responses request bodies (pydantic): the top-level fields of `/v1/responses`, and
one model per kind of input item and tool, which input.py checks each item
against by its `type` (so that a 400 names `input.2.call_id`, not a union member).

The shared field types (Text, Number, ...) are openai/protocol.py's: the same strictness as chat.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swaserve.server.openai.protocol import Flag, Integer, JSONObject, Number, Text, _utf8


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextContent(_Item):
    """A text part of a message: `input_text` (user, system, developer) or `output_text`
    (an assistant's earlier answer); a `refusal` part carries its text as `refusal`."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: Text | None = None
    refusal: Text | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[dict[str, Any]]
    id: Text | None = None
    status: Text | None = None


class FunctionCallItem(_Item):
    """A call the model made earlier, sent back so the model sees it."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Item):
    """The result of an earlier call: `output` as text, or a list of text parts."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[dict[str, Any]]
    id: Text | None = None
    status: Text | None = None


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Item):
    """The model's earlier reasoning: its `content` text, else its `summary`."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None


ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                 "function_call_output": FunctionCallOutputItem,
                                 "reasoning": ReasoningItem}


class FunctionTool(_Item):
    type: Literal["function"]
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: Flag | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: Text


class TextFormat(_Item):
    """`text.format`: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: Flag | None = None
    description: Text | None = None


class TextConfig(_Item):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Item):
    effort: Literal["low", "medium", "high"] | None = None
    summary: Text | None = None
    generate_summary: Text | None = None


class ResponsesRequest(BaseModel):
    """A `/v1/responses` body. `input` and `tools` are checked item by item
    (input.py); the extra sampling fields of chat (top_k, seed, stop, ...) and
    `chat_template_kwargs` are passed through to the chat request."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Any
    instructions: Text | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Flag | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[Integer, Field(ge=1)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    metadata: Annotated[dict[Text, Text], Field(max_length=16)] | None = None
    user: Text | None = None
    stream: Flag = False
    store: Flag | None = None
    previous_response_id: Text | None = None
    include: list[Text] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: Flag | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):
            return _utf8(v)
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of items")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():  # OpenAI's limits
            if len(key) > 64:
                raise ValueError(f"key {key[:16]!r}... is longer than 64 characters")
            if len(value) > 512:
                raise ValueError(f"the value of {key!r} is longer than 512 characters")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
            return FunctionChoice.model_validate(v)
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": '
                         "...} (built-in tools are not supported)")
