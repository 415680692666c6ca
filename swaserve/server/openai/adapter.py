"""The OpenAI mapping, shared by completions and chat: a request body becomes
`SamplingParams`, and the engine's events become stream chunks and whole responses
(completions here; chat's answer in chat.py)."""

from __future__ import annotations

import time
from typing import Any

from swaserve.sampling.params import SamplingParams
from swaserve.server.errors import APIError, as_api_error
from swaserve.server.events import Delta, Final
from swaserve.server.lifecycle import sse
from swaserve.server.openai.logprobs import completion_logprobs

_PASSED_THROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                   "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop_token_ids", "skip_special_tokens", "logit_bias", "speculative")


def sampling_params(body, max_tokens: int | None, logprobs: int | None,
                    max_model_len: int, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams of a request body, validated once (its token ids are checked by the
    engine against the vocabulary); a bad value is a 400 naming it. `max_tokens` is fitted
    to the prompt once that is tokenized."""
    kw: dict[str, Any] = {name: getattr(body, name) for name in _PASSED_THROUGH
                          if getattr(body, name) is not None}
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    kw.update(structured_output(body))
    try:
        return SamplingParams(n=body.n, max_tokens=max_model_len if max_tokens is None
                              else max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **kw)
    except ValueError as e:
        raise as_api_error(e, schema_param(body)) from e


def schema_param(body, tools: bool = False) -> str | None:
    """Where a request's JSON schema came from, when not from a json_schema field."""
    return "tools" if tools else "response_format" if body.response_format is not None else None


def structured_output(body) -> dict[str, Any]:
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


def usage(final: Final) -> dict:
    completion = sum(final.num_output_tokens)
    return {"prompt_tokens": final.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": final.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


class ResponseFormat:
    """How one request's events are written (lifecycle.AnswerFormat): `head` (chunks before
    any output), `chunk` (one event, None for nothing to send), `response` (the whole,
    non-streaming answer); a stream is `data:` events ended by `[DONE]`."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    done = "data: [DONE]\n\n"
    event = staticmethod(sse)

    def __init__(self, request_id: str, model: str, tokenizer, n: int,
                 num_logprobs: int | None, include_usage: bool,
                 echo: list[tuple[str, list[int]]] | None = None):
        self.id, self.model, self.tok, self.n = request_id, model, tokenizer, n
        self.num_logprobs, self.include_usage = num_logprobs, include_usage
        # completions' echo: per prompt (text, ids), written before each of its choices
        self.echo = echo
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def head(self) -> list[dict]:
        return []

    def error(self, e: APIError) -> dict:
        return e.body()

    def chunk(self, ev: Delta | Final) -> dict | None:
        if isinstance(ev, Final):
            return {**self._envelope(self.chunk_object, []), "usage": usage(ev)} \
                if self.include_usage else None
        choice = self._chunk_choice(ev)  # None: nothing to send for this event yet
        return None if choice is None else self._envelope(self.chunk_object, [choice])

    def response(self, choices: list[Delta], final: Final) -> dict:
        return {**self._envelope(self.object, [self._choice(c) for c in choices]),
                "usage": usage(final)}

    def _logprobs(self, d: Delta) -> dict | None:
        if self.num_logprobs is None:
            return None
        return completion_logprobs(self.tok, d, self.num_logprobs)

    def _choice(self, d: Delta) -> dict:
        return {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason, "logprobs": self._logprobs(d)}

    _chunk_choice = _choice


class CompletionFormat(ResponseFormat):
    """The legacy completions object; with `echo` each choice's first event starts with
    the prompt (and, with logprobs, the prompt tokens' logprobs: the first one null)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._started = [False] * self.n
        self._chars = [0] * self.n  # characters of each choice sent so far (text_offset)

    def _choice(self, d: Delta) -> dict:
        text, prompt = d.text, None
        if self.echo is not None and not self._started[d.index]:
            prompt_text, ids = self.echo[d.index * len(self.echo) // self.n]
            text = prompt_text + text
            prompt = (ids, d.prompt_logprobs)
        self._started[d.index] = True
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(self.tok, d, self.num_logprobs, prompt,
                                           self._chars[d.index])
        self._chars[d.index] += len(text)
        return {"index": d.index, "text": text, "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason, "logprobs": logprobs}

    _chunk_choice = _choice
