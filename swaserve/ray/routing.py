"""Where a request should go among engine replicas: the policy, free of Ray so that it is
tested as plain Python (router.py plugs it into Ray Serve's request router).

A prompt is summarized as a chain of block hashes over its text: block i's hash covers
everything up to the end of block i, so two prompts share their first k hashes exactly when
they share their first k blocks of text. The router remembers which blocks it sent to which
replica (`PrefixIndex`, bounded per replica, least recently sent forgotten first): a replica
that was sent a prompt's blocks most likely still holds their KV in its prefix cache.
`choose` weighs that against load: the replica with the longest match wins unless it is much
busier than the least-loaded one, and a prompt nobody has seen goes to the least-loaded
replica (the one holding the fewest blocks among equals, so new conversations spread).

Text, not tokens: the router would otherwise need the tokenizer and the chat template, and
a shared text prefix is a shared token prefix up to the last few tokens of the match.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping

BLOCK_CHARS = 128  # ~32 tokens of English: a couple of the engine's 16-token pages
MAX_BLOCKS = 1024  # prompts are summarized up to 128 K characters
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# the holder of a prefix is "much busier" past max(IMBALANCE, IMBALANCE_RATIO * least load)
# requests more than the least-loaded replica: a miss costs one prefill, a queue that long
# costs every request in it a share of the steps
IMBALANCE = 8
IMBALANCE_RATIO = 1.0


def prompt_text(body: Mapping) -> str | None:
    """The part of a completion or chat body that becomes the prompt's start, as one
    string: the prompt (text or token ids), or each message's role and content in order.
    None when the body has neither (the request then routes by load alone)."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if isinstance(m, Mapping):
                content = m.get("content")
                if not isinstance(content, str):  # parts, tool calls: their JSON is as stable
                    content = json.dumps(content, sort_keys=True, ensure_ascii=False)
                parts.append(f"<{m.get('role')}>{content}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # token ids: a text of them
            return " ".join(str(t) for t in prompt)
        if isinstance(first, str):  # several prompts: route by the first
            return first
        if isinstance(first, list):
            return " ".join(str(t) for t in first)
    return None


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS,
                  max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of the text's whole blocks (a final partial block is left out: the
    next turn of a conversation extends it, so it would not match anyway)."""
    h = hashlib.blake2b(digest_size=8)
    out = []
    for i in range(min(len(text) // block_chars, max_blocks)):
        h.update(text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass"))
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


def request_blocks(path: str, body: bytes) -> list[int]:
    """The prefix blocks of a forwarded HTTP request ([] for any other route, or a body that
    is not a JSON object: the replica answers those, with the error they deserve)."""
    if path not in GENERATION_PATHS:
        return []
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    text = prompt_text(parsed) if isinstance(parsed, dict) else None
    return prefix_blocks(text) if text else []


class PrefixIndex:
    """Which blocks were sent to which replica, at most `max_blocks` per replica."""

    def __init__(self, max_blocks: int = 200_000):
        self.max_blocks = max_blocks
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def insert(self, blocks: Iterable[int], replica: Hashable) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for b in blocks:
            held[b] = None
            held.move_to_end(b)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def match(self, blocks: list[int], replica: Hashable) -> int:
        """How many leading blocks the replica was sent (chained hashes: the last block
        it holds implies the ones before it)."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i] in held:
                return i + 1
        return 0

    def size(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def remove(self, replica: Hashable) -> None:
        self._blocks.pop(replica, None)


def choose(blocks: list[int], loads: Mapping[Hashable, int], index: PrefixIndex,
           imbalance: int = IMBALANCE, imbalance_ratio: float = IMBALANCE_RATIO
           ) -> list[Hashable]:
    """Replicas in the order they should be tried. The longest match comes first unless its
    load exceeds the least load by more than max(imbalance, imbalance_ratio * least load);
    then, and for a prompt nobody holds, the least-loaded replica (ties: fewest blocks held,
    then chance, so that short prompts do not all go to one idle replica)."""
    if not loads:
        return []
    by_load = sorted(loads, key=lambda r: (loads[r], index.size(r), random.random()))
    least = loads[by_load[0]]
    if blocks:
        matched = {r: index.match(blocks, r) for r in loads}
        best = max(by_load, key=lambda r: matched[r])  # max keeps the first of equals
        if matched[best] and loads[best] - least <= max(imbalance, imbalance_ratio * least):
            return [best] + [r for r in by_load if r != best]
    return by_load
