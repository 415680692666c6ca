"""An engine's step loop: a step is scheduled, prepared and handed to the forward
(`_launch`), then read back and postprocessed (`_finish`); with overlap scheduling the
next step is launched while the one in flight is finished (engine/engine.py says when).
A step that raises (`fail`) fails its requests and leaves the pools whole.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from swaserve.engine.forks import ForkGroups
from swaserve.engine.launch import Launched, LogitsLog, StepCompute, head_hints, run_now
from swaserve.engine.postprocess import Postprocessor
from swaserve.engine.request import Request, RequestError
from swaserve.engine.runner import ModelRunner
from swaserve.engine.sample_stage import SampleStage
from swaserve.engine.scheduler import Batch, Scheduler
from swaserve.engine.speculative import NgramSpeculator
from swaserve.engine.stats import StepStats
from swaserve.memory.kv_cache import KVCache, KVLost
from swaserve.sampling.rows import has_penalty

log = logging.getLogger("swaserve")


class SteppedModel(Protocol):
    """What the loop asks of the model the backend runs."""

    draws_keyed_rows: bool

    def same_numerics_rows(self, rows: int) -> int: ...


@dataclass(frozen=True)
class StepParts:
    """The stages and state a step loop drives, built once by the engine."""

    scheduler: Scheduler
    cache: KVCache
    model: SteppedModel
    device: torch.device
    runner: ModelRunner  # a batch to the forward's inputs
    sample_stage: SampleStage
    compute: StepCompute  # a step's forward and sampling
    post: Postprocessor
    forks: ForkGroups
    speculator: NgramSpeculator | None
    speculative_max_rows: int
    check_integrity: Callable[[], None]  # the pools and every request, after a failed step


class StepLoop:
    """The steps of one engine: the one in flight (with overlap), those launched and not
    postprocessed yet, the batch being prepared, and the last step's figures."""

    def __init__(self, parts: StepParts, overlap: bool):
        self.parts = parts
        self.overlap = overlap
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="swaserve-forward")
                       if overlap else None)
        self.inflight: Launched | None = None
        self.open: list[Launched] = []  # launched steps not postprocessed yet
        self.scheduling: Batch | None = None  # the batch being prepared, until launched
        self.last_step: StepStats | None = None  # None: the last step had nothing to run
        # diagnostics: when a list, every sampled logits row is appended as
        # (request_id, position, float32 logits); tests compare them to a reference
        self.logits_log: LogitsLog | None = None

    def step(self) -> list[Request]:
        return self._overlap_step() if self.overlap else self._plain_step()

    def _plain_step(self) -> list[Request]:
        """Schedule and prepare a step, compute it, read it back, postprocess."""
        t0 = time.perf_counter()
        step = self._launch(None)
        if step is None:
            self.last_step = None
            return []
        return self._finish(step, t0)

    def _overlap_step(self) -> list[Request]:
        """Finish the step in flight while the next one computes: the next is launched
        first (chained on this one's device tokens when no row needs them on the host),
        else right after this one is read back."""
        t0 = time.perf_counter()
        step, self.inflight = self.inflight, None
        if step is None:
            step = self._launch(None)
            if step is None:
                self.last_step = None
                return []
        if step.chain_safe:
            self.inflight = self._launch(step)
        changed = self._finish(step, t0)
        if self.inflight is None:
            self.inflight = self._launch(None)  # computes while the caller streams these
        return changed

    def _finish(self, step: Launched, t0: float) -> list[Request]:
        e = self.parts
        out, forward_s, sample_s = step.wait()
        if step.scored:
            e.post.prompt_logprobs(step.score, step.scored)
        seqs = step.batch.seqs
        # what a token costs in decode steps with drafts and without (speculative.CostGate)
        gated = e.speculator is not None and all(s.num_known == 1 for s in seqs)
        before = sum(s.request.num_output_tokens for s in seqs) if gated else 0
        changed = e.post.run(step.batch, step.owners, out, step.failed)
        self.open.remove(step)
        self.last_step = StepStats(step.batch.num_tokens, len(seqs),
                                time.perf_counter() - t0, forward_s, sample_s)
        if gated:
            e.speculator.gate.observe(
                len(seqs), any(s.draft for s in seqs), self.last_step.seconds,
                sum(s.request.num_output_tokens for s in seqs) - before)
        return changed

    def fail(self, err: Exception) -> list[Request]:
        """Fail the requests of the steps that were being built or computed, once nothing
        computes any more, and check that the pools are whole again."""
        e = self.parts
        log.error("engine step failed, failing its requests: %s", err, exc_info=err)
        launched, self.open, self.inflight = self.open, [], None
        for step in launched:  # nothing may still write into memory that is freed below
            try:
                step.wait()
            except Exception:  # noqa: BLE001, S110 - the failure is being handled
                pass
        seqs = [s for step in launched for s in step.batch.seqs]
        if self.scheduling is not None:
            seqs += self.scheduling.seqs
        found = [s.request for s in seqs] + [r for step in launched for _, r in step.owners]
        if (self.scheduling is None and not launched) or isinstance(err, KVLost):
            found += e.scheduler.running  # it broke inside schedule(), or all KV is gone
        reqs = list({id(r): r for r in found}.values())
        self.scheduling = None
        error = RequestError(f"the engine step computing this request failed: "
                             f"{type(err).__name__}: {err}")
        for req in reqs:
            req.in_flight = req.num_pending = 0
            e.forks.fail(req, error)
        e.scheduler.release_deferred()
        if isinstance(err, KVLost):
            e.cache.evict_all()
        e.check_integrity()  # raises if the pools could not be made whole: the engine dies
        self.last_step = StepStats(0, len(reqs), 0.0, 0.0, 0.0)  # it ended them: not stalled
        return reqs

    def _launch(self, prev: Launched | None) -> Launched | None:
        """Schedule and prepare a step and hand it to the forward. `prev` is the step still
        in flight, whose sampled tokens are this step's decode inputs."""
        e = self.parts
        batch = e.scheduler.schedule(can_retract=prev is None, drafts=self._drafts(),
                                     max_decode_rows=self._max_decode_rows)
        if not batch.seqs:
            return None
        self.scheduling = batch
        pending = None
        if prev is not None:
            pending = {req.request_id: j for j, (_, req) in enumerate(prev.owners)}
        prepared = e.runner.prepare(batch, pending)
        rows, owners, failed = e.sample_stage.rows(prepared.sampled)
        if self.logits_log is None and len(owners) == len(prepared.ctx.logits_indices):
            head_hints(prepared.ctx, rows, e.device, e.model.draws_keyed_rows)
        for s in batch.seqs:  # a draft's positions count once accepted (postprocess)
            s.request.num_computed_tokens += s.num_known
            s.request.in_flight += 1
        for s in prepared.sampled:
            s.request.num_pending += 1
        chain_safe = self.overlap and not batch.blocked and all(
            self._chains(s.request) and not s.draft for s in prepared.sampled)
        compute = functools.partial(e.compute, prepared, rows, owners,
                                    prev.result if prev is not None else None,
                                    [s.request for s in batch.seqs], self.logits_log)
        result = self.worker.submit(compute) if self.worker is not None else run_now(compute)
        launched = Launched(batch, owners, result, chain_safe, failed, prepared.scored,
                            prepared.ctx.score)
        self.open.append(launched)
        self.scheduling = None
        return launched

    def _drafts(self) -> dict[str, list[int]] | None:
        speculator = self.parts.speculator
        if speculator is None:
            return None
        try:
            return speculator.drafts(self.parts.scheduler.running)
        except Exception as e:  # noqa: BLE001 - drafts only save time: go on without
            log.error("speculative drafts failed, this step has none: %s", e, exc_info=e)
            return None

    def _max_decode_rows(self, decodes: int) -> int:
        """Rows a decode step of `decodes` seqs may grow to with drafts: each row keeps the
        kernel it would take without them."""
        e = self.parts
        return min(e.speculative_max_rows, e.model.same_numerics_rows(decodes))

    def _chains(self, req: Request) -> bool:
        """Can the step after this one be built before this one's token is read back?"""
        p = req.params
        return (req.grammar is None and not p.stop and not has_penalty(p)
                and not self.parts.forks.waiting(req))
