"""A completion's parsed content ends where the engine ended its text: at the stop string
that stopped it, found as the engine finds it (engine/stops.py)."""

from __future__ import annotations

from dataclasses import replace

from swaserve.chat.events import Event
from swaserve.engine.stops import StopStrings


class ContentStops:
    """One completion's parsed content against its request's stop strings: the content said
    last (as far back as a stop string reaches), and the content cut where the stop string
    that finished the completion begins."""

    def __init__(self, stop: list[str] | None):
        self.stops = StopStrings(stop)
        self.tail = ""

    def read(self, events: list[Event], finished: bool,
             stop_reason: str | int | None) -> list[Event]:
        """A piece's events (all of them, the parser's last included, when `finished`),
        cut where the stop string that finished it begins."""
        if finished and isinstance(stop_reason, str):
            events = self._cut(events, stop_reason)
        if self.stops.reach:
            said = self.tail + "".join(e.text for e in events if e.kind == "content")
            self.tail = said[-self.stops.reach:]
        return events

    def _cut(self, events: list[Event], stop: str) -> list[Event]:
        out, said = [], self.tail
        for e in events:
            if e.kind == "content":
                kept = self.stops.cut(said, e.text, stop)
                if kept is not None:
                    return out + ([replace(e, text=kept)] if kept else [])
                said += e.text
            out.append(e)
        return out
