"""A chat request's prompt: its messages, tools and template fields rendered by the chat
template, then tokenized. /v1/chat/completions and /tokenize (with `messages`) both build
it here, so /tokenize returns exactly the ids a chat would be prompted with.

Template variables, later ones winning: the tokenizer's special tokens, the server's
`--default-chat-template-kwargs`, the request's `chat_template_kwargs`, its
`reasoning_effort` (as the variable `reasoning_effort`, which gpt-oss's template reads).

The render walks the data recursively, so a message (tool-call arguments included, once
parsed), a document or a template variable nesting deeper than MAX_NESTING levels is a 400;
and a chat whose text (messages, tools, documents, variables) is longer than the context can
hold (bounds.py) is a 400 before it is rendered.
"""

from __future__ import annotations

from typing import Any

from swaserve.chat.template import ChatTemplateError
from swaserve.chat.tools import ToolPlan, template_messages
from swaserve.sampling.json_bounds import json_excess
from swaserve.server.bounds import check_chars, text_chars
from swaserve.server.errors import APIError
from swaserve.server.state import AppState

MAX_NESTING = 128


def _check_nesting(value: Any, param: str) -> None:
    if json_excess(value, MAX_NESTING) is not None:
        raise APIError(400, f"{param}: nests deeper than {MAX_NESTING} levels", param)


def template_kwargs(state: AppState, body) -> dict[str, Any]:
    """The template variables a request sets, over the server's defaults."""
    kwargs = dict(state.template_kwargs)
    kwargs.update(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    return kwargs


def chat_prompt(state: AppState, body, plan: ToolPlan | None) -> str:
    """The prompt text of a chat body (a ChatCompletionRequest or a TokenizeRequest with
    messages); a 400 names the field at fault."""
    template = state.template
    if template is None:
        raise APIError(400, "messages: this model has no tokenizer, so chat is unavailable",
                       "messages")
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(400, "continue_final_message: needs add_generation_prompt "
                           "false (one continues the last message, the other starts a new "
                           "one)", "continue_final_message")
        if body.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message: the last message must be the "
                           "assistant's, to be continued", "continue_final_message")
    if body.chat_template is not None and body.chat_template not in template.sources:
        raise APIError(400, "chat_template: must name one of the model's chat templates "
                       f"({sorted(template.sources)}); a template's text is not accepted",
                       "chat_template")
    messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages],
                                 plan, template.builtin)
    for i, m in enumerate(messages):
        _check_nesting(m, f"messages.{i}")
    _check_nesting(body.chat_template_kwargs or {}, "chat_template_kwargs")
    _check_nesting(body.documents or [], "documents")
    specs = plan.specs if plan is not None and not template.builtin else None
    # what the template can write into the prompt, bounded before it renders one string
    check_chars(state.tokenizer, text_chars([messages, body.chat_template_kwargs,
                                             body.documents, specs]),
                state.max_model_len, "messages")
    try:
        text = template.render(messages, tools=specs, documents=body.documents,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               kwargs=template_kwargs(state, body), name=body.chat_template)
        text.encode("utf-8")
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.param) from e
    except UnicodeEncodeError:  # a lone surrogate in a field the checks do not reach
        raise APIError(400, "messages: the rendered chat is not valid Unicode text (a "
                       "field holds a lone surrogate escape)", "messages") from None
    return text
