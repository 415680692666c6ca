"""The kinds of per-request state, in the order KVCache builds and visits them: the one
list a new kind joins (docs/adding-a-state-kind.md)."""

from __future__ import annotations

from swaserve.memory.compress_pool import CompressPool
from swaserve.memory.full_pool import FullKVPool
from swaserve.memory.layout import CacheLayout
from swaserve.memory.pool import Costs, Pool, Sizing
from swaserve.memory.state_pool import StatePool
from swaserve.memory.window_pool import WindowPool

POOL_KINDS: tuple[type[Pool], ...] = (FullKVPool, WindowPool, StatePool, CompressPool)


def declared_kinds(layout: CacheLayout) -> list[type[Pool]]:
    """The pool kinds a model of `layout` needs."""
    return [kind for kind in POOL_KINDS if kind.declared(layout)]


def plan_costs(layout: CacheLayout, sizing: Sizing) -> Costs:
    """The costs of every pool kind, summed (one that `layout` does not declare costs
    nothing, as `sizing` comes from the layout: no ring without sliding layers)."""
    return sum((kind.costs(layout, sizing) for kind in POOL_KINDS), Costs())
