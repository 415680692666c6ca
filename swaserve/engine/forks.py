"""ForkGroups: the n > 1 completions of one prompt until they fork, keyed by `group_id`.

The first completion (the parent) is scheduled alone; its siblings wait for its prompt.
When the prompt completes they share its logits row (SampleStage.rows) and each takes a
copy of its prompt KV (Postprocessor, KVCache.fork_row). Ending the parent before then
(an abort, a failure) ends the siblings that wait for it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.engine.request import FinishReason, Request, RequestError
from swaserve.engine.scheduler import Scheduler


@dataclass
class _Group:
    parent: Request
    waiting: list[Request]  # siblings not forked yet


class ForkGroups:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._groups: dict[str, _Group] = {}  # group_id -> its parent and waiting siblings

    def add(self, reqs: list[Request]) -> None:
        """The n completions of one prompt, the parent first."""
        if len(reqs) > 1:
            self._groups[reqs[0].group_id] = _Group(reqs[0], reqs[1:])

    def waiting(self, req: Request) -> list[Request]:
        """The siblings waiting for `req`'s prompt ([] unless it is a parent with some)."""
        group = self._groups.get(req.group_id)
        return group.waiting if group is not None and group.parent is req else []

    def forked(self, parent: Request, child: Request) -> None:
        """`child` has its own row now (or is queued on its own): it waits no more."""
        group = self._groups.get(parent.group_id)
        if group is None or group.parent is not parent:
            return
        if child in group.waiting:
            group.waiting.remove(child)
        if not group.waiting:
            del self._groups[parent.group_id]

    def abort(self, req: Request) -> None:
        """Abort a request and the siblings that wait for it."""
        for sib in self._take(req):
            self.scheduler.abort(sib)
        self.scheduler.abort(req)

    def fail(self, req: Request, error: RequestError) -> None:
        """End one request with an error (the siblings that wait for it too); its memory is
        freed and nothing else changes."""
        if req.is_finished:
            return
        for sib in [req, *self._take(req)]:
            sib.error = error
            self.scheduler.abort(sib, FinishReason.ERROR)

    def _take(self, req: Request) -> list[Request]:
        """The siblings waiting for `req`, which no longer wait."""
        group = self._groups.get(req.group_id)
        if group is None or group.parent is not req:
            return []
        del self._groups[req.group_id]
        return group.waiting
