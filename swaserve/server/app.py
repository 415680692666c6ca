"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics. Every error leaves in OpenAI's shape `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.sampling.params import SamplingParams
from swaserve.server.async_engine import AsyncEngine, Delta, EngineError, Final
from swaserve.server.chat_template import GEMMA_END_OF_TURN, ChatTemplate, ChatTemplateError
from swaserve.server.metrics import Metrics
from swaserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("swaserve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _param_of(e: ValueError) -> str | None:
    head = str(e).split(":", 1)[0]
    return head if head.isidentifier() else None


def _sampling_params(body, max_tokens: int | None, logprobs: int | None, engine) -> SamplingParams:
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k",
                 "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens"):
        v = getattr(body, name)
        if v is not None:
            kw[name] = v
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.logit_bias is not None:
        kw["logit_bias"] = body.logit_bias
    if max_tokens is None:
        max_tokens = engine.max_model_len
    kw.update(_structured_output(body))
    try:
        p = SamplingParams(n=body.n, max_tokens=max_tokens, logprobs=logprobs, **kw)
        p.validate(engine.vocab_size)
    except ValueError as e:
        raise _as_api_error(e, body) from e
    return p


def _as_api_error(e: ValueError, body) -> APIError:
    """400 naming the parameter; a schema that came in response_format is named so."""
    msg, param = str(e), _param_of(e)
    if param == "json_schema" and body.response_format is not None:
        msg, param = "response_format" + msg[len("json_schema"):], "response_format"
    return APIError(400, msg, param)


def _structured_output(body) -> dict[str, Any]:
    """SamplingParams fields for response_format and the vLLM / SGLang extra fields."""
    out: dict[str, Any] = {}
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            out["json_object"] = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise APIError(400, "response_format: json_schema needs a 'schema' object",
                               "response_format")
            out["json_schema"] = spec["schema"]
        elif kind != "text":
            raise APIError(400, f"response_format: type must be text, json_object or "
                           f"json_schema, got {kind!r}", "response_format")
    for names, field in ((("json_schema", "guided_json"), "json_schema"),
                         (("regex", "guided_regex"), "regex"),
                         (("ebnf", "grammar", "guided_grammar"), "grammar")):
        for name in names:
            v = getattr(body, name)
            if v is None:
                continue
            if out:
                raise APIError(400, f"{name}: only one kind of structured output per request",
                               name)
            out[field] = v
    return out


async def _compile_grammar(engine, params: SamplingParams, body):
    """Compile off the event loop and the engine loop; a bad grammar is a 400 here."""
    if params.structured is None:
        return None
    try:
        return await asyncio.to_thread(engine.compile_grammar, params)
    except ValueError as e:
        raise _as_api_error(e, body) from e


