"""Prometheus metrics of one server (its own registry: no process-wide state)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("swaserve_requests_running", "Requests holding a row", registry=r)
        self.waiting = Gauge("swaserve_requests_waiting", "Requests waiting for memory", registry=r)
        self.full_pool_usage = Gauge("swaserve_full_pool_usage", "Fraction of full-KV pages in use", registry=r)
        self.request_pages = Gauge("swaserve_full_pool_request_pages",
                                   "Full-KV pages held by running requests (not only the cache)",
                                   registry=r)
        self.cache_nodes = Gauge("swaserve_prefix_cache_pages", "Pages held by the prefix cache",
                                 registry=r)
        self.ring_usage = Gauge("swaserve_ring_rows_usage", "Fraction of request rows (rings) in use", registry=r)
        self.prompt_tokens = Counter("swaserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("swaserve_prompt_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("swaserve_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("swaserve_preemptions", "Requests retracted for memory", registry=r)
        self.requests = Counter("swaserve_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("swaserve_time_to_first_token_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("swaserve_inter_token_latency_seconds", "Time between tokens", buckets=_LAT, registry=r)
        self._last_token: dict[str, float] = {}
        self._preempt_seen = 0

    def on_step(self, engine, changed) -> None:
        """Called by the engine thread after each step."""
        now = time.monotonic()
        sched, cache = engine.scheduler, engine.cache
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        if cache.full is not None and cache.num_total_pages:
            self.full_pool_usage.set(1 - cache.num_free_pages / cache.num_total_pages)
        self.ring_usage.set(1 - cache.rows.num_free / cache.rows.num_rows)
        self.request_pages.set(len({p for pages in cache.row_pages.values() for p in pages}))
        if cache.prefix is not None:
            self.cache_nodes.set(cache.prefix.num_nodes)
        if sched.num_preemptions > self._preempt_seen:
            self.preemptions.inc(sched.num_preemptions - self._preempt_seen)
            self._preempt_seen = sched.num_preemptions
        for req in changed:
            rid = req.request_id
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
                self.requests.labels(req.finish_reason.value if req.finish_reason else "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
