"""The postprocess stage of a step: each sampled token to its request (engine/output.py:
detokenizing, stop checks, grammar advance), n > 1 siblings forked from a prompt that just
completed, a drafted seq's tokens kept while they equal its draft, and prompt logprobs.

What raises for one request here fails that request only (ForkGroups.fail: with the
siblings that wait for it); the other requests of the step get their tokens as if nothing
had happened.
"""

from __future__ import annotations

import logging
import time

from swaserve.engine.forks import ForkGroups
from swaserve.engine.output import OutputProcessor
from swaserve.engine.request import FinishReason, Request, RequestError
from swaserve.engine.sample_stage import Owners
from swaserve.engine.scheduler import Batch, ScheduledSeq, Scheduler
from swaserve.engine.speculative import NgramSpeculator
from swaserve.memory.kv_cache import KVCache
from swaserve.models.context import PromptScore
from swaserve.profile import timed
from swaserve.sampling.output import SamplerOutput

log = logging.getLogger("swaserve")


class Postprocessor:
    def __init__(self, scheduler: Scheduler, cache: KVCache, output: OutputProcessor,
                 speculator: NgramSpeculator | None, forks: ForkGroups):
        self.scheduler = scheduler
        self.cache = cache
        self.output = output
        self.speculator = speculator
        self.forks = forks

    @timed("postprocess")
    def run(self, batch: Batch, owners: Owners, out: SamplerOutput,
            failed: dict[int, BaseException] | None = None) -> list[Request]:
        """Hand each sampled token to its request; returns the requests that gained a token,
        finished or failed. What raises for one request (or failed for it before: `failed`,
        `out.failed`, by sampler row) fails that request only."""
        for s in batch.seqs:
            s.request.in_flight -= 1
            if s.sample:
                s.request.num_pending -= 1
        self.scheduler.release_deferred()
        failed = {**(failed or {}), **out.failed}
        tokens = out.tokens.tolist()  # the one host sync of the step
        entry = _Logprobs(out).entry
        # forks first: a parent that finishes on this token frees the row its siblings copy
        self._fork_siblings(owners, failed)
        drafted = {id(s.request): s for s in batch.seqs if s.draft}
        changed = []
        now = time.monotonic()
        j = 0
        while j < len(owners):
            req = owners[j][1]
            seq = drafted.pop(id(req), None)  # its rows: the decode token's, then the draft's
            block = range(j, j + 1 + (len(seq.draft) if seq is not None else 0))
            j = block.stop
            if req.is_finished:  # it stopped while this step computed it: a surplus token
                continue
            changed.append(req)
            n_lp = req.params.logprobs or 0
            bad = next((i for i in block if i in failed), None)
            if bad is not None:
                self.fail_alone(req, failed[bad])
                continue
            try:
                if seq is not None:
                    self._accept_draft(req, seq, [tokens[i] for i in block],
                                       [entry(i, tokens[i], n_lp) for i in block], now)
                    continue
                if not req.output_token_ids and req.row is not None:
                    self.scheduler.on_prompt_done(req)
                if req.max_new_tokens == 0:  # the prompt was all it asked for
                    self.scheduler.finish(req, FinishReason.LENGTH)
                    continue
                tok = tokens[block.start]
                self.output.accept(req, tok, entry(block.start, tok, n_lp), now)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.fail_alone(req, e)
        for req in batch.retracted:
            log.debug("retracted %s (preemption %d)", req.request_id, req.num_preemptions)
        return changed

    def _fork_siblings(self, owners: Owners, failed: dict[int, BaseException]) -> None:
        """Fork each sibling that shares its parent's logits row (SampleStage.rows) and did
        not fail; one that cannot be forked fails alone (`failed`)."""
        parent_of: dict[int, Request] = {}
        for j, (i, req) in enumerate(owners):
            if i not in parent_of:
                parent_of[i] = req
            elif j not in failed:
                try:
                    self._fork(parent_of[i], req)
                except Exception as e:  # noqa: BLE001 - this sibling fails alone
                    failed[j] = e

    def prompt_logprobs(self, score: PromptScore,
                        scored: list[tuple[Request, int, int]]) -> None:
        """Hand each scored prompt row's logprobs to its request (by position: a prompt
        recomputed after a retraction writes the same entries again)."""
        chosen, top_lp, top_ids = (score.logprobs.tolist(), score.top_logprobs.tolist(),
                                   score.top_ids.tolist())
        targets = score.targets.tolist()
        k = 0
        for req, start, count in scored:
            try:
                n = req.params.prompt_logprobs
                for i in range(k, k + count):
                    entry = {targets[i]: chosen[i]}
                    for t, v in zip(top_ids[i][:n], top_lp[i][:n]):
                        entry.setdefault(t, v)
                    req.prompt_logprobs[start + 1 + i - k] = entry
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.fail_alone(req, e)
            k += count

    def fail_alone(self, req: Request, err: BaseException) -> None:
        log.error("request %s failed: %s: %s", req.request_id, type(err).__name__, err,
                  exc_info=err)
        self.forks.fail(req, RequestError(f"processing this request failed: "
                                    f"{type(err).__name__}: {err}"))

    def _accept_draft(self, req: Request, seq: ScheduledSeq, tokens: list[int],
                      entries: list[dict[int, float] | None], now: float) -> None:
        """Keep the sampled tokens of a drafted seq up to the first that differs from its
        draft, and that one: each was sampled as if the draft before it was accepted, which
        it was. The KV of the positions after is forgotten (KVCache.discard)."""
        draft, accepted = seq.draft, 0
        for i, tok in enumerate(tokens):
            req.num_computed_tokens = seq.start + i + 1  # position start + i had the right input
            self.output.accept(req, tok, entries[i], now)
            hit = i < len(draft) and tok == draft[i]
            accepted += hit
            if req.is_finished or not hit:
                break
        self.speculator.record(req, len(draft), accepted)
        if not req.is_finished:
            self.cache.discard(req.row, req.num_computed_tokens, seq.start + seq.num_tokens)

    def _fork(self, parent: Request, child: Request) -> None:
        """Give an n>1 sibling the parent's prompt KV: shared full pages, copied rings."""
        self.forks.forked(parent, child)
        row = self.cache.fork_row(parent.row, parent.num_prompt_tokens)
        if row is not None:
            child.row = row
            child.num_computed_tokens = parent.num_prompt_tokens
            self.scheduler.start_running(child)
        else:  # no free row or page now: it prefills on its own later (same tokens, slower)
            self.scheduler.enqueue(child)


class _Logprobs:
    """A step's sampled logprobs, read back to the host once."""

    def __init__(self, out: SamplerOutput):
        self.pos = {row: j for j, row in enumerate(out.logprob_rows)}
        self.chosen = out.chosen_logprob.tolist() if out.chosen_logprob is not None else None
        self.top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        self.top_ids = out.top_ids.tolist() if out.top_ids is not None else None

    def entry(self, j: int, tok: int, n: int) -> dict[int, float] | None:
        """Sampler row j's logprobs: the chosen token's and the top n."""
        if self.chosen is None or j not in self.pos:
            return None
        k = self.pos[j]
        out = {tok: self.chosen[k]}
        if self.top_ids is not None:
            for t, v in zip(self.top_ids[k][:n], self.top_lp[k][:n]):
                out.setdefault(t, v)
        return out
