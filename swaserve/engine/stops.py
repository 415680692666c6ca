"""A request's stop strings and every decision about them: where its text ends (`first`,
as the engine reads each token), how much of a streamed text may still begin one
(`holdback`), and how far back the content said before must be kept to find one that
spans two pieces (`reach`)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """The stop strings of one request (none: nothing stops it)."""

    def __init__(self, stops: Sequence[str] | None):
        self.stops = tuple(stops or ())
        self.reach = max(map(len, self.stops), default=0)  # the longest one's length

    @property
    def holdback(self) -> int:
        """The characters at a streamed text's end that may still begin a stop string: held
        back until the next token says whether one came."""
        return (self.reach if self.stops else 1) - 1

    def first(self, text: str, since: int = 0) -> tuple[int, str] | None:
        """The first stop string in `text` that ends past `since` (the text read before):
        (where it begins, which), or None."""
        start = max(0, since - self.reach + 1)
        hits = [(text.find(s, start), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def cut(self, said: str, text: str, stop: str) -> str | None:
        """`text` up to where `stop` begins in it (`said`: the text before it, as far back as
        `reach`), or None when it is not there; text said before is never taken back."""
        j = (said + text).find(stop)
        return None if j < 0 else text[:max(0, j - len(said))]
