"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, on the chat path.

A messages body is mapped to a chat body (protocol.py), prepared as every chat
is (chat_path.py `prepare_chat`) and answered in Anthropic's shapes
(answer.py). Errors on these paths leave in Anthropic's shape (app.py
`_ERROR_BODIES`), with a 400 naming the messages body's field.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from swaserve.chat.setup import starts_with_bos
from swaserve.server.anthropic.answer import MessagesFormat
from swaserve.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    messages_field,
)
from swaserve.server.chat_path import plan_tools, prepare_chat
from swaserve.server.chat_prompt import chat_prompt
from swaserve.server.errors import APIError
from swaserve.server.lifecycle import answer, encode
from swaserve.server.state import AppState

PREFIX = "/v1/messages"


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        state.check_model(body.model)
        chat_body = chat_request(body)
        try:
            chat = await prepare_chat(state, chat_body)
        except APIError as e:
            raise messages_field(e) from e
        fmt = MessagesFormat(body.model, len(chat.prepared.ids), chat.output.parser(),
                             chat.tools, chat.prepared.params.stop)
        return await answer(state, request, [chat.prepared], fmt, body.stream)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        state.check_model(body.model)
        if state.template is None:
            raise APIError(400, "messages: this model has no tokenizer, so chat is "
                           "unavailable", "messages")
        chat_body = chat_request(body)

        def work() -> list[int]:  # the prompt a message of this body is sent, as /tokenize
            text = chat_prompt(state, chat_body, plan_tools(chat_body))
            return encode(state, text, "messages",
                          add_special_tokens=not starts_with_bos(state.tokenizer, text))

        try:
            ids = await asyncio.to_thread(work)
        except APIError as e:
            raise messages_field(e) from e
        return {"input_tokens": len(ids)}
