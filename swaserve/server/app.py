"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics (and the tokenizer's routes, tokens.py). Every error leaves in OpenAI's shape
`{"error": {message, type, param, code}}`.

A request is validated whole before it is queued (protocol.py, then its sampling
parameters, then its length against the context), tokenized, rendered and compiled on
worker threads so that the event loop keeps answering, and admitted against the waiting
limit before any of that work. A failure of one request inside the engine reaches that
request only: a 5xx body, or in a stream an `{"error": ...}` event and then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.sampling.params import SamplingParams
from swaserve.server.adapter import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    as_api_error,
    sampling_params,
    schema_param,
)
from swaserve.server.async_engine import AsyncEngine, Delta, EngineError, Final
from swaserve.server.chat_template import GEMMA_END_OF_TURN, ChatTemplate, ChatTemplateError
from swaserve.server.errors import APIError, error_response, validation_error
from swaserve.server.guard import Guard
from swaserve.server.metrics import REJECT_REASONS, Metrics
from swaserve.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from swaserve.server.tokens import add_token_routes
from swaserve.server.tools import plan_tools, render_chat

log = logging.getLogger("swaserve")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2
_HEAD_CHARS_PER_TOKEN = 8  # a prompt's head this many characters a token long is tokenized first
_REJECTED = {400: "invalid", 404: "not_found", 413: "too_large"}


