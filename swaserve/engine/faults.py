"""Fault injection: make one stage of the engine raise for chosen requests.

Tests and `benchmarks/resilience.py` use it to prove that a fault in one request's sampling,
detokenization or grammar fails that request only, and that a fault in a whole step (the
forward) fails that step's requests with an error while the engine keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STAGES = ("forward", "sampler", "detokenizer", "grammar")


class InjectedFault(RuntimeError):
    """The exception an armed stage raises."""


@dataclass
class FaultInjector:
    """`arm(stage, request_id)`: that stage raises whenever it handles that request. The
    engine makes one and hands it to the stages that check it (`Engine.faults`)."""

    armed: dict[str, set[str]] = field(default_factory=dict)

    def arm(self, stage: str, request_id: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {stage!r}")
        self.armed.setdefault(stage, set()).add(request_id)

    def disarm(self) -> None:
        self.armed.clear()

    def check(self, stage: str, request_ids: Iterable[str]) -> None:
        if not self.armed:
            return
        hit = self.armed.get(stage, set()).intersection(request_ids)
        if hit:
            raise InjectedFault(f"injected {stage} fault for {', '.join(sorted(hit))}")
