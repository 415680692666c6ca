"""OpenAI request bodies (pydantic), plus the extra sampling fields vLLM and SGLang accept.

Validation is strict at this boundary: numbers are numbers (not booleans or strings), text is
valid Unicode (no lone surrogate escapes), prompts are a string, token ids or one list of
either, and chat content is a string or a list of text parts. Limits follow OpenAI's: `n`
up to 128, `logprobs` / `top_logprobs` 0-20, seeds in 64 bits, up to 16 stop strings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from swaserve.sampling.params import MAX_LOGPROBS
from swaserve.server.bounds import json_problem

MAX_N = 128
MAX_STOP = 16


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate escape)") from None
    return s


def _utf8_json(v: Any) -> Any:
    """JSON data whose every key and string is valid Unicode (templates write it into the
    prompt, which must encode), nesting at most MAX_JSON_DEPTH levels: walked without
    recursion, so any depth the body parser accepts is a 400."""
    problem = json_problem(v)
    if problem is not None:
        raise ValueError(problem)
    return v


def _number(v: Any) -> Any:
    if isinstance(v, (bool, str)):
        raise ValueError("must be a number")
    return v


def _integer(v: Any) -> Any:
    if isinstance(v, (bool, str)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer")
    return v


Text = Annotated[str, Field(strict=True), AfterValidator(_utf8)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_utf8_json)]
Number = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
Integer = Annotated[int, BeforeValidator(_integer)]
Flag = Annotated[bool, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]


class StreamOptions(BaseModel):
    include_usage: Flag = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    n: Integer = Field(1, ge=1, le=MAX_N)
    stream: Flag = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    seed: Integer | None = None  # SamplingParams checks that it fits in 64 bits
    temperature: Number | None = None
    top_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[Text, Number] | None = None
    user: Text | None = None
    # extra body fields (vLLM / SGLang names)
    top_k: Integer | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: Integer | None = None
    ignore_eos: Flag | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: Flag | None = None
    speculative: Flag | None = None  # False: no draft tokens for this request
    # structured output: OpenAI's response_format, plus the extra fields vLLM (guided_*)
    # and SGLang (json_schema, regex, ebnf) accept
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | Text | None = None
    guided_json: dict[str, Any] | Text | None = None
    regex: Text | None = None
    guided_regex: Text | None = None
    ebnf: Text | None = None
    grammar: Text | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_Common):
    prompt: Prompt
    max_tokens: Integer | None = 16
    logprobs: Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Flag = False
    suffix: Text | None = None
    best_of: Integer | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:  # one message instead of one per member of the union
            if isinstance(v, str):
                raise ValueError("must be valid Unicode text (it holds a lone surrogate "
                                 "escape)") from None
            raise ValueError("must be a string, a list of token ids (integers >= 0), or a "
                             "list of one of them") from None


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body: `input` a string, token ids, or a list of either."""

    model_config = ConfigDict(extra="allow")

    input: Prompt
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[Integer, Field(ge=1)] | None = None
    user: Text | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:  # one message instead of one per member of the union
            raise ValueError("must be a string, a list of strings, a list of token ids "
                             "(integers >= 0), or a list of them") from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: JSONObject | None = None  # a JSON schema of the arguments object
    strict: Flag | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: the call it answers
    # an assistant turn's reasoning, under any of its names (templates get all of them)
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    thinking: Text | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, v, handler):
        try:
            return handler(v)
        except ValidationError as e:
            if isinstance(v, list):
                err = e.errors()[-1]
                where = [str(x) for x in err["loc"] if isinstance(x, int) or x in ("type", "text")]
                part = f"part {where[0]}" if where else "a part"
                field = where[1] if len(where) > 1 else "type"
                if field == "type":
                    raise ValueError(f"{part}: only text content parts "
                                     "({\"type\": \"text\", \"text\": ...}) are supported") from None
                raise ValueError(f"{part}: text must be a string of valid Unicode") from None
            raise ValueError("must be a string, null, or a list of text parts") from None


class _ChatTemplateFields(BaseModel):
    """How a chat is rendered by the chat template (vLLM's fields): `chat_template_kwargs`
    become template variables, `reasoning_effort` the variable `reasoning_effort`;
    `continue_final_message` leaves the last (assistant) message open instead of adding a
    generation prompt; `chat_template` names one of the model's templates."""

    chat_template: Text | None = None
    chat_template_kwargs: JSONObject | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    add_generation_prompt: Flag = True
    continue_final_message: Flag = False
    documents: list[JSONObject] | None = None


class ChatCompletionRequest(_Common, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    logprobs: Flag = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Flag | None = None


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a text (`prompt`) or a chat (`messages`, with the chat fields of
    /v1/chat/completions, rendered as a chat renders them). `add_special_tokens` unset:
    true for a text, and for a chat what a chat does."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Flag | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    tokens: list[TokenId]