def create_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               public_paths: frozenset[str] = frozenset()) -> FastAPI:
    engine = aengine.engine
    tok = engine.tokenizer
    metrics = Metrics()
    aengine.metrics = metrics
    metrics.on_state(engine.stats())
    engine.grammars.warm_up()  # the grammar token table, built before the first request
    template = None
    if tok is not None:
        template = ChatTemplate(tok.chat_template, bos_token="", eos_token="")
    end_of_turn = tok.token_to_id(GEMMA_END_OF_TURN) if tok is not None and template.builtin else None
    app = FastAPI(title="swaserve", docs_url=None, redoc_url=None)
    max_len = engine.max_model_len

    def reject(e: APIError) -> JSONResponse:
        reason = _REJECTED.get(e.status) or (e.code if e.status == 503 else None)
        if reason is not None and reason in REJECT_REASONS:
            metrics.rejected.labels(reason).inc()
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return reject(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return reject(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return reject(APIError(e.status_code, str(e.detail), None, type_))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", None, "server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist (this server serves {model_name!r})",
                           "model", "not_found_error", "model_not_found")

    def admit() -> None:
        try:
            aengine.admit()
        except EngineError as e:
            raise APIError(503, e.message, None, "server_error", e.code,
                           headers={"Retry-After": "1"}) from e

    def check_length(ids: list[int], param: str, max_tokens: int | None) -> int:
        """The request's max_tokens once its prompt is known (the rest of the context when
        it gave none); a prompt or max_tokens the context cannot hold is a 400."""
        if not ids:
            raise APIError(400, f"{param}: must not be empty", param)
        if len(ids) >= max_len:
            raise APIError(400, f"{param}: {len(ids)} tokens leave no room for output within "
                           f"the context of {max_len} tokens", param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise APIError(400, f"max_tokens: {len(ids)} prompt tokens + max_tokens "
                           f"{max_tokens} exceed the context of {max_len} tokens; ask for at "
                           f"most {max_len - len(ids)}", "max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def encode(prompt: str | list[int], param: str, **kw) -> list[int]:
        """Token ids of a prompt (on a worker thread). A text is first tokenized by its head,
        so that a huge one that cannot fit is refused without tokenizing all of it."""
        if isinstance(prompt, str) and len(prompt) > _HEAD_CHARS_PER_TOKEN * max_len:
            head = _tokenize(engine, prompt[:_HEAD_CHARS_PER_TOKEN * max_len], param, **kw)
            if len(head) > max_len + 64:  # a cut changes only the last tokens
                raise APIError(400, f"{param}: more than {max_len} tokens (its first "
                               f"{_HEAD_CHARS_PER_TOKEN * max_len} characters alone are "
                               f"{len(head)}); the context holds {max_len}", param,
                               code="context_length_exceeded")
        return _tokenize(engine, prompt, param, **kw)

    async def prepare(params: SamplingParams, body, work: Callable[[], list[int]],
                      param: str, max_tokens: int | None, schema_from: str | None = None):
        """Admit a request, then tokenize it, fit it to the context and compile its grammar
        off the event loop; the admission is handed back if any of that fails."""
        admit()
        try:
            ids = await asyncio.to_thread(work)
            params.max_tokens = check_length(ids, param, max_tokens)
            if params.min_tokens > params.max_tokens:
                raise APIError(400, f"min_tokens: must be <= max_tokens ({params.max_tokens})",
                               "min_tokens")
            grammar = None
            if params.structured is not None:
                try:
                    grammar = await asyncio.to_thread(engine.compile_grammar, params)
                except ValueError as e:
                    raise as_api_error(e, schema_from or schema_param(body)) from e
        except BaseException:
            aengine.cancel_admission()
            raise
        return ids, grammar

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return error_response(503, f"the engine stopped: {aengine.dead}", None,
                                  "server_error", "engine_dead")
        return {"status": "shutting_down" if aengine.draining else "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "swaserve",
                                            "max_model_len": max_len}]}

    # -- completions and chat --------------------------------------------------------------
    async def respond(body, request: Request,
                      prepared: list[tuple[list[int], SamplingParams, object]],
                      fmt_class: type[ResponseFormat], num_logprobs: int | None, **fmt_kw):
        """Queue the request's prompts (each admitted and prepared) and answer with their
        choices: prompt k's completion i is choice k * n + i."""
        rid = f"{fmt_class.id_prefix}-{uuid.uuid4().hex}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        n = prepared[0][1].n
        fmt = fmt_class(rid, model_name, tok, n * len(prepared), num_logprobs, include_usage,
                        **fmt_kw)
        gens = [aengine.generate(ids, p, rid if len(prepared) == 1 else f"{rid}-p{k}", grammar)
                for k, (ids, p, grammar) in enumerate(prepared)]
        gen = gens[0] if len(gens) == 1 else _merged(gens, n)
        if body.stream:
            return await _stream(aengine, rid, gen, fmt)
        choices, final = await _collect(aengine, rid, gen, n * len(prepared), request)
        return fmt.response(choices, final)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
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
        params = sampling_params(body, body.max_tokens, body.logprobs, max_len,
                                 prompt_logprobs=body.logprobs if body.echo else None)
        prepared = []
        try:  # all or nothing: one bad prompt refuses the request
            for prompt in prompts:
                p = dataclasses.replace(params)  # max_tokens is fitted to each prompt
                ids, grammar = await prepare(p, body, lambda q=prompt: encode(q, "prompt"),
                                             "prompt", body.max_tokens)
                prepared.append((ids, p, grammar))
        except BaseException:
            for _ in prepared:
                aengine.cancel_admission()
            raise
        echo = None
        if body.echo:  # each prompt as given, or its token ids' text
            echo = [(q if isinstance(q, str) else
                     tok.decode(ids, skip_special_tokens=False) if tok is not None else "", ids)
                    for q, (ids, _, _) in zip(prompts, prepared)]
        return await respond(body, request, prepared, CompletionFormat, params.logprobs,
                             echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if template is None:
            raise APIError(400, "messages: this model has no tokenizer, so chat is unavailable",
                           "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        tools = plan_tools(body)
        params = sampling_params(body, max_tokens, n_lp, max_len)
        if tools is not None and tools.schema is not None:  # a required or named call
            params.json_schema = tools.schema
        if end_of_turn is not None:
            params.stop_token_ids = list(params.stop_token_ids or []) + [end_of_turn]
        messages = [m.model_dump(exclude_none=True) for m in body.messages]

        def render() -> list[int]:
            try:
                text = render_chat(template, messages, tools)
            except ChatTemplateError as e:
                raise APIError(400, str(e), "messages") from e
            bos = tok.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else None
            return encode(text, "messages",
                          add_special_tokens=not (bos and text.startswith(bos)))

        ids, grammar = await prepare(params, body, render, "messages", max_tokens,
                                     schema_param(body, tools=tools is not None))
        return await respond(body, request, [(ids, params, grammar)], ChatFormat, n_lp,
                             tools=tools)

    add_token_routes(app, engine, template, check_model)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes,
                       public_paths=public_paths,
                       on_reject=lambda reason: metrics.rejected.labels(reason).inc())
    return app


def _tokenize(engine, prompt: str | list[int], param: str, **kw) -> list[int]:
    try:
        if isinstance(prompt, str) and kw:
            return engine.tokenizer.encode(prompt, **kw)
        return engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e).replace("prompt:", f"{param}:", 1), param) from e


