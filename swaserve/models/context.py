"""ForwardContext: everything one forward pass needs to know about its batch, built once per
step by the model runner and passed explicitly to every layer.

Tokens of the batch are flattened into `[T]`: decode rows first (one query each, attended as
one padded group), then each prefill chunk as its own group. For every group and cache kind
(full / sliding) a `KeyView` says where the keys come from and which ones each query sees.
What each pool of per-request state takes of the step is its view in `ForwardContext.pools`,
keyed by the pool's kind (memory/pool.py `Pool.kind`): a model reads the view of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swaserve.memory.state_pool import StatePool


@dataclass
class KeyView:
    """Keys one attention group reads from one kind of cache.

    fresh: read the chunk's own new K/V (a prefill starting at position 0), no cache gather.
    key_slots: [B, L] cache slots to gather (None when fresh).
    ring_rows: [B] when key_slots[b] is the first L slots of ring row b (copied as blocks).
    mask: bool [B, 1, Nq, L] (True = attend), or None with `causal` for plain causal.
    """

    fresh: bool
    causal: bool
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None
    ring_rows: torch.Tensor | None = None  # key_slots are the first L slots of these rings
    first_row: int | None = None  # ring_rows are first_row, first_row + 1, ... (no copy needed)

    def check(self, num_queries: int) -> None:
        if self.mask is None:
            return
        width = self.mask.shape[-1]
        keys = self.key_slots.shape[-1] if self.key_slots is not None else num_queries
        if width != keys:
            raise AssertionError(f"mask width {width} != keys returned {keys}")


@dataclass
class AttnGroup:
    start: int  # first query token in the flattened batch
    batch: int  # sequences in the group
    num_queries: int  # queries per sequence
    full: KeyView | None
    sliding: KeyView | None
    decode: bool = False  # decode rows (one new token each), not a prompt's

    @property
    def end(self) -> int:
        return self.start + self.batch * self.num_queries


@dataclass
class PromptScore:
    """Prompt rows to score (prompt logprobs): the forward fills `logprobs` with the
    log-probability of each row's next prompt token and `top_logprobs` / `top_ids` with the
    `top_n` most likely ones, computing the log-softmax a few rows at a time so that a long
    prompt never holds a [rows, vocab] matrix."""

    indices: torch.Tensor  # [R] rows of the flattened batch
    targets: torch.Tensor  # [R] the prompt token that follows each row
    top_n: int
    logprobs: torch.Tensor | None = None  # float32 [R]
    top_logprobs: torch.Tensor | None = None  # float32 [R, top_n]
    top_ids: torch.Tensor | None = None  # int64 [R, top_n]


@dataclass
class RecurrentSeq:
    """A run of consecutive tokens of one request that a recurrent layer takes in order,
    starting from the state in `slot`, leaving its state there at the end."""

    start: int  # first token in the flattened batch
    num_tokens: int
    slot: int  # the request row's state slot
    # a drafted decode: the slot for the state after each of its tokens but the last
    snapshots: list[int] | None = None
    # prefix-cache checkpoints inside the run: (tokens taken in, < num_tokens, slot)
    saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RecurrentBatch:
    """What recurrent layers (Qwen3.5's Gated DeltaNet) read and write in a step: the state
    pool, the one-token runs (decodes, one-token chunks) as one batch, the longer runs one
    by one, and slot copies each layer makes once its state is written (checkpoints taken
    at a run's end: dst <- src)."""

    pool: StatePool
    single_tokens: torch.Tensor | None  # [B] rows of the flattened batch
    single_slots: torch.Tensor | None  # [B] their state slots
    seqs: list[RecurrentSeq]
    after: tuple[torch.Tensor, torch.Tensor] | None = None  # (dst slots, src slots)


@dataclass
class SlotWrites:
    """Where a pool of KV takes the step's new tokens: its slots, one per token of the
    flattened batch, and (the window pool's prefix-cache pages) the token indices and page
    slots it also writes them through to."""

    slots: torch.Tensor  # [T]
    pages: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class KeyedRows:
    """Logits rows whose token is the keyed Gumbel-max of their logits at a temperature, and
    nothing else of them is read (sampling/rows.py `keyed_rows`): the token is
    argmax_t float32(logit_t / temperature) + g(prefix, t), g from kernels/murmur.py."""

    rows: list[int]  # increasing
    temperature: torch.Tensor  # float32 [R], > 0
    prefix: torch.Tensor  # int64 [R]: murmur.row_prefix of each row's seed and position


PoolView = SlotWrites | RecurrentBatch


@dataclass
class ForwardContext:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    groups: list[AttnGroup]
    logits_indices: torch.Tensor  # [S] rows of the flattened batch whose logits are sampled
    # each pool's view of the step by pool kind: "full" and "window" SlotWrites, "state" a
    # RecurrentBatch; absent where the model has no such pool, and every one in an encoder
    # forward (its groups are whole prompts that keep nothing)
    pools: dict[str, PoolView] = field(default_factory=dict)
    # batch-invariant mode: matmuls in blocks of at most this many rows (layers.linear)
    row_block: int | None = None
    # the int8 kernel (Q8Weight.matmul): None picks by row count (pure decode steps);
    # q8.prompt_kernel() ("amx", without AMX "dpbf16") for steps with prompt rows, so that
    # a prompt's rows multiply the same way in any chunk (a prefix hit recomputes a short
    # tail of what a cold run did in one chunk)
    q8_kernel: str | None = None
    score: PromptScore | None = None  # prompt rows whose logprobs are asked for
    # every sampled row is plain greedy (no edits, no logprobs), one row per logits row:
    # the LM head may return their argmaxes for the logits (models/head.py, ARGMAXES)
    argmax_only: bool = False
    # some rows are plain greedy and some are not, one row per logits row: the greedy ones
    # (logits rows, increasing); the head may return their tokens beside the others' logits
    # (SPLIT)
    argmax_rows: list[int] | None = None
    # rows that sample by a temperature alone with keyed noise, one row per logits row: the
    # head may return their tokens too (SPLIT) where it finds them without their logits
    keyed: KeyedRows | None = None

    def view(self, kind: str) -> PoolView | None:
        """The step's view of the pool of `kind`, None where there is none."""
        return self.pools.get(kind)
