"""The lifecycle every generation route shares, whatever API surface it answers in.

A route validates its body, maps it to `SamplingParams` and a prompt (a function that
renders and tokenizes it, run on a worker thread), and then:

    prepared = await prepare(state, params, work, "messages", max_tokens, schema_from)
    return await answer(state, request, [prepared], fmt, stream)

`prepare` admits the request against the waiting limit (a 503 when full) before any work,
tokenizes it off the event loop, fits `max_tokens` to the context and compiles its grammar;
the admission is handed back if any of that fails. `answer` queues the prompts and either
streams their events as server-sent events or collects the whole answer; a client that
leaves aborts its request, and a failure inside the engine reaches that request only: an
`APIError`, or in a stream the format's error event and then its end.

`fmt` (an `AnswerFormat`) is where a surface writes the engine's events in its own shape:
OpenAI's completions and chat (adapter.py), or any other surface's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from swaserve.sampling.grammar import CompiledGrammar
from swaserve.sampling.params import SamplingParams
from swaserve.server.async_engine import AsyncEngine
from swaserve.server.bounds import check_text
from swaserve.server.errors import APIError, as_api_error
from swaserve.server.events import Delta, EngineError, Final
from swaserve.server.state import AppState

T = TypeVar("T")

log = logging.getLogger("swaserve")
_HEAD_CHARS_PER_TOKEN = 8  # a prompt's head this many characters a token long is tokenized first


class AnswerFormat(Protocol):
    """How one API surface writes a generation's answer. `id` is the request's id; a stream
    sends `head()`, then `chunk(ev)` of every event (None: nothing to send yet), framed by
    `event`, and ends with `done` (when not empty); a failure mid-stream is sent as
    `error(e)`. A whole answer is `response(choices, final)`."""

    id: str
    done: str

    def head(self) -> list[dict]: ...

    def chunk(self, ev: Delta | Final) -> dict | None: ...

    def response(self, choices: list[Delta], final: Final) -> dict: ...

    def error(self, e: APIError) -> dict: ...

    def event(self, obj: dict) -> str: ...


class Prepared(NamedTuple):
    """One prompt ready to queue: its ids, its parameters (max_tokens fitted), its grammar."""

    ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None


# -- before the engine: admission, tokens, the context -----------------------------------------

def admit(state: AppState) -> None:
    try:
        state.aengine.admit()
    except EngineError as e:
        raise APIError(503, e.message, None, "server_error", e.code,
                       headers={"Retry-After": "1"}) from e


def check_length(state: AppState, ids: list[int], param: str, max_tokens: int | None) -> int:
    """The request's max_tokens once its prompt is known (the rest of the context when it
    gave none); a prompt or max_tokens the context cannot hold is a 400."""
    max_len = state.max_model_len
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


def encode(state: AppState, prompt: str | list[int], param: str, **kw) -> list[int]:
    """Token ids of a prompt (on a worker thread). A text longer than the context's tokens
    can cover is refused untokenized (bounds.py); a long one is first tokenized by its
    head, so that most that cannot fit are refused without tokenizing all of it."""
    max_len = state.max_model_len
    if isinstance(prompt, str) and state.tokenizer is not None:
        check_text(state.tokenizer, prompt, max_len, param)
    if isinstance(prompt, str) and len(prompt) > _HEAD_CHARS_PER_TOKEN * max_len:
        head = _tokenize(state.engine, prompt[:_HEAD_CHARS_PER_TOKEN * max_len], param, **kw)
        if len(head) > max_len + 64:  # a cut changes only the last tokens
            raise APIError(400, f"{param}: more than {max_len} tokens (its first "
                           f"{_HEAD_CHARS_PER_TOKEN * max_len} characters alone are "
                           f"{len(head)}); the context holds {max_len}", param,
                           code="context_length_exceeded")
    return _tokenize(state.engine, prompt, param, **kw)


def _tokenize(engine, prompt: str | list[int], param: str, **kw) -> list[int]:
    try:
        if isinstance(prompt, str) and kw:
            return engine.tokenizer.encode(prompt, **kw)
        return engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e).replace("prompt:", f"{param}:", 1), param) from e


async def prepare(state: AppState, params: SamplingParams, work: Callable[[], list[int]],
                  param: str, max_tokens: int | None, schema_from: str | None) -> Prepared:
    """Admit a request, then tokenize it (`work`), fit it to the context and compile its
    grammar off the event loop; the admission is handed back if any of that fails.
    `schema_from` names the field a bad schema came from (None: json_schema)."""
    admit(state)
    try:
        ids = await asyncio.to_thread(work)
        params.max_tokens = check_length(state, ids, param, max_tokens)
        if params.min_tokens > params.max_tokens:
            raise APIError(400, f"min_tokens: must be <= max_tokens ({params.max_tokens})",
                           "min_tokens")
        grammar = None
        if params.structured is not None:
            try:
                grammar = await asyncio.to_thread(state.engine.compile_grammar, params)
            except ValueError as e:
                raise as_api_error(e, schema_from) from e
    except BaseException:
        state.aengine.cancel_admission()
        raise
    return Prepared(ids, params, grammar)


async def prepare_all(state: AppState, params: SamplingParams,
                      works: list[Callable[[], list[int]]], param: str,
                      max_tokens: int | None, schema_from: str | None) -> list[Prepared]:
    """`prepare` for each of a request's prompts, each with its own copy of `params`: all or
    nothing, one bad prompt refuses the request and hands back every admission."""
    prepared: list[Prepared] = []
    try:
        for work in works:
            p = dataclasses.replace(params)  # max_tokens is fitted to each prompt
            prepared.append(await prepare(state, p, work, param, max_tokens, schema_from))
    except BaseException:
        for _ in prepared:
            state.aengine.cancel_admission()
        raise
    return prepared


# -- in the engine: queue, then stream or collect ----------------------------------------------

async def answer(state: AppState, request: Request, prepared: list[Prepared],
                 fmt: AnswerFormat, stream: bool) -> StreamingResponse | dict:
    """Queue the prepared prompts as one request and answer with their choices: prompt k's
    completion i is choice k * n + i. A stream is a StreamingResponse of fmt's events,
    else fmt's whole response."""
    aengine, rid, n = state.aengine, fmt.id, prepared[0].params.n
    gens = [aengine.generate(p.ids, p.params, rid if len(prepared) == 1 else f"{rid}-p{k}",
                             p.grammar)
            for k, p in enumerate(prepared)]
    gen = gens[0] if len(gens) == 1 else _merged(gens, n)
    if stream:
        return await _stream(aengine, rid, gen, fmt, request)
    choices, final = await _collect(aengine, rid, gen, n * len(prepared), request)
    return fmt.response(choices, final)


