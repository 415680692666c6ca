"""The chat path every surface shares: a chat body's tool plan, its prompt rendered and
admitted, and how its output is constrained and read (`ChatOutput`). /v1/chat/completions,
Responses and Anthropic Messages all map their bodies to a `ChatCompletionRequest` and call
`prepare_chat`, then write the output parser's events in their own shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from swaserve.chat.events import OutputParser
from swaserve.chat.grammar import answer_grammar
from swaserve.chat.registry import make_output_parser
from swaserve.chat.setup import starts_with_bos
from swaserve.chat.tools import NO_ARGUMENTS, ToolPlan
from swaserve.sampling.json_bounds import check_schema_size
from swaserve.sampling.params import SamplingParams
from swaserve.server.chat_prompt import chat_prompt
from swaserve.server.errors import APIError
from swaserve.server.lifecycle import Prepared, encode, prepare
from swaserve.server.openai.adapter import sampling_params, schema_param
from swaserve.server.openai.protocol import ChatCompletionRequest
from swaserve.server.state import AppState


def plan_tools(body) -> ToolPlan | None:
    """The request's tool plan, or None for a plain chat. A 400 names what is wrong."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, "tool_choice: needs tools", "tool_choice")
    params: dict[str, dict] = {}
    for i, t in enumerate(tools):
        if t.function.name in params:
            raise APIError(400, f"tools: the function name {t.function.name!r} is used twice",
                           "tools")
        params[t.function.name] = t.function.parameters or NO_ARGUMENTS
        where = f"tools.{i}.function.parameters"
        try:  # the template writes it and a call's grammar compiles it: bounded before both
            check_schema_size(params[t.function.name], where)
        except ValueError as e:
            raise APIError(400, str(e), where) from None
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        return ToolPlan("auto", params, specs)
    fmt = getattr(body, "response_format", None) or {}  # /tokenize bodies have none
    if fmt.get("type") not in (None, "text") or any(
            getattr(body, f, None) is not None for f in ("json_schema", "guided_json", "regex",
                                                    "guided_regex", "ebnf", "grammar",
                                                    "guided_grammar")):
        raise APIError(400, "tool_choice: a required or named tool call is already "
                       "constrained; it cannot be combined with structured output",
                       "tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n, p in params.items()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolPlan("required", params, specs, schema=schema)
    name = choice.function.name
    if name not in params:
        raise APIError(400, f"tool_choice: function {name!r} is not among the tools",
                       "tool_choice")
    return ToolPlan("named", params, specs, name=name, schema=params[name])



class ChatOutput:
    """How one chat request's output is constrained and read, decided once its prompt is
    rendered (its end says whether the output starts inside reasoning): a required or named
    call, or a JSON answer after reasoning (or a call, with tools on offer), in the family's
    own format (chat/grammar.py), else the constraint as given; and the output parser of
    each choice (chat/registry.py)."""

    def __init__(self, state: AppState, body, plan: ToolPlan | None, params: SamplingParams):
        self.tok, self.plan, self.params = state.tokenizer, plan, params
        self.reasoning, self.tools = state.reasoning_parser, state.tool_parser
        template = state.template
        self.template = ("" if template is None or template.builtin
                         else template.source_for(plan is not None))
        self.json_bounds = state.engine.config.json_bounds
        self.parallel = body.parallel_tool_calls is not False
        self.prompt = ""
        self.family_call = False  # a required / named call in the family's syntax
        if plan is not None and plan.schema is not None:
            params.json_schema = plan.schema  # bare JSON, unless the family's syntax has a grammar

    def prompted(self, prompt: str) -> None:
        """The rendered prompt: the constraint in the family's format, where it has one."""
        self.prompt = prompt
        p, plan = self.params, self.plan
        schema = None
        if plan is None or plan.mode == "auto":  # a named or required call has its schema
            schema = {"type": "object"} if p.json_object else p.json_schema
        grammar = answer_grammar(self.tok, reasoning=self.reasoning, tools=self.tools,
                                 template=self.template, prompt=prompt, plan=plan,
                                 schema=schema, json_bounds=self.json_bounds)
        if grammar is not None:
            p.json_schema, p.json_object, p.grammar = None, False, grammar
            self.family_call = plan is not None and plan.mode != "auto"

    def parser(self) -> Callable[[], OutputParser] | None:
        """A maker of each choice's output parser; None where the text is the answer as it
        is (no reasoning format, no calls to read) or a bare-JSON call (chat/tools.py reads it)."""
        plan = self.plan
        if plan is not None and plan.mode != "auto" and not self.family_call:
            return None
        calls = plan is not None and self.tools is not None
        if self.reasoning is None and not calls:
            return None
        names = None
        if calls:
            names = (plan.parameters if plan.mode != "named"
                     else {plan.name: plan.parameters[plan.name]})
        return lambda: make_output_parser(
            self.tok, reasoning=self.reasoning, tools=self.tools if calls else None,
            tool_names=names, parallel_tool_calls=self.parallel, prompt=self.prompt)


class PreparedChat(NamedTuple):
    """A chat admitted and ready to queue: its prompt, how its output is constrained and
    read (`output.parser()`), its tool plan and how many top logprobs it asks for."""

    prepared: Prepared
    output: ChatOutput
    tools: ToolPlan | None
    num_logprobs: int | None


async def prepare_chat(state: AppState, body: ChatCompletionRequest) -> PreparedChat:
    """A chat body checked, rendered through the chat template, tokenized and admitted:
    what every surface built on chat (Responses, Anthropic Messages) shares with
    /v1/chat/completions. A 400 names the field at fault."""
    state.check_model(body.model)
    if state.template is None:
        raise APIError(400, "messages: this model has no tokenizer, so chat is unavailable",
                       "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                  else body.max_tokens)
    tools = plan_tools(body)
    params = sampling_params(body, max_tokens, n_lp, state.max_model_len)
    if state.end_of_turn is not None:
        params.stop_token_ids = list(params.stop_token_ids or []) + [state.end_of_turn]
    output = ChatOutput(state, body, tools, params)

    def render() -> list[int]:
        text = chat_prompt(state, body, tools)
        output.prompted(text)
        return encode(state, text, "messages",
                      add_special_tokens=not starts_with_bos(state.tokenizer, text))

    prepared = await prepare(state, params, render, "messages", max_tokens,
                             schema_param(body, tools=tools is not None))
    return PreparedChat(prepared, output, tools, n_lp)
