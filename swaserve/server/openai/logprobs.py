"""Logprobs in OpenAI's two formats: the legacy completions object and chat's content list.

JSON has no infinity: a logprob that is -inf (a token a grammar or logit bias banned) is
written as -9999.0, the value OpenAI uses for that."""

from __future__ import annotations

import math

from swaserve.server.events import Delta

BANNED_LOGPROB = -9999.0


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else BANNED_LOGPROB


def _tok_str(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n] if n else []


def completion_logprobs(tok, d: Delta, n: int,
                        prompt: tuple[list[int], list | None] | None = None,
                        offset: int = 0) -> dict:
    """The legacy object for a delta's tokens, after the prompt's when it is echoed
    (`prompt`: its ids and their logprobs; the first token has none: null). `offset` is
    where the delta's text starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []

    def add(t: int, entry: dict[int, float] | None) -> None:
        nonlocal offset
        s = _tok_str(tok, t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        token_lps.append(None if entry is None else _finite(entry.get(t)))
        top: dict[str, float] | None = None
        if entry is not None:  # keyed by text: of two tokens that read the same, the likelier
            top = {}
            for k, v in _top(entry, n):
                top.setdefault(_tok_str(tok, k), _finite(v))
        tops.append(top)

    if prompt is not None:
        ids, lps = prompt
        for i, t in enumerate(ids):
            add(t, lps[i] if lps is not None else None)
    for t, entry in zip(d.token_ids, d.logprobs):
        add(t, entry)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tok, d: Delta, n: int) -> dict:
    content = []
    for t, entry in zip(d.token_ids, d.logprobs):
        s = _tok_str(tok, t)
        content.append({"token": s, "logprob": _finite(entry.get(t)), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _tok_str(tok, k), "logprob": _finite(v),
                                          "bytes": list(_tok_str(tok, k).encode())}
                                         for k, v in _top(entry, n)]})
    return {"content": content}