# Line breaks to Python's str.splitlines and httpx's iter_lines, not to SSE: JSON leaves
# them raw in strings, so a reader that splits on them would cut an event in two
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict) -> str:
    """One server-sent event of a JSON object: a `data:` line."""
    data = json.dumps(obj, ensure_ascii=False)
    return f"data: {data if data.isascii() else data.translate(_LINE_BREAKS)}\n\n"


def api_error(e: EngineError) -> APIError:
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
        raise api_error(e) from e
    except BaseException:
        aengine.abort(rid)
        raise


async def _stream(aengine: AsyncEngine, rid: str, gen: AsyncIterator,
                  fmt: AnswerFormat, request: Request) -> StreamingResponse:
    # the first event comes after the prefill: a client that leaves before it stops it
    first = await while_connected(request, _first_event(aengine, rid, gen),
                                  lambda: aengine.abort(rid))

    async def events():
        try:
            for obj in fmt.head():
                yield fmt.event(obj)
            ev = first
            while True:
                obj = fmt.chunk(ev)
                if obj is not None:
                    yield fmt.event(obj)
                if isinstance(ev, Final):
                    break
                try:
                    ev = await gen.__anext__()
                except StopAsyncIteration:
                    break
                except EngineError as e:  # the request failed: say so, never just stop
                    log.warning("stream %s failed: %s", rid, e.message)
                    yield fmt.event(fmt.error(api_error(e)))
                    break
            if fmt.done:
                yield fmt.done
        finally:  # a client that disconnects aborts its request and frees its memory
            await gen.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


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
            raise api_error(e) from e
        except StopAsyncIteration:
            raise APIError(503, "the request was aborted", None, "server_error") from None
        finally:
            await gen.aclose()

    return await while_connected(request, gather(), lambda: aengine.abort(rid))


async def while_connected(request: Request, work: Awaitable[T], on_gone: Callable[[], None]
                          ) -> T:
    """`work`'s result, or a 499 when the client disconnects first; `on_gone` then frees
    what the request holds in the engine (it runs too when the handler is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left: stop working for it
            task.cancel()
            on_gone()
    if task.cancelling() or task.cancelled():  # cancelled above: it ends on its next turn
        raise APIError(499, "the client closed the request", None, "invalid_request_error")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
