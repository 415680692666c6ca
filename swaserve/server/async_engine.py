"""AsyncEngine: the engine's step loop in its own thread, beside the asyncio event loop.

HTTP handlers never touch the engine: they post commands (add, abort) to an inbox and read
events from a per-request asyncio queue, so HTTP handling never stalls decoding and
decoding never waits on a slow client. All requests of all clients share one batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from swaserve.engine.engine import Engine
from swaserve.engine.request import Request
from swaserve.sampling.grammar import CompiledGrammar
from swaserve.sampling.params import SamplingParams

log = logging.getLogger("swaserve")


@dataclass
class Delta:
    """New output of one completion (index) since the last event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Final:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: list[int]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reqs: list[Request] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    holdback: int = 0

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineError(Exception):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 1024):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swaserve-engine", daemon=True)
        self.metrics = None  # set by the app; called from the engine thread
        self.num_waiting = 0
        self.num_running = 0
        self._thread.start()

    # -- called from the event loop --------------------------------------------------------
    def overloaded(self) -> bool:
        return self.num_waiting >= self.max_waiting

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       grammar: CompiledGrammar | None = None) -> AsyncIterator[Delta | Final]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", request_id, prompt_ids, params, grammar, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Final):
                    finished = True
                    return
        finally:
            if not finished:  # the client went away or the handler failed: free the memory
                self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished()
            self._drain(block)
            if self._stop.is_set():
                break
            if not eng.has_unfinished():
                continue
            try:
                changed = eng.step()
            except Exception as e:  # noqa: BLE001 - a bug must not leave clients hanging
                log.exception("engine step failed")
                self._fail_all(EngineError(f"engine step failed: {e}"))
                continue
            self.num_waiting = len(eng.scheduler.waiting)
            self.num_running = len(eng.scheduler.running)
            if self.metrics is not None:
                self.metrics.on_step(eng, changed)
            self._publish(changed)
        self._fail_all(EngineError("the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "stop":
            for rid in list(self._streams):
                self._abort(rid)
            self._stop.set()
        elif cmd[0] == "add":
            _, rid, ids, params, grammar, stream = cmd
            try:
                stream.reqs = eng.add_request(ids, params, request_id=rid, grammar=grammar)
            except ValueError as e:
                stream.put(e)
                return
            n = len(stream.reqs)
            stream.sent_tokens, stream.sent_chars, stream.done = [0] * n, [0] * n, [False] * n
            stream.holdback = max((len(s) for s in params.stop or []), default=1) - 1
            self._streams[rid] = stream
            self.num_waiting = len(eng.scheduler.waiting)
        elif cmd[0] == "abort":
            self._abort(cmd[1])

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        for r in stream.reqs:
            self.engine.abort(r.request_id)
            self.engine.release(r.request_id)

    def _publish(self, changed: list[Request]) -> None:
        touched = {}
        for req in changed:
            rid = req.request_id.rsplit("-", 1)[0] if req.request_id not in self._streams else req.request_id
            if rid in self._streams:
                touched[rid] = self._streams[rid]
        for rid, stream in touched.items():
            for i, req in enumerate(stream.reqs):
                d = self._delta(stream, i, req)
                if d is not None:
                    stream.put(d)
            if all(r.is_finished for r in stream.reqs):
                stream.put(Final(stream.reqs[0].num_prompt_tokens, stream.reqs[0].num_cached_tokens,
                                 [r.num_output_tokens for r in stream.reqs]))
                del self._streams[rid]
                for r in stream.reqs:
                    self.engine.release(r.request_id)

    def _delta(self, stream: _Stream, i: int, req: Request) -> Delta | None:
        if stream.done[i]:
            return None
        text = req.output_text
        # hold back what could still become the start of a stop string
        upto = len(text) if req.is_finished or not req.params.stop else max(
            stream.sent_chars[i], len(text) - stream.holdback)
        new_tokens = req.output_token_ids[stream.sent_tokens[i]:]
        if not new_tokens and upto == stream.sent_chars[i] and not req.is_finished:
            return None
        lps = (req.logprobs or [])[stream.sent_tokens[i]:]
        d = Delta(i, text[stream.sent_chars[i]:upto], new_tokens, lps,
                  req.finish_reason.value if req.is_finished and req.finish_reason else None,
                  req.stop_reason)
        stream.sent_tokens[i] = req.num_output_tokens
        stream.sent_chars[i] = upto
        stream.done[i] = d.finish_reason is not None
        return d

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self._streams):
            stream = self._streams[rid]
            self._abort(rid)
            stream.put(err)


def now() -> int:
    return int(time.time())