# Line breaks to Python's str.splitlines and httpx's iter_lines, not to SSE: JSON leaves
# them raw in strings, so a reader that splits on them would cut an event in two
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: dict) -> str:
    data = json.dumps(obj, ensure_ascii=False)
    return f"data: {data if data.isascii() else data.translate(_LINE_BREAKS)}\n\n"


def _api_error(e: EngineError) -> APIError:
    return APIError(e.status, e.message, e.param, e.type, e.code)


async def _merged(gens: list[AsyncIterator], n: int) -> AsyncIterator[Delta | Final]:
    """The events of several prompts' requests as one request's: prompt k's completion i
    becomes choice k * n + i, and one Final sums them. A failure of one fails the whole
    (the others are aborted when their iterators close)."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, gen: AsyncIterator) -> None:
        try:
            async for ev in gen:
                await inbox.put((k, ev))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            await inbox.put((k, e))

    tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(gens)]
    finals: list[Final | None] = [None] * len(gens)
    try:
        while any(f is None for f in finals):
            k, ev = await inbox.get()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Final):
                finals[k] = ev
                continue
            ev.index += k * n
            yield ev
        yield Final(sum(f.num_prompt_tokens for f in finals),
                    sum(f.num_cached_tokens for f in finals),
                    [c for f in finals for c in f.num_output_tokens])
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def _first_event(aengine: AsyncEngine, rid: str, gen: AsyncIterator):
    """Wait for the first event, so that errors raised at admission become HTTP errors. A
    handler that gives up here (its client left) aborts the request."""
    try:
        return await gen.__anext__()
    except EngineError as e:
        raise _api_error(e) from e
    except BaseException:
        aengine.abort(rid)
        raise


async def _stream(aengine: AsyncEngine, rid: str, gen: AsyncIterator,
                  fmt: ResponseFormat) -> StreamingResponse:
    first = await _first_event(aengine, rid, gen)

    async def sse():
        try:
            for obj in fmt.head():
                yield _sse(obj)
            ev = first
            while True:
                obj = fmt.chunk(ev)
                if obj is not None:
                    yield _sse(obj)
                if isinstance(ev, Final):
                    break
                try:
                    ev = await gen.__anext__()
                except StopAsyncIteration:
                    break
                except EngineError as e:  # the request failed: say so, never just stop
                    log.warning("stream %s failed: %s", rid, e.message)
                    yield _sse(_api_error(e).body())
                    break
            yield "data: [DONE]\n\n"
        finally:  # a client that disconnects aborts its request and frees its memory
            await gen.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream")


async def _collect(aengine: AsyncEngine, rid: str, gen: AsyncIterator, n: int,
                   request: Request) -> tuple[list[Delta], Final]:
    """The whole output of a non-streaming request; aborted if its client goes away."""

    async def gather() -> tuple[list[Delta], Final]:
        merged = [Delta(i, "", [], []) for i in range(n)]
        ev = await _first_event(aengine, rid, gen)
        try:
            while not isinstance(ev, Final):
                m = merged[ev.index]
                m.text += ev.text
                m.token_ids += ev.token_ids
                m.logprobs += ev.logprobs
                if ev.prompt_logprobs is not None:
                    m.prompt_logprobs = ev.prompt_logprobs
                if ev.finish_reason:
                    m.finish_reason, m.stop_reason = ev.finish_reason, ev.stop_reason
                ev = await gen.__anext__()
            return merged, ev
        except EngineError as e:
            raise _api_error(e) from e
        except StopAsyncIteration:
            raise APIError(503, "the request was aborted", None, "server_error") from None
        finally:
            await gen.aclose()

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left: stop generating for it
            work.cancel()
            aengine.abort(rid)
    if work.cancelled():
        raise APIError(499, "the client closed the request", None, "invalid_request_error")
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


