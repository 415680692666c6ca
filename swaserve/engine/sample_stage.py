"""The sampling stage of a step: sampler rows for the sampled seqs (and the n > 1 siblings
waiting on a prompt), grammar masks, and sampling that keeps a row's fault to its request.

If the batch's masks or sampling raise, they are redone row by row and the rows that still
raise are reported as failed; the others get the tokens they would have got anyway (every
row is a pure function of its logits: rows without a seed get one when the rows are built).
"""

from __future__ import annotations

import logging

import torch

from swaserve.engine.faults import FaultInjector
from swaserve.engine.forks import ForkGroups
from swaserve.engine.request import Request
from swaserve.engine.scheduler import ScheduledSeq
from swaserve.memory.kv_cache import KVLost
from swaserve.models.head import HeadOutput
from swaserve.profile import timed
from swaserve.sampling.grammar import mask_biases, mask_biases_along
from swaserve.sampling.output import SamplerOutput
from swaserve.sampling.rows import SamplerRow
from swaserve.sampling.sampler import Sampler

log = logging.getLogger("swaserve")

Owners = list[tuple[int, Request]]  # per sampler row: (its logits row, its request)


class SampleStage:
    def __init__(self, sampler: Sampler, vocab_size: int, device: torch.device,
                 eos_token_ids: frozenset[int], faults: FaultInjector,
                 forks: ForkGroups | None = None):
        """`faults`: a test hook (engine/faults.py); `forks`: the engine's n > 1 groups
        (None: a stage used alone, whose seqs have no siblings)."""
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.faults = faults
        self.forks = forks

    def _check(self, stage: str, reqs: list[Request]) -> None:
        self.faults.check(stage, (r.request_id for r in reqs))

    @timed("sampler rows + grammar masks")
    def rows(self, sampled: list[ScheduledSeq]
             ) -> tuple[list[SamplerRow], Owners, dict[int, BaseException]]:
        """One sampler row per sampled seq, plus one per waiting n>1 sibling of a seq whose
        prompt just completed (they share its logits row), plus one per draft token (the
        row after it, as if the draft so far were accepted: its penalties count those
        tokens, its grammar mask follows them); and the rows whose grammar mask failed
        (they are sampled unmasked and their requests fail)."""
        rows, owners, drafted = [], [], []
        logits_row = 0
        for s in sampled:
            req = s.request
            family = [req]
            if req.num_generated == 0 and self.forks is not None:
                family += self.forks.waiting(req)
            last = s.start + s.num_known - 1
            for r in family:
                rows.append(self._row(r, last))
                owners.append((logits_row, r))
            if s.draft:
                drafted.append((len(owners) - 1, s))
            for j in range(len(s.draft)):
                logits_row += 1
                rows.append(self._row(req, last + 1 + j, s.draft[:j + 1]))
                owners.append((logits_row, req))
            logits_row += 1
        failed: dict[int, BaseException] = {}
        along = {j for j0, s in drafted if s.request.grammar is not None
                 for j in range(j0, j0 + len(s.draft) + 1)}
        grammar_rows = [j for j, (_, r) in enumerate(owners)
                        if r.grammar is not None and j not in along]
        if grammar_rows:
            for j, bias in zip(grammar_rows, self._grammar_masks(owners, grammar_rows, failed)):
                rows[j].grammar_bias = bias
        for j0, s in drafted:
            if s.request.grammar is not None:
                self._draft_masks(rows, j0, s, failed)
        # seeds for the rows that sample without one, before the forward: the LM head may
        # draw keyed rows itself (ForwardContext.keyed)
        return self.sampler.keyed(rows), owners, failed

    def _row(self, req: Request, position: int, draft: list[int] = ()) -> SamplerRow:
        generated = req.num_generated + len(draft)
        suppress: list[int] = []
        if generated < req.params.min_tokens:
            # a grammar decides itself when the text may end
            if not req.params.ignore_eos and req.grammar is None:
                suppress = list(self.eos_token_ids)
            suppress += list(req.params.stop_token_ids or [])
        output = req.output_token_ids + list(draft) if draft else req.output_token_ids
        return SamplerRow(req.params, req.seed, position, req.prompt_token_ids, output, suppress)

    def _draft_masks(self, rows: list[SamplerRow], j0: int, s: ScheduledSeq,
                     failed: dict[int, BaseException]) -> None:
        """Grammar masks of a drafted seq's rows: at its state, then after each draft token."""
        span = range(j0, j0 + len(s.draft) + 1)
        try:
            self._check("grammar", [s.request])
            masks = mask_biases_along(s.request.grammar, s.draft, self.vocab_size, self.device)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            for j in span:
                failed[j] = e
            return
        for j, mask in zip(span, masks):
            rows[j].grammar_bias = mask

    def _grammar_masks(self, owners: Owners, idx: list[int],
                       failed: dict[int, BaseException]) -> list[torch.Tensor | None]:
        """The grammar rows' masks in one call, or row by row if that raises."""
        matchers = [owners[j][1].grammar for j in idx]
        try:
            self._check("grammar", [owners[j][1] for j in idx])
            return mask_biases(matchers, self.vocab_size, self.device)
        except Exception as e:  # noqa: BLE001 - find the row at fault
            log.warning("grammar masks for %d rows failed (%s); one by one", len(idx), e)
        masks: list[torch.Tensor | None] = []
        for j, m in zip(idx, matchers):
            try:
                self._check("grammar", [owners[j][1]])
                masks.append(mask_biases([m], self.vocab_size, self.device)[0])
            except Exception as e:  # noqa: BLE001 - this row's request fails alone
                failed[j] = e
                masks.append(None)
        return masks

    @timed("sampler")
    def sample(self, head: HeadOutput, rows: list[SamplerRow], owners: Owners
               ) -> SamplerOutput:
        """Sample the batch from what the LM head gave, or its rows one by one if that
        raises (`out.failed`)."""
        try:
            self._check("sampler", [r for _, r in owners])
            return self.sampler(head, rows)
        except KVLost:  # the step's forward failed with it: no row is at fault
            raise
        except Exception as e:  # noqa: BLE001 - find the row at fault
            log.warning("sampling a batch of %d failed (%s); sampling its rows one by one",
                        len(rows), e)
        parts: list[SamplerOutput | None] = []
        failed: dict[int, BaseException] = {}
        for j, ((_, req), row) in enumerate(zip(owners, rows)):
            try:
                self._check("sampler", [req])
                parts.append(self.sampler(head[j:j + 1], [row]))
            except Exception as e:  # noqa: BLE001 - this row's request fails alone
                failed[j] = e
                parts.append(None)
        return SamplerOutput.join(parts, failed, self.device)
