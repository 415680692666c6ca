"""OpenAI's API surface: /v1/models (and one model's object), /v1/completions and /v1/chat/completions. Each route
checks what only its body can get wrong, maps the body to `SamplingParams` and a prompt
(adapter.py), and leaves the rest to the shared lifecycle (lifecycle.py); its answer is
written by adapter.py's formats."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from swaserve.server.chat_path import prepare_chat
from swaserve.server.errors import APIError
from swaserve.server.lifecycle import Prepared, answer, encode, prepare_all
from swaserve.server.openai.adapter import (
    CompletionFormat,
    ResponseFormat,
    sampling_params,
    schema_param,
)
from swaserve.server.openai.chat import ChatFormat
from swaserve.server.openai.protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from swaserve.server.state import AppState


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(state, name) for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}")  # hub ids hold a slash: org/name
    async def model(model_id: str):
        state.check_model(model_id)
        return _model(state, model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _chat(state, body, request)


def _model(state: AppState, name: str) -> dict:
    """OpenAI's model object for one of the served names."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "swaserve",
            "max_model_len": state.max_model_len}


def _format(state: AppState, fmt_class: type[ResponseFormat], body, prepared: list[Prepared],
            num_logprobs: int | None, **kw) -> ResponseFormat:
    """The request's answer format: an id of its own, a choice per prompt and completion."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return fmt_class(f"{fmt_class.id_prefix}-{uuid.uuid4().hex}", state.model_name,
                     state.tokenizer, prepared[0].params.n * len(prepared), num_logprobs,
                     include_usage, **kw)


async def _completions(state: AppState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    if body.suffix is not None or (body.best_of not in (None, 1, body.n)):
        param = "suffix" if body.suffix is not None else "best_of"
        raise APIError(400, f"{param}: not supported", param)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: must be >= 1 (0 is for scoring a prompt, with "
                       "echo: true)", "max_tokens")
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not prompts or not all(prompts):
        raise APIError(400, "prompt: must not be empty", "prompt")
    if len(prompts) * body.n > MAX_N:
        raise APIError(400, f"prompt: {len(prompts)} prompts x n {body.n} is more than "
                       f"{MAX_N} choices", "prompt")
    params = sampling_params(body, body.max_tokens, body.logprobs, state.max_model_len,
                             prompt_logprobs=body.logprobs if body.echo else None)
    works = [lambda q=prompt: encode(state, q, "prompt") for prompt in prompts]
    prepared = await prepare_all(state, params, works, "prompt", body.max_tokens,
                                 schema_param(body))
    echo = None
    if body.echo:  # each prompt as given, or its token ids' text
        tok = state.tokenizer
        echo = [(q if isinstance(q, str) else
                 tok.decode(p.ids, skip_special_tokens=False) if tok is not None else "", p.ids)
                for q, p in zip(prompts, prepared)]
    fmt = _format(state, CompletionFormat, body, prepared, params.logprobs, echo=echo)
    return await answer(state, request, prepared, fmt, body.stream)


async def _chat(state: AppState, body: ChatCompletionRequest, request: Request):
    chat = await prepare_chat(state, body)
    fmt = _format(state, ChatFormat, body, [chat.prepared], chat.num_logprobs,
                  tools=chat.tools, parser=chat.output.parser(),
                  stop=chat.prepared.params.stop)
    return await answer(state, request, [chat.prepared], fmt, body.stream)