def _usage(final: Final) -> dict:
    completion = sum(final.num_output_tokens)
    return {"prompt_tokens": final.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": final.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


def create_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    engine = aengine.engine
    tok = engine.tokenizer
    metrics = Metrics()
    aengine.metrics = metrics
    engine.grammars.warm_up()  # the grammar token table, built before the first request
    template = None
    if tok is not None:
        template = ChatTemplate(tok.chat_template, bos_token="", eos_token="")
    end_of_turn = tok.token_to_id(GEMMA_END_OF_TURN) if tok is not None and template.builtin else None
    app = FastAPI(title="swaserve", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request body"
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), None, type_)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", None, "server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid or missing API key", None,
                                      "authentication_error", "invalid_api_key")
        return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist (this server serves {model_name!r})",
                           "model", "not_found_error", "model_not_found")

    def check_capacity() -> None:
        if aengine.overloaded():
            raise APIError(503, "the server is overloaded: too many waiting requests",
                           None, "server_error", "overloaded", headers={"Retry-After": "1"})

    def check_length(ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param}: must not be empty", param)
        if len(ids) >= engine.max_model_len:
            raise APIError(400, f"{param}: {len(ids)} tokens leave no room for output within "
                           f"the context of {engine.max_model_len} tokens", param,
                           code="context_length_exceeded")

    def encode(prompt: str | list[int], param: str) -> list[int]:
        try:
            return engine.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e).replace("prompt:", f"{param}:", 1), param) from e

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "swaserve",
                                            "max_model_len": engine.max_model_len}]}

    # -- completions -----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo or body.suffix is not None or (body.best_of not in (None, 1, body.n)):
            param = "echo" if body.echo else "suffix" if body.suffix is not None else "best_of"
            raise APIError(400, f"{param}: not supported", param)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if len(prompts) != 1:
            raise APIError(400, "prompt: batches of prompts are not supported; send one per request", "prompt")
        ids = encode(prompts[0], "prompt")
        check_length(ids, "prompt")
        params = _sampling_params(body, body.max_tokens, body.logprobs, engine)
        grammar = await _compile_grammar(engine, params, body)
        check_capacity()
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = aengine.generate(ids, params, rid, grammar)
        created = int(time.time())

        def choice(d: Delta) -> dict:
            return {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                    "logprobs": (_completion_logprobs(tok, d, params.logprobs)
                                 if params.logprobs is not None else None)}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await _first_event(gen)

            async def sse():
                try:
                    async for ev in _chain(first, gen):
                        if isinstance(ev, Final):
                            if include_usage:
                                yield _sse({"id": rid, "object": "text_completion",
                                            "created": created, "model": model_name,
                                            "choices": [], "usage": _usage(ev)})
                            break
                        yield _sse({"id": rid, "object": "text_completion", "created": created,
                                    "model": model_name, "choices": [choice(ev)]})
                    yield "data: [DONE]\n\n"
                finally:  # a client that disconnects aborts its request and frees its memory
                    await gen.aclose()

            return StreamingResponse(sse(), media_type="text/event-stream")
        choices, final = await _collect(gen, params.n)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice(c) for c in choices], "usage": _usage(final)}

    # -- chat ------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if template is None:
            raise APIError(400, "messages: this model has no tokenizer, so chat is unavailable",
                           "messages")
        try:
            text = template.render([m.model_dump() for m in body.messages])
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from e
        bos = tok.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else None
        ids = tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
        check_length(ids, "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling_params(body, max_tokens, n_lp, engine)
        if end_of_turn is not None:
            params.stop_token_ids = list(params.stop_token_ids or []) + [end_of_turn]
        grammar = await _compile_grammar(engine, params, body)
        check_capacity()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = aengine.generate(ids, params, rid, grammar)
        created = int(time.time())

        def lp(d: Delta) -> dict | None:
            return _chat_logprobs(tok, d, body.top_logprobs or 0) if body.logprobs else None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await _first_event(gen)

            async def sse():
                try:
                    async for chunk in chat_chunks():
                        yield chunk
                finally:  # a client that disconnects aborts its request and frees its memory
                    await gen.aclose()

            async def chat_chunks():
                for i in range(params.n):
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model_name, "choices": [{"index": i, "delta": {
                                    "role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]})
                async for ev in _chain(first, gen):
                    if isinstance(ev, Final):
                        if include_usage:
                            yield _sse({"id": rid, "object": "chat.completion.chunk",
                                        "created": created, "model": model_name, "choices": [],
                                        "usage": _usage(ev)})
                        break
                    delta = {"content": ev.text} if ev.text or not ev.finish_reason else {}
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model_name, "choices": [{
                                    "index": ev.index, "delta": delta, "logprobs": lp(ev),
                                    "finish_reason": ev.finish_reason}]})
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        choices, final = await _collect(gen, params.n)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": lp(c), "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason} for c in choices],
                "usage": _usage(final)}

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _first_event(gen):
    """Wait for the first event so that errors raised at admission become HTTP errors."""
    try:
        return await gen.__anext__()
    except ValueError as e:
        raise APIError(400, str(e), _param_of(e)) from e
    except EngineError as e:
        raise APIError(503, str(e), None, "server_error") from e


async def _chain(first, gen):
    yield first
    try:
        async for ev in gen:
            yield ev
    except EngineError as e:
        log.warning("stream ended early: %s", e)


async def _collect(gen, n: int) -> tuple[list[Delta], Final]:
    merged = [Delta(i, "", [], []) for i in range(n)]
    first = await _first_event(gen)
    try:
        async for ev in _chain(first, gen):
            if isinstance(ev, Final):
                return merged, ev
            m = merged[ev.index]
            m.text += ev.text
            m.token_ids += ev.token_ids
            m.logprobs += ev.logprobs
            if ev.finish_reason:
                m.finish_reason, m.stop_reason = ev.finish_reason, ev.stop_reason
    finally:
        await gen.aclose()
    raise APIError(503, "the request was aborted", None, "server_error")


def _tok_str(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)


def _completion_logprobs(tok, d: Delta, n: int) -> dict:
    tokens, token_lps, tops = [], [], []
    for t, entry in zip(d.token_ids, d.logprobs):
        tokens.append(_tok_str(tok, t))
        token_lps.append(entry.get(t))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        tops.append({_tok_str(tok, k): v for k, v in best})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": []}


def _chat_logprobs(tok, d: Delta, n: int) -> dict:
    content = []
    for t, entry in zip(d.token_ids, d.logprobs):
        s = _tok_str(tok, t)
        alts = sorted(entry.items(), key=lambda kv: -kv[1])[:n] if n else []
        content.append({"token": s, "logprob": entry.get(t), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _tok_str(tok, k), "logprob": v,
                                          "bytes": list(_tok_str(tok, k).encode())} for k, v in alts]})
    return {"content": content}
