"""What the engine thread sends a request's handler: `Delta`s of new output, one `Final`,
or an `EngineError`; `Stream` carries them to the handler's event loop and remembers how
far each completion was sent, holding back text that may still begin a stop string."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from swaserve.engine.request import Request
from swaserve.engine.stops import StopStrings


@dataclass
class Delta:
    """New output of one completion (index) since the last event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # on a completion's first event when prompt logprobs were asked for (Request's format)
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class Final:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: list[int]


class EngineError(Exception):
    """A request's failure as its client sees it: an HTTP status and an OpenAI error."""

    def __init__(self, message: str, status: int = 503, type_: str = "server_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.code, self.param = (
            message, status, type_, code, param)


@dataclass
class Stream:
    """One request's events on their way from the engine thread to its handler's loop,
    and how far each of its n completions has been sent."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None = None
    reqs: list[Request] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    started: list[bool] = field(default_factory=list)  # an event was sent for this index
    holdback: int = 0

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass

    def opened(self, stops: StopStrings) -> None:
        """Its requests are in the engine (`reqs`): nothing sent yet, and text that may
        still begin one of `stops` held back."""
        n = len(self.reqs)
        self.sent_tokens, self.sent_chars = [0] * n, [0] * n
        self.done, self.started = [False] * n, [False] * n
        self.holdback = stops.holdback

    def delta(self, i: int, req: Request) -> Delta | None:
        """Completion i's new output since its last event, or None when there is none."""
        if self.done[i]:
            return None
        text = req.output_text
        # hold back what could still become the start of a stop string
        upto = len(text) if req.is_finished or not req.params.stop else max(
            self.sent_chars[i], len(text) - self.holdback)
        new_tokens = req.output_token_ids[self.sent_tokens[i]:]
        if not new_tokens and upto == self.sent_chars[i] and not req.is_finished:
            return None
        lps = (req.logprobs or [])[self.sent_tokens[i]:]
        d = Delta(i, text[self.sent_chars[i]:upto], new_tokens, lps,
                  req.finish_reason.value if req.is_finished and req.finish_reason else None,
                  req.stop_reason)
        if not self.started[i]:  # the n siblings share the first one's prompt
            d.prompt_logprobs = self.reqs[0].prompt_logprobs
            self.started[i] = True
        self.sent_tokens[i] = req.num_output_tokens
        self.sent_chars[i] = upto
        self.done[i] = d.finish_reason is not None
        return d
