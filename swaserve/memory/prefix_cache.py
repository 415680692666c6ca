"""Prefix cache for hybrid SWA models: a radix tree of pages whose nodes own full-pool pages
and, beside them, *window pages*: the sliding layers' KV of the same tokens.

Why window pages and not checkpoints: a hit must be exact, and recomputing a trailing band
is not (each recomputed position needs its own window of exact hidden states). A hit at L
is exact when the sliding KV of the W positions before L can be restored into the new
request's ring. Checkpoints hold W positions each: dense enough for mid-prompt hits (every
256 tokens, so a 1,900-token hit recomputes <= 256) they cost 2x the bytes of keeping the
sliding KV of every cached token (W=512: 30 vs 15 KiB per cached token on Gemma 3 270M),
and a hit between two of them still recomputes. Window pages cost one copy per sliding
layer per token (written through as the request computes, never overwritten like the
ring) and make *every* page boundary a restorable hit point. They live in their own
budget (`window_cache_memory`) and are evicted with their tree nodes, LRU, never while a
running request holds them (`lock`).

Eviction takes the least recently used unlocked leaf from a heap of the nodes that may be
one (each pushed when it may have become one: made, touched, unlocked, or its last child
gone; entries that no longer hold are skipped as they come up). Walking the tree for its
leaves would cost time in proportion to the tree on every eviction, and a server whose
cache is full evicts a page or two every decode step; a cache of a few GiB holds
~100,000 nodes.

Recurrent layers (Qwen3.5's Gated DeltaNet) are the other way round: their state after a
position cannot be rebuilt from any band of KV, only from all of the tokens before, so the
tree keeps state *checkpoints* on some nodes (the state after the node's last token, in a
slot of the state pool's checkpoint region, memory/state_pool.py): taken every
`state_checkpoint_interval` tokens and at each prompt's last page boundaries as a request
computes them, and handed to the tree with its pages. A hit backs off to the deepest node
of the matched path that has one (SGLang's mamba radix cache and vLLM's "align" mode do the
same); the rest is recomputed. Checkpoints live in their own budget (`state_cache_memory`);
when it is full, the least recently used checkpoint of an unlocked node is dropped (its
node keeps its pages), never one on a path a running request holds.

Address scheme: window page `w` holds positions of one full page at slots
`w * page_size + offset` of one buffer per sliding layer (dense sliding index), in the
rings' KV format (memory/kv_quant.py): a restore copies the same stored bytes and scales.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from swaserve.memory.kv_quant import KVBuffers, KVFormat
from swaserve.memory.layout import CacheLayout
from swaserve.memory.pages import PageAllocator


class WindowPagePool(KVBuffers):
    def __init__(self, layout: CacheLayout, num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device | str):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        # K = V layers (DeepSeek-V4) keep one buffer, as their rings do
        super().__init__([(num_pages * page_size, layout.layers[i].num_kv_heads,
                           layout.layers[i].head_dim) for i in layout.sliding_layers],
                         fmt, device, [layout.layers[i].kv_shared for i in layout.sliding_layers])


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # one page of token ids (empty at the root)
    parent: Node | None
    full_page: int | None  # None for models without full layers
    window_page: int | None  # None when this page's sliding KV is not held
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    state: int | None = None  # recurrent-state checkpoint after this node's last token
    lock: int = 0  # running requests whose prefix passes through this node
    last_access: int = 0


@dataclass
class Match:
    node: Node  # deepest node of the restorable prefix (root: none)
    num_tokens: int  # cached tokens that need no recompute
    full_pages: list[int]
    window_pages: list[int | None]
    state: int | None = None  # the checkpoint to restore (models with recurrent layers)


class PrefixCache:
    def __init__(self, page_size: int, window: int, has_full: bool = False,
                 has_sliding: bool = False, full_alloc: PageAllocator | None = None,
                 window_pool: WindowPagePool | None = None,
                 state_alloc: PageAllocator | None = None):
        self.page_size = page_size
        self.window = window
        self.has_full, self.has_sliding = has_full, has_sliding
        self.full_alloc = full_alloc
        self.window_pool = window_pool
        # recurrent-state checkpoints (one "page" of this allocator each), and the nodes
        # that hold one
        self.state_alloc = state_alloc
        self.has_state = state_alloc is not None
        self._stateful: set[Node] = set()
        self.root = Node((), None, None, None)
        self._clock = itertools.count(1)
        # (last_access, order, node) of nodes that may be evictable leaves (module docstring)
        self._lru: list[tuple[int, int, Node]] = []
        self._order = itertools.count()
        self.num_nodes = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- lookup ----------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> Match:
        """Longest cached prefix of `tokens` that can be restored exactly: full pages for all
        of it and window pages for the W positions before its end."""
        p = self.page_size
        path: list[Node] = []
        node = self.root
        for i in range(len(tokens) // p):
            child = node.children.get(tuple(tokens[i * p:(i + 1) * p]))
            if child is None:
                break
            path.append(child)
            node = child
        best = len(path)
        if self.has_sliding:
            need = -(-self.window // p)  # pages of window before the hit point
            best = next((n for n in range(best, 0, -1) if all(
                path[j].window_page is not None for j in range(max(0, n - need), n))), 0)
        if self.has_state:  # back off to the deepest checkpoint
            best = next((n for n in range(best, 0, -1) if path[n - 1].state is not None), 0)
        now = next(self._clock)
        for n in path[:best]:
            n.last_access = now
        hit = path[:best]
        if hit:
            self._offer(hit[-1])
        return Match(hit[-1] if hit else self.root, best * p,
                     [n.full_page for n in hit] if self.has_full else [],
                     [n.window_page for n in hit], hit[-1].state if hit else None)

    def has_state_at(self, tokens: list[int]) -> bool:
        """Whether the node of the whole pages `tokens` exists and holds a checkpoint."""
        p, node = self.page_size, self.root
        for i in range(len(tokens) // p):
            node = node.children.get(tuple(tokens[i * p:(i + 1) * p]))
            if node is None:
                return False
        return node is not self.root and node.state is not None

    def lock(self, node: Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            if node.lock < 0:
                raise RuntimeError("prefix cache: node unlocked more than locked")
            if node.lock == 0:
                self._offer(node)
            node = node.parent

    # -- insertion -------------------------------------------------------------------------
    def insert(self, tokens: list[int], full_pages: list[int],
               window_pages: list[int | None], states: dict[int, int] | None = None) -> Node:
        """Cache the whole pages of `tokens`; `states` maps a number of pages to the
        checkpoint of the state after them. The tree takes its own references; pages and
        checkpoints a node already holds are kept (the caller's duplicates stay the
        caller's)."""
        p = self.page_size
        n_pages = len(tokens) // p
        node = self.root
        now = next(self._clock)
        for i in range(n_pages):
            key = tuple(tokens[i * p:(i + 1) * p])
            child = node.children.get(key)
            fp = full_pages[i] if self.has_full else None
            wp = window_pages[i] if i < len(window_pages) else None
            if child is None:
                if self.has_full:
                    self.full_alloc.incref([fp])
                if wp is not None:
                    self.window_pool.allocator.incref([wp])
                child = Node(key, node, fp, wp)
                node.children[key] = child
                self.num_nodes += 1
            elif child.window_page is None and wp is not None:
                self.window_pool.allocator.incref([wp])
                child.window_page = wp
            st = states.get(i + 1) if states else None
            if st is not None and child.state is None:
                self.state_alloc.incref([st])
                child.state = st
                self._stateful.add(child)
            child.last_access = now
            node = child
        self._offer(node)
        return node

    # -- eviction --------------------------------------------------------------------------
    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root and n.lock == 0:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, full_pages: int = 0, window_pages: int = 0) -> bool:
        """Evict unlocked leaves, least recently used first, until `full_pages` full-pool
        pages and `window_pages` window pages are free. False if it cannot get there."""
        def short() -> bool:
            f = self.full_alloc is not None and self.full_alloc.num_free < full_pages
            w = self.window_pool is not None and self.window_pool.allocator.num_free < window_pages
            return f or w

        while short():
            if not self._lru:
                return False
            access, _, node = heapq.heappop(self._lru)
            if node.last_access == access and self._evictable(node):
                self._remove(node)
        return True

    def evict_states(self, n: int) -> bool:
        """Drop the checkpoints of unlocked nodes, least recently used first, until `n`
        checkpoint slots are free (their nodes keep their pages). False if it cannot."""
        while self.state_alloc.num_free < n:
            free = [x for x in self._stateful if x.lock == 0]
            if not free:
                return False
            self._drop_state(min(free, key=lambda x: x.last_access))
        return True

    def _drop_state(self, node: Node) -> None:
        self.state_alloc.decref([node.state])
        node.state = None
        self._stateful.discard(node)

    def _evictable(self, node: Node) -> bool:
        """An unlocked leaf still in the tree."""
        parent = node.parent
        return (parent is not None and parent.children.get(node.tokens) is node
                and not node.children and node.lock == 0)

    def _offer(self, node: Node) -> None:
        """`node` may have become an evictable leaf: onto the heap with its last access."""
        if node is self.root or not self._evictable(node):
            return
        heapq.heappush(self._lru, (node.last_access, next(self._order), node))
        if len(self._lru) > 2 * self.num_nodes + 64:  # mostly stale: start over from the tree
            self._lru = [(n.last_access, next(self._order), n) for n in self._leaves()]
            heapq.heapify(self._lru)

    def evict_all(self) -> None:
        self._lru = []  # every node goes: no entry would hold
        while True:
            leaves = self._leaves()
            if not leaves:
                return
            for leaf in leaves:
                self._remove(leaf)

    def _remove(self, node: Node) -> None:
        if node.full_page is not None:
            self.full_alloc.decref([node.full_page])
        if node.window_page is not None:
            self.window_pool.allocator.decref([node.window_page])
        if node.state is not None:
            self._drop_state(node)
        del node.parent.children[node.tokens]
        self.num_nodes -= 1
        self._offer(node.parent)

    def references(self) -> tuple[dict[int, int], dict[int, int]]:
        """Pages the tree holds (full, window) -> count, for integrity checks."""
        full: dict[int, int] = {}
        win: dict[int, int] = {}
        for n in self.nodes():
            if n.full_page is not None:
                full[n.full_page] = full.get(n.full_page, 0) + 1
            if n.window_page is not None:
                win[n.window_page] = win.get(n.window_page, 0) + 1
        return full, win

    def state_references(self) -> dict[int, int]:
        """Checkpoints the tree holds -> count (1 each), for integrity checks."""
        held: dict[int, int] = {}
        for n in self.nodes():
            if n.state is not None:
                held[n.state] = held.get(n.state, 0) + 1
        if set(self._stateful) != {n for n in self.nodes() if n.state is not None}:
            raise AssertionError("prefix cache: the checkpoint set is not the nodes with one")
        return held

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
