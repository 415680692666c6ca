"""Output handling: what one sampled token does to its request.

Append it (and its logprobs), detokenize, check stop strings, eos, stop tokens and the
length limit, and advance the request's grammar. Each request is handled on its own: the
engine catches what this raises and fails that request only.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.faults import FaultInjector
from swaserve.engine.request import FinishReason, Request
from swaserve.engine.scheduler import Scheduler
from swaserve.engine.stops import StopStrings

log = logging.getLogger("swaserve")


class _Reader(NamedTuple):
    """A request's output text, read once as its tokens come, and its stop strings."""

    detok: IncrementalDetokenizer
    stops: StopStrings


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None,
                 eos_token_ids: frozenset[int], faults: FaultInjector):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.faults = faults  # a test hook: see engine/faults.py
        self._readers: dict[str, _Reader] = {}

    def add(self, req: Request) -> None:
        if self.tokenizer is not None:
            self._readers[req.request_id] = _Reader(
                IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens),
                StopStrings(req.params.stop))

    def release(self, request_id: str) -> None:
        self._readers.pop(request_id, None)

    def accept(self, req: Request, tok: int, logprobs: dict[int, float] | None,
               now: float | None = None) -> None:
        """Record one sampled token of a running request and finish it if it should stop."""
        req.output_token_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic() if now is None else now
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
        self._check_stop(req, tok)
        if req.grammar is not None and not req.is_finished:
            self._advance_grammar(req, tok)

    def _check(self, stage: str, req: Request) -> None:
        self.faults.check(stage, (req.request_id,))

    def _advance_grammar(self, req: Request, tok: int) -> None:
        self._check("grammar", req)
        if not req.grammar.accept(tok):  # the mask allowed it, so this is an engine bug
            log.warning("%s: grammar rejected token %d: %s", req.request_id, tok,
                        req.grammar.error)
            req.stop_reason = "grammar_error"
            self.scheduler.finish(req, FinishReason.STOP)
        elif req.grammar.is_terminated:
            self.scheduler.finish(req, FinishReason.STOP)

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        reader = self._readers.get(req.request_id)
        if reader is not None:
            self._check("detokenizer", req)
            prev = len(reader.detok.text)
            reader.detok.add(tok)
            req.output_text = reader.detok.text
            if reader.stops.stops and req.num_output_tokens >= p.min_tokens:
                hit = reader.stops.first(req.output_text, prev)
                if hit is not None:
                    i, s = hit
                    req.output_text = req.output_text[:i]
                    req.stop_reason = s
                    self.scheduler.finish(req, FinishReason.STOP)
                    return
        if req.num_output_tokens >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                self.scheduler.finish(req, FinishReason.STOP)
                return
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.stop_reason = tok
                self.scheduler.finish(req, FinishReason.STOP)
                return
        if req.num_output_tokens >= req.max_new_tokens:
            self.scheduler.finish(req, FinishReason.LENGTH)
