"""AsyncEngine: the engine's step loop in its own thread, beside the asyncio event loop.

HTTP handlers never touch the engine: they post commands (add, abort) to an inbox and read
events from a per-request asyncio queue, so HTTP handling never stalls decoding and
decoding never waits on a slow client. All requests of all clients share one batch.

What one request brings stays with it: a request whose completion fails in the engine gets
an `EngineError` (its siblings are aborted) and every other stream goes on. Admission is
counted from the moment a handler is let in (`admit`), so requests still in the inbox count
against `max_waiting`. A request past `request_timeout` is ended with an error. If the
engine thread dies, `alive` turns false, every waiting client gets an error, and new
requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from swaserve.engine.engine import Engine
from swaserve.engine.request import FinishReason, Request, RequestError
from swaserve.engine.stops import StopStrings
from swaserve.engine.threads import release_openmp_workers
from swaserve.sampling.grammar import CompiledGrammar
from swaserve.sampling.params import SamplingParams
from swaserve.server.errors import param_of
from swaserve.server.events import Delta, EngineError, Final, Stream
from swaserve.server.inbox import Abort, Add, Call, Command, Embed, Embedding, FailAll, Stop

log = logging.getLogger("swaserve")
_POLL_S = 0.05  # how often an idle engine thread looks at its inbox and deadlines
_OBSERVE_S = 0.05  # how often a busy engine thread refreshes the gauges


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 1024,
                 request_timeout: float | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.metrics = None  # set by the app; called from the engine thread
        self.num_waiting = 0  # the scheduler's waiting queue, as of the engine's last change
        self.dead: str | None = None  # why the engine thread stopped, if it did
        self.draining = False  # shutting down: no new requests
        self._admitted = 0  # let in by `admit`, not yet in the scheduler's queue
        self._lock = threading.Lock()
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._embeds: dict[str, Embedding] = {}
        self._stop = threading.Event()
        # from here on only the engine thread runs the model: the idle OpenMP workers that
        # loading left on this thread would make every parallel region there wake its own
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="swaserve-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop --------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        """Accepted requests not running yet: the scheduler's queue and the inbox."""
        return self.num_waiting + self._admitted

    @property
    def num_streams(self) -> int:
        return len(self._streams) + self._admitted

    def admit(self) -> None:
        """Let one request in or raise EngineError (503). Every admitted request is then
        either passed to `generate` or given back with `cancel_admission`."""
        if not self.alive:
            raise EngineError(f"the engine stopped: {self.dead or 'its thread ended'}",
                              code="engine_dead")
        if self.draining:
            raise EngineError("the server is shutting down", code="shutting_down")
        with self._lock:
            if self.num_queued >= self.max_waiting:
                raise EngineError("the server is overloaded: too many waiting requests",
                                  code="overloaded")
            self._admitted += 1

    def cancel_admission(self) -> None:
        with self._lock:
            self._admitted -= 1

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 grammar: CompiledGrammar | None = None) -> AsyncIterator[Delta | Final]:
        """Queue one admitted request now; returns its events, which raise EngineError
        where it fails. Whoever stops reading them early must `abort` it (closing the
        iterator does that once it has started)."""
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        if self.request_timeout is not None:
            stream.deadline = time.monotonic() + self.request_timeout
        self._inbox.put(Add(request_id, prompt_ids, params, grammar, stream))
        if not self.alive:  # it died: its last act answers the inbox, but maybe before this
            stream.put(EngineError(f"the engine stopped: {self.dead}", code="engine_dead"))
        return self._events(request_id, stream)

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    async def embed(self, prompts: list[list[int]], request_id: str) -> list[list[float]]:
        """Embed one admitted request's prompts on the engine thread, between its steps;
        raises EngineError where it fails or outlives `request_timeout`. Whoever stops
        waiting for it must `abort` it."""
        deadline = (time.monotonic() + self.request_timeout
                    if self.request_timeout is not None else None)
        return await self._ask(lambda reply: Embed(request_id, prompts, reply, deadline))

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """`fn(engine)`'s result, run on the engine thread between two steps, where the
        engine's state is consistent (cheap reads only: decoding waits for it). Raises
        EngineError once the engine stopped, or what `fn` raised."""
        return await self._ask(lambda reply: Call(fn, reply))

    async def _ask(self, command: Callable[[Callable[[object], None]], Command]) -> object:
        """Post `command(reply)` and await what the engine thread replies: a result, or an
        exception to raise."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def settle(result) -> None:
            if not answer.done():
                (answer.set_exception if isinstance(result, BaseException)
                 else answer.set_result)(result)

        def reply(result) -> None:
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass

        self._inbox.put(command(reply))
        if not self.alive:
            reply(EngineError(f"the engine stopped: {self.dead}", code="engine_dead"))
        return await answer

    async def _events(self, request_id: str, stream: Stream) -> AsyncIterator[Delta | Final]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True  # the engine thread has already let go of it
                    raise item
                yield item
                if isinstance(item, Final):
                    finished = True
                    return
        finally:
            if not finished:  # the client went away or the handler failed: free the memory
                self.abort(request_id)

    def fail_streams(self, message: str) -> None:
        """End every request with an error (shutdown's last word to the clients)."""
        self._inbox.put(FailAll(message))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(Stop())
        self._thread.join(timeout)
        self.engine.close()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - say so, then let no client hang
            log.exception("the engine thread died")
            self.dead = f"{type(e).__name__}: {e}"
            self._fail_all(EngineError(f"the engine stopped: {self.dead}", code="engine_dead"))
            while True:  # answer what is still in the inbox
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, Add | Embed):
                    self.cancel_admission()
                    err = EngineError(f"the engine stopped: {self.dead}", code="engine_dead")
                    if isinstance(cmd, Add):
                        cmd.stream.put(err)
                    else:
                        cmd.reply(err)
                elif isinstance(cmd, Call):
                    cmd.reply(EngineError(f"the engine stopped: {self.dead}",
                                          code="engine_dead"))
            return
        self._fail_all(EngineError("the server is shutting down", code="shutting_down"))

    def _loop(self) -> None:
        eng = self.engine
        observed, dirty = 0.0, False
        while not self._stop.is_set():
            changed_state = self._drain(block=not eng.has_unfinished())
            if self._stop.is_set():
                break
            changed_state |= self._expire()
            if eng.has_unfinished():
                changed = eng.step()  # a fault it cannot isolate raises: the thread dies
                self._publish(changed)
                if self.metrics is not None:
                    self.metrics.on_step(changed)
                changed_state = True
            # gauges: after every change once idle, at most every _OBSERVE_S while busy
            # (counting the pages requests hold walks every row's page list)
            dirty |= changed_state
            now = time.monotonic()
            if dirty and (not eng.has_unfinished() or now - observed >= _OBSERVE_S):
                self._observe()
                observed, dirty = now, False

    def _observe(self) -> None:
        stats = self.engine.stats()
        self.num_waiting = stats.num_waiting
        if self.metrics is not None:
            self.metrics.on_state(stats, self._admitted)

    def _drain(self, block: bool) -> bool:
        """Handle what the inbox holds (waiting briefly for it when idle); True if any."""
        try:
            cmd = self._inbox.get(timeout=_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case Stop():
                for rid in list(self._streams):
                    self._abort(rid)
                self._stop.set()
            case Add():
                self._add(cmd)
            case Abort(rid):
                if self._abort(rid) and self.metrics is not None:
                    self.metrics.aborted.inc()
            case FailAll(message):
                self._fail_all(EngineError(message, code="shutting_down"))
            case Embed():
                self._embed(cmd)
            case Call(fn, reply):
                try:
                    reply(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller's failure, not the engine's
                    reply(e)

    def _embed(self, cmd: Embed) -> None:
        def done(job) -> None:
            self._embeds.pop(cmd.request_id, None)
            err = job.error
            cmd.reply(job.vectors if err is None
                      else EngineError(err.message, err.status, err.type, err.code))
        try:
            job = self.engine.add_embedding(cmd.prompts, done)
            self._embeds[cmd.request_id] = Embedding(job, cmd.reply, cmd.deadline)
        except ValueError as e:
            cmd.reply(EngineError(str(e), 400, "invalid_request_error", param=param_of(e)))
        finally:
            self.cancel_admission()  # it is in the embedder's queue now (or refused)

    def _add(self, cmd: Add) -> None:
        rid, params, stream = cmd.request_id, cmd.params, cmd.stream
        try:
            stream.reqs = self.engine.add_request(cmd.prompt_ids, params, request_id=rid,
                                                  grammar=cmd.grammar)
        except ValueError as e:
            stream.put(EngineError(str(e), 400, "invalid_request_error", param=param_of(e)))
            return
        except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
            log.exception("adding request %s failed", rid)
            stream.put(EngineError(f"adding this request failed: {type(e).__name__}: {e}",
                                   500))
            return
        finally:
            self.num_waiting = len(self.engine.scheduler.waiting)
            self.cancel_admission()  # it is in the scheduler's queue now (or refused)
        stream.opened(StopStrings(params.stop))
        self._streams[rid] = stream

    def _abort(self, rid: str) -> bool:
        """Drop a request and free its memory; True if it was still running or waiting."""
        embedding = self._embeds.pop(rid, None)
        if embedding is not None:
            return self.engine.embedder.cancel(embedding.job)
        stream = self._streams.pop(rid, None)
        if stream is None:
            return False
        for r in stream.reqs:
            self.engine.abort(r.request_id)
        self._forget(stream)
        return True

    def _forget(self, stream: Stream) -> None:
        for r in stream.reqs:
            if self.metrics is not None:
                self.metrics.on_finish(r)
            self.engine.release(r.request_id)

    def _expire(self) -> bool:
        now = time.monotonic()
        late = [rid for rid, s in self._streams.items()
                if s.deadline is not None and now >= s.deadline]
        late_embeds = [rid for rid, e in self._embeds.items()
                       if e.deadline is not None and now >= e.deadline]
        for rid in late + late_embeds:
            stream, embedding = self._streams.get(rid), self._embeds.get(rid)
            self._abort(rid)
            err = EngineError(f"the request did not finish within the server's "
                              f"--request-timeout of {self.request_timeout:g} s", 504,
                              "timeout_error", "request_timeout")
            if stream is not None:
                stream.put(err)
            else:
                embedding.reply(err)
            if self.metrics is not None:
                self.metrics.timed_out.inc()
        return bool(late or late_embeds)

    def _publish(self, changed: list[Request]) -> None:
        touched = {}
        for req in changed:
            if req.group_id in self._streams:
                touched[req.group_id] = self._streams[req.group_id]
        for rid, stream in touched.items():
            try:
                self._publish_stream(rid, stream)
            except Exception as e:  # noqa: BLE001 - this stream fails, the others go on
                log.exception("streaming request %s failed", rid)
                self._abort(rid)
                stream.put(EngineError(f"streaming this request failed: {e}", 500))

    def _publish_stream(self, rid: str, stream: Stream) -> None:
        failed = next((r for r in stream.reqs if r.finish_reason is FinishReason.ERROR), None)
        if failed is not None:  # one completion failed: the request has failed
            self._abort(rid)
            err = failed.error
            stream.put(EngineError(err.message, err.status, err.type, err.code)
                       if err is not None else EngineError("the request failed", 500))
            return
        for i, req in enumerate(stream.reqs):
            d = stream.delta(i, req)
            if d is not None:
                stream.put(d)
        if all(r.is_finished for r in stream.reqs):
            stream.put(Final(stream.reqs[0].num_prompt_tokens, stream.reqs[0].num_cached_tokens,
                             [r.num_output_tokens for r in stream.reqs]))
            del self._streams[rid]
            self._forget(stream)

    def _fail_all(self, err: EngineError) -> None:
        if self.engine.embedder is not None:
            self.engine.embedder.fail_all(RequestError(err.message, err.type, err.status,
                                                       err.code))
        for rid in list(self._streams):
            stream = self._streams[rid]
            self._abort(rid)
            stream.put(err)
