"""Scheduler: continuous batching with chunked prefill, admission by memory, retraction.

Each step has a token budget (`chunk_size`). Running requests go first, oldest first, so a
decode is never starved by a newer prompt; a continuing prefill takes what budget is left.
Waiting requests are then admitted, oldest first, while a request row is free and the full
pool has pages for the tokens they write now plus their first decode token (`needed <=
free`), beside an estimate of what the running requests will still write (a fraction of
their remaining new tokens that rises to 1 after a retraction and decays back, as SGLang's
`new_token_ratio` does), so that a request is not admitted only to be retracted at once.
A running request already owns its row (its ring was prepaid) and is only charged for new
pages. When the full pool runs dry the newest running request (by arrival) is retracted:
its memory is freed and it is recomputed later, which gives the same greedy output.

No request starves: both queues are kept in arrival order, so the oldest running request
is never the victim while a newer one runs, and it always progresses; a request retracted
MAX_RETRACTIONS times is counted at its whole remaining need when admitted and is not a
victim again. A request that could never fit the whole pool is refused when added.

With overlap scheduling a step is scheduled while the previous one still computes: a
request that finishes (or is aborted) while a step in flight still writes its KV keeps its
memory until that step is done (`in_flight`), and no request is retracted while one is.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from swaserve.engine.request import FinishReason, Request, RequestStatus
from swaserve.memory.kv_cache import KVCache
from swaserve.profile import timed

MAX_RETRACTIONS = 2  # then a request is admitted with its whole need and never retracted
ESTIMATE_CLIP = 4096  # new tokens counted at most per request in the growth estimate
RATIO_INIT, RATIO_MIN, RATIO_DECAY = 0.5, 0.1, 0.002  # the estimate's share, per step


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step
    num_tokens: int  # positions computed: known tokens, then the draft
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    draft: list[int] = field(default_factory=list)  # speculative tokens after the known ones

    @property
    def num_known(self) -> int:
        return self.num_tokens - len(self.draft)


@dataclass
class Batch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    blocked: bool = False  # a request needed a retraction, which was not allowed

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, cache: KVCache, chunk_size: int, aligned_chunks: bool = False):
        self.cache = cache
        self.chunk_size = chunk_size
        # batch-invariant mode: a prompt is computed in chunks [0, C), [C, 2C), ... whatever
        # runs beside it (a chunk waits for a step with room rather than shrinking), and
        # decodes do not draw on the prefill budget
        self.aligned_chunks = aligned_chunks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.new_token_ratio = RATIO_INIT
        self._deferred: list[Request] = []  # finished, memory held by a step in flight

    # -- queue -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        need = self.cache.pages_needed(None, req.max_total_tokens)
        if need > self.cache.num_total_pages and self.cache.full is not None:
            raise ValueError(
                f"prompt: {req.num_prompt_tokens} prompt + {req.max_new_tokens} new tokens need "
                f"{need} full-KV pages but the whole pool holds {self.cache.num_total_pages}; "
                "raise kv_memory or lower max_tokens")
        self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        """Put a request into the waiting queue at its arrival place."""
        bisect.insort(self.waiting, req, key=_arrival)

    def start_running(self, req: Request) -> None:
        """A request that owns a row now (admitted, or an n > 1 sibling forked from one)."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request wherever it is (waiting, running, or not queued yet)."""
        if req.status is not RequestStatus.FINISHED:
            self.finish(req, reason)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request: out of the waiting queue if it is there, its memory freed (once no
        step in flight uses it) if it was running."""
        was_running = req.status is RequestStatus.RUNNING
        if req.status is RequestStatus.WAITING and req in self.waiting:
            # an abort, or an n > 1 sibling that could not fork ended by the first token it
            # already sampled: either must not be admitted again
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if was_running:
            if req.in_flight:
                self._deferred.append(req)
            else:
                self._release(req)

    def release_deferred(self) -> None:
        """Free the memory of finished requests that no step in flight uses any more."""
        held = [r for r in self._deferred if r.in_flight]
        for r in self._deferred:
            if not r.in_flight:
                self._release(r)
        self._deferred = held

    def _release(self, req: Request) -> None:
        # prompt + output is a cached prefix; an aborted or failed request's KV may be partial
        if req.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
            self._cache_prefix(req, req.tokens(0, min(req.num_computed_tokens,
                                                      req.num_known_tokens)))
        self._unlock(req)
        self.running.remove(req)
        self.cache.free_row(req.row)
        req.row = None

    # -- prefix cache ----------------------------------------------------------------------
    def on_prompt_done(self, req: Request) -> None:
        """The prompt is computed: cache it now, so that requests sharing it (n siblings, the
        next turn of a chat) hit while this one still decodes."""
        self._cache_prefix(req, req.prompt_token_ids)

    def _cache_prefix(self, req: Request, tokens: list[int]) -> None:
        prefix = self.cache.prefix
        if prefix is None or req.row is None or len(tokens) < self.cache.page_size:
            return
        node = self.cache.cache_tokens(req.row, tokens)
        prefix.lock(node, +1)
        self._unlock(req)
        req.cache_node = node

    def _unlock(self, req: Request) -> None:
        if req.cache_node is not None:
            self.cache.prefix.lock(req.cache_node, -1)
            req.cache_node = None

    # -- one step --------------------------------------------------------------------------
    @timed("schedule")
    def schedule(self, can_retract: bool = True,
                 drafts: dict[str, list[int]] | None = None,
                 max_decode_rows: Callable[[int], int] | None = None) -> Batch:
        """The next step's batch. `can_retract=False` while a step is in flight: a request
        that would need a retraction is left out and the batch marked `blocked`. `drafts`:
        speculative tokens of decoding requests (best first), computed after their token
        within `max_decode_rows(decode seqs)` decode rows (_add_drafts)."""
        batch = Batch()
        scheduled: set[str] = set()
        self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
        budget = self._schedule_running(batch, self.chunk_size, scheduled, can_retract)
        budget = self._admit_waiting(batch, budget)
        if drafts and all(s.num_tokens == 1 for s in batch.seqs):
            self._add_drafts(batch, drafts, budget, max_decode_rows)
        return batch

    def _schedule_running(self, batch: Batch, budget: int, scheduled: set[str],
                          can_retract: bool) -> int:
        """The running requests' next chunks or decode tokens, oldest first, making room by
        retraction; returns the budget left."""
        for req in list(self.running):
            if budget == 0 and not self.aligned_chunks:  # aligned: decodes cost no budget
                break
            if req.status is not RequestStatus.RUNNING:  # retracted earlier, or finished
                continue
            if (req.num_generated >= req.max_new_tokens
                    and req.num_computed_tokens >= req.num_prompt_tokens):
                continue  # its pending token is its last (max_tokens 0: its prompt is done)
            n = self._chunk(req.num_uncomputed_tokens, budget)
            if n == 0:
                continue
            if not self._make_room(req, req.num_computed_tokens + n, scheduled, batch,
                                   can_retract):
                continue
            self._slots(req, req.num_computed_tokens + n)
            batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n,
                                           req.num_computed_tokens + n == req.num_tokens))
            scheduled.add(req.request_id)
            budget -= n if n > 1 or not self.aligned_chunks else 0
        return budget

    def _admit_waiting(self, batch: Batch, budget: int) -> int:
        """Admit waiting requests, oldest first, while a row is free and the pages they
        write now and are expected to add fit; returns the budget left."""
        # pages the running requests are expected to add: admission leaves them free
        reserved = sum(self.cache.pages_needed(r.row, self._expected_tokens(r))
                       for r in self.running if r.status is RequestStatus.RUNNING)
        while self.waiting and budget > 0 and not batch.retracted and not batch.blocked:
            req = self.waiting[0]
            if self.cache.rows.num_free == 0:
                break
            # a prefix-cache hit: its pages are shared, not charged; at least one token is
            # computed so that there are logits to sample from. A prompt to score is
            # computed cold: cached tokens have no logits
            hit = None
            if req.prompt_logprobs is None:
                hit = self.cache.match_prefix(req.tokens(0, req.num_tokens - 1))
            start = hit.num_tokens if hit is not None else 0
            n = self._chunk(req.num_tokens - start, budget)
            if n == 0:
                break
            # charge the tokens written now plus the first decode token after the prompt,
            # and keep room for what this request and the running ones are expected to add
            now_tokens = min(start + n + 1, req.max_total_tokens)
            shared = start // self.cache.page_size
            need = self.cache.pages_needed(None, now_tokens) - shared
            expect = self.cache.pages_needed(
                None, max(now_tokens, self._expected_tokens(req))) - shared
            if hit is not None:
                self.cache.prefix.lock(hit.node, +1)  # eviction must not take it from us
            if not self.cache.can_fit(reserved + expect):
                if hit is not None:
                    self.cache.prefix.lock(hit.node, -1)
                break
            reserved += expect - need
            self.waiting.popleft()
            req.row = self.cache.alloc_row()
            self.start_running(req)
            if hit is not None:
                self.cache.restore(req.row, hit)
                req.cache_node = hit.node
                req.num_computed_tokens = start
                req.num_cached_tokens = max(req.num_cached_tokens, start)
            self._slots(req, req.num_computed_tokens + n)
            batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n,
                                           req.num_computed_tokens + n == req.num_tokens))
            budget -= n
        return budget

    def _add_drafts(self, batch: Batch, drafts: dict[str, list[int]], budget: int,
                    max_decode_rows: Callable[[int], int] | None) -> None:
        """Give the decode seqs of a step without prompt chunks their drafts, best first, as
        far as the token budget, the row bound and the free pages go (a draft never retracts
        a request or evicts a cached prefix). Beside a prompt chunk, rows that drafts add cost
        more than they bring (their cost is the prompt's step, which the cost gate cannot
        see); so drafts stay out of those steps."""
        decodes = {s.request.request_id: s for s in batch.seqs if s.num_tokens == 1}
        if max_decode_rows is not None:
            budget = min(budget, max_decode_rows(len(decodes)) - len(decodes))
        for rid, draft in drafts.items():
            s = decodes.get(rid)
            if s is None or budget <= 0:
                continue
            req = s.request
            draft = draft[:budget]
            while draft and not self.cache.fits_free(req.row,
                                                     req.num_computed_tokens + 1 + len(draft)):
                draft = draft[:-1]
            if draft:
                self._slots(req, req.num_computed_tokens + 1 + len(draft))
                s.draft = draft
                s.num_tokens += len(draft)
                budget -= len(draft)

    def _slots(self, req: Request, num_tokens: int) -> None:
        """Full-pool slots for what `req` computes now; room was made, so a shortfall is a
        bookkeeping bug (the engine fails the step and checks the pools)."""
        if not self.cache.ensure_slots(req.row, num_tokens):
            raise RuntimeError(f"{req.request_id}: no full-KV pages for {num_tokens} tokens "
                               "after admission found room")

    def _chunk(self, uncomputed: int, budget: int) -> int:
        """Tokens to compute now for a request with `uncomputed` left (0: not this step)."""
        if not self.aligned_chunks:
            return min(uncomputed, budget)
        if uncomputed == 1:  # a decode
            return 1
        n = min(uncomputed, self.chunk_size)
        return n if n <= budget else 0

    def _make_room(self, req: Request, num_tokens: int, scheduled: set[str], batch: Batch,
                   can_retract: bool) -> bool:
        """Retract the newest unscheduled requests until `req` has pages for `num_tokens`.
        False when `req` itself had to be retracted (or could not be given room)."""
        while not self.cache.can_fit(self.cache.pages_needed(req.row, num_tokens)):
            if not can_retract:
                batch.blocked = True
                return False
            victims = [r for r in self.running if r.request_id not in scheduled and r is not req
                       and r.status is RequestStatus.RUNNING
                       and r.num_preemptions < MAX_RETRACTIONS]
            victim = max(victims, key=_arrival) if victims else req
            self._retract(victim)
            batch.retracted.append(victim)
            if victim is req:
                return False
        return True

    def _retract(self, req: Request) -> None:
        self._unlock(req)
        self.running.remove(req)
        self.cache.free_row(req.row)
        req.row = None
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.new_token_ratio = 1.0  # the estimate was too low: admit cautiously for a while
        self.enqueue(req)

    def _expected_tokens(self, req: Request) -> int:
        """Tokens `req` is expected to hold by its end, for admission's estimate: all of its
        remaining new tokens once it was retracted often, else a clipped share of them."""
        remaining = max(0, req.max_new_tokens - req.num_generated)
        if req.num_preemptions < MAX_RETRACTIONS:
            remaining = math.ceil(self.new_token_ratio * min(remaining, ESTIMATE_CLIP))
        return min(req.max_total_tokens, req.num_tokens + remaining)


def _arrival(req: Request) -> int:
    return req.arrival
