"""Prometheus metrics of one server (its own registry: no process-wide state).

Gauges are set from the engine thread after every change of engine state (a step, an added
or aborted request), so they are current when the server idles too."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from swaserve.engine.request import FinishReason, Request
from swaserve.engine.stats import EngineStats

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RETRACTIONS = (0, 1, 2, 3, 5, 10)
REJECT_REASONS = ("invalid", "too_large", "unauthorized", "not_found", "overloaded",
                  "shutting_down", "engine_dead")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("swaserve_requests_running", "Requests holding a row", registry=r)
        self.waiting = Gauge("swaserve_requests_waiting",
                             "Accepted requests not running yet (the engine's inbox included)",
                             registry=r)
        self.full_pool_usage = Gauge("swaserve_full_pool_usage", "Fraction of full-KV pages in use", registry=r)
        self.request_pages = Gauge("swaserve_full_pool_request_pages",
                                   "Full-KV pages held by running requests (not only the cache)",
                                   registry=r)
        self.cache_nodes = Gauge("swaserve_prefix_cache_pages", "Pages held by the prefix cache",
                                 registry=r)
        self.ring_usage = Gauge("swaserve_ring_rows_usage", "Fraction of request rows (rings) in use", registry=r)
        self.kv_bytes = Gauge("swaserve_kv_bytes", "KV cache bytes by pool (full, ring, "
                              "window_pages) and state (used, free)", ["pool", "state"], registry=r)
        self.prompt_tokens = Counter("swaserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("swaserve_prompt_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("swaserve_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("swaserve_preemptions", "Requests retracted for memory", registry=r)
        self.draft_tokens = Counter("swaserve_spec_draft_tokens", "Speculative draft tokens "
                                    "verified", registry=r)
        self.accepted_tokens = Counter("swaserve_spec_accepted_tokens", "Speculative draft tokens "
                                       "accepted", registry=r)
        self.requests = Counter("swaserve_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.failed = Counter("swaserve_requests_failed", "Requests that failed in the engine",
                              registry=r)
        self.aborted = Counter("swaserve_requests_aborted",
                               "Requests whose client went away before they finished", registry=r)
        self.timed_out = Counter("swaserve_requests_timed_out",
                                 "Requests ended by --request-timeout", registry=r)
        self.rejected = Counter("swaserve_requests_rejected", "Requests refused before queueing",
                                ["reason"], registry=r)
        self.retractions = Histogram("swaserve_request_retractions",
                                     "Times a finished request was retracted for memory",
                                     buckets=_RETRACTIONS, registry=r)
        self.ttft = Histogram("swaserve_time_to_first_token_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("swaserve_inter_token_latency_seconds", "Time between tokens", buckets=_LAT, registry=r)
        for reason in REJECT_REASONS:  # every series exists from the start, at 0
            self.rejected.labels(reason)
        self._last_token: dict[str, float] = {}
        self._preempt_seen = 0
        self._drafts_seen = (0, 0)

    def on_state(self, stats: EngineStats, num_queued: int = 0) -> None:
        """Gauges of the engine's current state (called from the engine thread)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + num_queued)
        if stats.full_pages_total:
            self.full_pool_usage.set(stats.full_pages_used / stats.full_pages_total)
        self.ring_usage.set(stats.rows_used / stats.rows_total)
        self.request_pages.set(stats.request_pages)
        self.cache_nodes.set(stats.prefix_cache_pages)
        for pool, (used, free) in stats.kv_bytes.items():
            self.kv_bytes.labels(pool, "used").set(used)
            self.kv_bytes.labels(pool, "free").set(free)
        if stats.num_preemptions > self._preempt_seen:
            self.preemptions.inc(stats.num_preemptions - self._preempt_seen)
            self._preempt_seen = stats.num_preemptions
        proposed, accepted = stats.draft_tokens
        if proposed > self._drafts_seen[0]:
            self.draft_tokens.inc(proposed - self._drafts_seen[0])
            self.accepted_tokens.inc(accepted - self._drafts_seen[1])
            self._drafts_seen = (proposed, accepted)

    def on_step(self, changed: list[Request]) -> None:
        """Token counters and latencies of the requests a step changed."""
        now = time.monotonic()
        for req in changed:
            rid = req.request_id
            if req.finish_reason is FinishReason.ERROR:
                self._last_token.pop(rid, None)
                continue
            self.generation_tokens.inc()
            if req.num_output_tokens == 1:
                self.ttft.observe(now - req.arrival_time)
                self.prompt_tokens.inc(req.num_prompt_tokens)
                self.cached_tokens.inc(req.num_cached_tokens)
            elif rid in self._last_token:
                self.itl.observe(now - self._last_token[rid])
            self._last_token[rid] = now
            if req.is_finished:
                self._last_token.pop(rid, None)

    def on_finish(self, req: Request) -> None:
        """A request that left the engine, however it ended."""
        self._last_token.pop(req.request_id, None)
        reason = req.finish_reason.value if req.finish_reason else FinishReason.ABORT.value
        self.requests.labels(reason).inc()
        if req.finish_reason is FinishReason.ERROR:
            self.failed.inc()
        self.retractions.observe(req.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
