"""/v1/embeddings in OpenAI's shape: `input` a string, a list of strings, token ids or a
list of them; `encoding_format` float or base64 (little-endian float32, as OpenAI's client
decodes it); `dimensions` shortens a Matryoshka embedding (its first values, L2-normalized
again) where the checkpoint is a sentence-transformers embedding model. The prompts run on
the engine thread between generation steps (engine/embedder.py); a client that leaves,
or a request past `--request-timeout`, drops its prompts not yet run. As OpenAI's API, a
request holds at most MAX_INPUTS inputs and MAX_TOKENS tokens; a text that cannot fit is
refused before it is tokenized (bounds.py)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import FastAPI, Request

from swaserve.models.encoder import truncate
from swaserve.server.bounds import check_chars, check_text
from swaserve.server.errors import APIError, as_api_error
from swaserve.server.events import EngineError
from swaserve.server.lifecycle import admit, api_error, while_connected
from swaserve.server.openai.protocol import EmbeddingRequest
from swaserve.server.state import AppState

MAX_INPUTS = 2048  # inputs in one request, as OpenAI's API allows
MAX_TOKENS = 300_000  # tokens of all inputs in one request, as OpenAI's API allows


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        state.check_model(body.model)
        embedder = state.engine.embedder
        if embedder is None:
            raise APIError(400, "model: embeddings are not available with tensor "
                           "parallelism or the mlx device", "model")
        prompts = _prompts(body.input)
        check_dimensions(body.dimensions, embedder.dimensions, embedder.pooler.matryoshka)
        if state.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise APIError(400, "input: this model has no tokenizer files; pass token ids",
                           "input")

        def work() -> list[list[int]]:
            check_texts(state, prompts, embedder.max_model_len)
            ids = [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
            embedder.check(ids)
            total = sum(len(p) for p in ids)
            if total > MAX_TOKENS:
                raise APIError(400, f"input: {total} tokens in all; a request may hold at "
                               f"most {MAX_TOKENS}", "input")
            return ids

        admit(state)
        try:
            try:
                ids = await asyncio.to_thread(work)
            except ValueError as e:
                raise as_api_error(e) from e
        except BaseException:
            state.aengine.cancel_admission()
            raise
        rid = f"embd-{uuid.uuid4().hex}"
        try:
            vectors = await while_connected(request, state.aengine.embed(ids, rid),
                                            lambda: state.aengine.abort(rid))
        except EngineError as e:
            raise api_error(e) from e
        if body.dimensions is not None and body.dimensions < embedder.dimensions:
            vectors = [truncate(v, body.dimensions) for v in vectors]
        tokens = sum(len(p) for p in ids)
        return {"object": "list", "model": state.model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def check_texts(state: AppState, prompts: list[str | list[int]], max_len: int) -> None:
    """A 400 naming `input` for a text longer than the context's tokens can cover, or texts
    longer together than MAX_TOKENS can (bounds.py): refused before any is tokenized."""
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:  # token ids alone: a model without a tokenizer takes them too
        return
    for p in texts:
        check_text(state.tokenizer, p, max_len, "input")
    check_chars(state.tokenizer, sum(len(p) for p in texts), MAX_TOKENS, "input",
                "a request's limit")


def _prompts(value) -> list[str | list[int]]:
    """The request's prompts; a 400 naming `input` for an empty one or more than
    MAX_INPUTS of them."""
    if isinstance(value, str):
        prompts = [value]
    elif value and all(isinstance(t, int) for t in value):
        prompts = [value]  # one prompt of token ids
    else:
        prompts = list(value)
    if not prompts:
        raise APIError(400, "input: must not be empty", "input")
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input: {len(prompts)} inputs; a request may hold at most "
                       f"{MAX_INPUTS}", "input")
    for i, p in enumerate(prompts):
        if not p:
            raise APIError(400, f"input: prompt {i} is empty", "input")
    return prompts


def check_dimensions(dimensions: int | None, size: int, matryoshka: bool) -> None:
    """A 400 naming `dimensions` where the model's vectors cannot be shortened to it."""
    if dimensions is None or dimensions == size:
        return
    if not matryoshka:
        raise APIError(400, "dimensions: this model's embeddings cannot be shortened (only a "
                       "sentence-transformers embedding model's can)", "dimensions")
    if dimensions > size:
        raise APIError(400, f"dimensions: {dimensions} is more than the model's {size}",
                       "dimensions")


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
