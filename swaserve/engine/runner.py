"""ModelRunner: turns a Batch into a ForwardContext over the KV cache and runs the model
(checkpoint/loading.py builds the model from a checkpoint; the engine builds the cache).

Masks come from positions: for full layers from each request's length, for sliding layers
from the positions the ring slots record (so a wrapped ring needs no special case). Where
the window cannot bind (`offset + N <= W`) sliding layers take the plain causal path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from swaserve.distributed.group import GroupBroken
from swaserve.engine.request import Request
from swaserve.engine.scheduler import Batch, ScheduledSeq
from swaserve.kernels import q8
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.window_pool import EMPTY
from swaserve.models.attention import SDPABackend
from swaserve.models.config import ModelConfig
from swaserve.models.context import (
    AttnGroup,
    ForwardContext,
    KeyView,
    PromptScore,
    RecurrentBatch,
    RecurrentSeq,
    SlotWrites,
)
from swaserve.models.head import HeadOutput
from swaserve.profile import timed

log = logging.getLogger("swaserve")

# batch-invariant mode: matmul row blocks, and the least key width of a decode row (torch's
# CPU flash attention splits keys in blocks of 512 from 512 keys on, of the whole width
# below, so a row padded past 512 in a batch would otherwise be summed differently)
INVARIANT_ROW_BLOCK = 32
INVARIANT_MIN_KEYS = 512


@dataclass
class PreparedBatch:
    ctx: ForwardContext
    sampled: list[ScheduledSeq]  # the seqs whose logits rows come out, in order
    # prompt rows scored (ctx.score), in order: (request, first position, rows)
    scored: list[tuple[Request, int, int]] = field(default_factory=list)
    # input tokens not on the host yet: (positions in ctx.input_ids, rows of the previous
    # step's sampled tokens); filled on the device just before the forward
    fill: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, cache: KVCache,
                 device: torch.device, batch_invariant: bool = False, tp=None):
        self.model = model
        self.tp = tp  # distributed.workers.TensorParallel: the other ranks run each forward too
        self.batch_invariant = batch_invariant
        self.cfg = cfg
        self.cache = cache
        self.device = device
        self.window = cache.layout.max_window
        model.attn = SDPABackend(cache)

    def _t(self, data) -> torch.Tensor:
        t = torch.tensor(data, dtype=torch.int64)
        if self.device.type == "cuda":
            # pinned + non_blocking: the copy queues behind the step in flight instead of
            # making the host wait for it, which would undo overlap scheduling
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @timed("prepare inputs")
    def prepare(self, batch: Batch, pending: dict[str, int] | None = None) -> PreparedBatch:
        """`pending` maps a request id to the row of the previous step's sampler output that
        holds its input token, for requests whose last token is not read back yet."""
        # decode rows in row order: consecutive rows read their rings as one strided view;
        # a speculative seq (a decode token and its draft) is decode rows of one row
        decodes = sorted((s for s in batch.seqs if s.num_tokens == 1 or s.draft),
                         key=lambda s: s.request.row)
        prefills = [s for s in batch.seqs if s.num_tokens > 1 and not s.draft]
        order = decodes + prefills
        ids, pos, rows, fill_dst, fill_src = self._inputs(order, pending)
        positions = self._t(pos)
        rows_t = self._t(rows)
        pools = self._pool_views(order, rows_t, positions)
        groups: list[AttnGroup] = []
        if decodes:
            groups.append(self._decode_group(decodes))
        start = sum(s.num_tokens for s in decodes)
        for s in prefills:
            groups.append(self._prefill_group(s, start))
            start += s.num_tokens
        sampled, logit_rows = [], []
        offset = 0
        for s in order:
            offset += s.num_tokens
            if s.sample:  # a draft's every row: each of its tokens is checked
                sampled.append(s)
                logit_rows.extend(range(offset - 1 - len(s.draft), offset))
        ctx = ForwardContext(self._t(ids), positions, groups, self._t(logit_rows), pools,
                             INVARIANT_ROW_BLOCK if self.batch_invariant else None,
                             q8.prompt_kernel() if prefills else None)
        scored = self._score_rows(order, ctx)
        fill = (self._t(fill_dst), self._t(fill_src)) if fill_dst else None
        return PreparedBatch(ctx, sampled, scored, fill)

    def _inputs(self, order: list[ScheduledSeq], pending: dict[str, int] | None
                ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """The step's token ids, positions and request rows, token by token; and where a
        decode's input is the previous step's sampled token (`fill_dst` in the ids, from
        `fill_src` in its sampler output), written on the device before the forward."""
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        for s in order:
            req, end = s.request, s.start + s.num_known
            if end > req.num_known_tokens:  # a decode of the token the step in flight samples
                assert s.num_tokens == 1 and pending is not None, "only a decode can chain"
                fill_dst.append(len(ids))
                fill_src.append(pending[req.request_id])
                ids.append(0)
            else:
                ids.extend(req.tokens(s.start, end))
            ids.extend(s.draft)
            pos.extend(range(s.start, s.start + s.num_tokens))
            rows.extend([s.request.row] * s.num_tokens)
        return ids, pos, rows, fill_dst, fill_src

    def _pool_views(self, order: list[ScheduledSeq], rows: torch.Tensor,
                    positions: torch.Tensor) -> dict[str, SlotWrites | RecurrentBatch]:
        """Each pool's view of the step (ForwardContext.pools): the full pool's and the
        rings' slots of the new tokens (with the window pages they are written through
        to), the recurrent layers' runs."""
        cache, views = self.cache, {}
        if cache.full is not None:
            views["full"] = SlotWrites(cache.rows.req_to_token[rows, positions])
        if cache.window is not None:
            ring_slots = rows * cache.window.ring + positions % cache.window.ring
            # record positions first: every sliding layer writes these slots before it reads
            cache.window.positions[ring_slots] = positions
            pages = self._window_write(order) if cache.window_pages is not None else None
            views["window"] = SlotWrites(ring_slots, pages)
        if cache.state is not None:
            views["state"] = self._recurrent(order)
        return views

    def _window_write(self, order: list[ScheduledSeq]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Paged sliding-window KV: the step's token indices and the page slots they are
        written to (the window pool's SlotWrites.pages), or None when no token writes one."""
        idx, wslots, offset = [], [], 0
        for s in order:
            offs, sl = self.cache.window.write_slots(s.request.row, s.start, s.num_tokens)
            idx.extend(offset + o for o in offs)
            wslots.extend(sl)
            offset += s.num_tokens
        return (self._t(idx), self._t(wslots)) if idx else None

    def _recurrent(self, order: list[ScheduledSeq]) -> RecurrentBatch:
        """The runs recurrent layers take this step: one-token seqs batched, the others
        (prompt chunks, drafted decodes) one by one, each from its row's state slot; a
        drafted decode gets a snapshot slot for the state after each of its tokens but the
        last (StatePool.select_draft keeps the accepted one). Every row's state must have
        taken in exactly the positions before its seq: it takes in the seq's now."""
        pool = self.cache.state
        singles, single_slots, seqs, after = [], [], [], []
        snap = pool.draft_base
        offset = 0
        for s in order:
            row = s.request.row
            if pool.consumed[row] != s.start:
                raise RuntimeError(f"{s.request.request_id}: row {row}'s recurrent state "
                                   f"has taken in {pool.consumed[row]} tokens, but the "
                                   f"step computes from position {s.start}")
            saves = []
            if not s.draft:  # prefix-cache checkpoints (none inside a drafted decode)
                req, end = s.request, s.start + s.num_tokens
                at = pool.checkpoint_positions(
                    lambda n, r=req: r.tokens(0, min(n, r.num_known_tokens)), s.start, end,
                    req.num_prompt_tokens, self.cache.checkpoint_interval)
                for pos, slot in pool.take_checkpoints(row, at) if at else ():
                    if pos == end:
                        after.append((slot, row))
                    else:
                        saves.append((pos - s.start, slot))
            if s.num_tokens == 1:
                singles.append(offset)
                single_slots.append(row)
            elif s.draft:
                snaps = list(range(snap, snap + len(s.draft)))
                snap += len(s.draft)
                if snap > pool.draft_base + pool.draft_slots:
                    raise RuntimeError(f"state pool: {snap - pool.draft_base} draft "
                                       f"snapshots this step, room for {pool.draft_slots}")
                pool.drafts[row] = (s.start, snaps)
                seqs.append(RecurrentSeq(offset, s.num_tokens, row, snaps))
            else:
                seqs.append(RecurrentSeq(offset, s.num_tokens, row, saves=saves))
            pool.consumed[row] = s.start + s.num_tokens
            offset += s.num_tokens
        copies = (self._t([d for d, _ in after]), self._t([r for _, r in after])) if after else None
        return RecurrentBatch(pool, self._t(singles) if singles else None,
                              self._t(single_slots) if singles else None, seqs, copies)

    def _score_rows(self, order: list[ScheduledSeq], ctx: ForwardContext
                    ) -> list[tuple[Request, int, int]]:
        """Rows of prompts whose logprobs are asked for: position p is scored by the prompt
        token at p + 1 (the last prompt position's logits are the sampled row's)."""
        scored, idx, targets, top_n, offset = [], [], [], 0, 0
        for s in order:
            req = s.request
            end = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
            if req.prompt_logprobs is not None and end > s.start:
                scored.append((req, s.start, end - s.start))
                idx.extend(range(offset, offset + end - s.start))
                targets.extend(req.prompt_token_ids[s.start + 1:end + 1])
                top_n = max(top_n, req.params.prompt_logprobs)
            offset += s.num_tokens
        if scored:
            ctx.score = PromptScore(self._t(idx), self._t(targets), top_n)
        return scored

    def _decode_group(self, seqs: list[ScheduledSeq]) -> AttnGroup:
        """One padded group: every row has one query, at position `start` (a draft's rows
        at the positions after it, each seeing the keys written before it in this step)."""
        row_ids = [s.request.row for s in seqs for _ in range(s.num_tokens)]
        starts = [p for s in seqs for p in range(s.start, s.start + s.num_tokens)]
        b = len(row_ids)
        rows = self._t(row_ids)
        qpos = self._t(starts)
        lengths = qpos + 1
        lmax = max(starts) + 1
        if self.batch_invariant:  # every row's keys in the same blocks, alone or not
            lmax = max(lmax, min(INVARIANT_MIN_KEYS, self.cache.rows.req_to_token.shape[1]))
        full = sliding = None
        if self.cache.full is not None:
            keys = torch.arange(lmax, device=self.device)
            slots = self.cache.rows.req_to_token[rows, :lmax]
            same = all(p == starts[0] for p in starts) and not self.batch_invariant
            mask = None if same else (keys[None, :] < lengths[:, None]).view(b, 1, 1, lmax)
            full = KeyView(fresh=False, causal=False, key_slots=slots, mask=mask)
        if self.cache.window is not None:
            ring = self.cache.window.ring
            width = min(lmax, ring)  # rows shorter than the ring never wrapped: slot == pos
            slots = rows[:, None] * ring + torch.arange(width, device=self.device)[None, :]
            kpos = self.cache.window.positions[slots]
            q = qpos[:, None]
            mask = (kpos != EMPTY) & (kpos <= q) & (kpos > q - self.window)
            first = row_ids[0] if row_ids == list(range(row_ids[0], row_ids[0] + b)) else None
            sliding = KeyView(fresh=False, causal=False, key_slots=slots,
                              mask=mask.view(b, 1, 1, width), ring_rows=rows, first_row=first)
        group = AttnGroup(0, b, 1, full, sliding, decode=True)
        for view in (full, sliding):
            if view is not None:
                view.check(1)
        return group

    def _prefill_group(self, s: ScheduledSeq, start: int) -> AttnGroup:
        o, n, row = s.start, s.num_tokens, s.request.row
        qpos = torch.arange(o, o + n, device=self.device)
        full = sliding = None
        if self.cache.full is not None:
            if o == 0:
                full = KeyView(fresh=True, causal=True, key_slots=None, mask=None)
            else:
                slots = self.cache.rows.req_to_token[row, : o + n][None, :]
                kpos = torch.arange(o + n, device=self.device)
                mask = (kpos[None, :] <= qpos[:, None]).view(1, 1, n, o + n)
                full = KeyView(fresh=False, causal=False, key_slots=slots, mask=mask)
        if self.cache.window is not None:
            ring, w = self.cache.window.ring, self.window
            if o + n <= w:  # the window cannot bind: plain causal
                if o == 0:
                    sliding = KeyView(fresh=True, causal=True, key_slots=None, mask=None)
                else:
                    slots = (row * ring + torch.arange(o + n, device=self.device))[None, :]
                    kpos = torch.arange(o + n, device=self.device)
                    mask = (kpos[None, :] <= qpos[:, None]).view(1, 1, n, o + n)
                    sliding = KeyView(fresh=False, causal=False, key_slots=slots, mask=mask)
            elif o == 0:  # one shot longer than the window: banded mask over the fresh keys
                q = qpos[:, None]
                mask = (qpos[None, :] <= q) & (qpos[None, :] > q - w)
                sliding = KeyView(fresh=True, causal=False, key_slots=None, mask=mask.view(1, 1, n, n))
            else:
                slots = (row * ring + torch.arange(ring, device=self.device))[None, :]
                kpos = self.cache.window.positions[slots]
                q = qpos[:, None]
                mask = (kpos != EMPTY) & (kpos <= q) & (kpos > q - w)
                sliding = KeyView(fresh=False, causal=False, key_slots=slots, mask=mask.view(1, 1, n, ring))
        for view in (full, sliding):
            if view is not None:
                view.check(n)
        return AttnGroup(start, 1, n, full, sliding)

    @torch.inference_mode()
    def forward(self, prepared: PreparedBatch, prev_tokens: torch.Tensor | None = None
                ) -> HeadOutput:
        if prepared.fill is not None:
            dst, src = prepared.fill
            prepared.ctx.input_ids[dst] = prev_tokens[src]
        if self.tp is None:
            return self.model(prepared.ctx)
        self.tp.step(prepared.ctx, self.cache.take_copies())
        try:
            return self.model(prepared.ctx)
        except GroupBroken:
            raise
        except Exception as e:  # the other ranks are inside this forward's collectives:
            # failing only this step would leave them one collective out of step for good
            self.tp.group.broken = f"rank 0's forward raised {type(e).__name__}: {e}"
            raise GroupBroken(self.tp.group.broken) from e
