"""Ray Serve request routers for the engine replicas (set on the deployment by app.py).

The ingress passes each request's prefix blocks (routing.request_blocks) as the `prefix`
keyword of its call, so a router reads them without parsing the request. Load is the number
of requests a replica is working on: Ray Serve's queue-length cache (what the replica last
reported, plus what was sent since) where it is fresh, else the requests this router has in
flight there. Ray Serve takes the first rank of replicas that are not full.
"""

from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from swaserve.ray.routing import IMBALANCE, IMBALANCE_RATIO, PrefixIndex, choose


class _Loads(RequestRouter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent: Counter = Counter()  # requests this router has in flight, per replica

    def load(self, replica_id: ReplicaID) -> int:
        cached = self.replica_queue_len_cache.get(replica_id)
        return cached if cached is not None else self._sent[replica_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        self._sent[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._sent[replica_id] = max(0, self._sent[replica_id] - 1)


class PrefixAffinityRouter(_Loads):
    """The replica most likely to hold the prompt's prefix, unless it is much busier."""

    def initialize_state(self, imbalance: int = IMBALANCE, imbalance_ratio: float = IMBALANCE_RATIO,
                         max_blocks: int = 200_000, **_):
        self.index = PrefixIndex(max_blocks)
        self.imbalance, self.imbalance_ratio = imbalance, imbalance_ratio

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        order = choose(_blocks(pending_request), {r: self.load(r) for r in by_id}, self.index,
                       self.imbalance, self.imbalance_ratio)
        return [[by_id[order[0]]], [by_id[r] for r in order[1:]]] if order else []

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        blocks = _blocks(pending_request)
        if blocks:
            self.index.insert(blocks, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:  # a replaced replica starts with an empty prefix cache
            self.index.remove(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)


class RoundRobinRouter(_Loads):
    """Each replica in turn (the baseline prefix affinity is measured against)."""

    def initialize_state(self, **_):
        self.turn, self.last_request = -1, None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        rid = pending_request.metadata.internal_request_id if pending_request else None
        if rid is None or rid != self.last_request:  # a retry of one request keeps its turn
            self.turn, self.last_request = self.turn + 1, rid
        k = self.turn % len(ordered)
        return [[r] for r in ordered[k:] + ordered[:k]]


def _blocks(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    return pending_request.kwargs.get("prefix") or []
