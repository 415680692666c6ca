"""OpenAI's Responses API, `/v1/responses`, built on the chat path: the body becomes a chat
request (input.py), which `prepare_chat` renders through the model's chat
template, constrains and admits as it does /v1/chat/completions; the answer is written as
a `response` object or its event stream (answer.py). Errors are in OpenAI's shape.

Store decision: no responses are kept. The openai-agents SDK sends the whole conversation
in `input` and leaves `store` and `previous_response_id` out unless told to, so keeping
nothing serves an agent run; `store` left out (OpenAI's default is true) is answered with
`store: false` in the response, while an explicit `store: true`, a `previous_response_id`
and `GET`/`DELETE /v1/responses/{id}` are refused (400, 404) with a message saying to send
the whole conversation in `input`. Nothing grows with traffic, and replicas need no
shared state.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from swaserve.server.chat_path import prepare_chat
from swaserve.server.errors import APIError
from swaserve.server.lifecycle import answer
from swaserve.server.responses.answer import ResponsesFormat, echoed
from swaserve.server.responses.input import chat_request, rename
from swaserve.server.responses.protocol import ResponsesRequest
from swaserve.server.state import AppState


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await _respond(state, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        raise _not_kept(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        raise _not_kept(response_id)


def _not_kept(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found: this server keeps no "
                    "responses", None, "not_found_error")


async def _respond(state: AppState, body: ResponsesRequest, request: Request):
    chat = chat_request(body)
    try:
        prepared = await prepare_chat(state, chat.body)
    except APIError as e:
        raise rename(e, chat.sources) from None
    fmt = ResponsesFormat(state.model_name, echoed(body, chat.body.model_dump(
        exclude_none=True).get("tools")), prepared.tools, prepared.output.parser())
    return await answer(state, request, [prepared.prepared], fmt, body.stream)
