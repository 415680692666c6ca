"""A launched step: a scheduled and prepared batch handed to the forward.

`StepCompute` is the part of a step that runs on the forward's worker thread with overlap
scheduling (on the engine thread without): the forward, then the sampling. `Launched` holds
its result, or the Future of it, beside what postprocess needs of the step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from swaserve.engine.backend import Backend
from swaserve.engine.faults import FaultInjector
from swaserve.engine.request import Request
from swaserve.engine.runner import ModelRunner, PreparedBatch
from swaserve.engine.sample_stage import Owners, SampleStage
from swaserve.engine.scheduler import Batch
from swaserve.models.context import ForwardContext, PromptScore
from swaserve.sampling.output import SamplerOutput
from swaserve.sampling.rows import SamplerRow, keyed_rows, plain_greedy

StepResult = tuple[SamplerOutput, float, float]  # (its output, forward s, sample s)
LogitsLog = list[tuple[str, int, torch.Tensor]]  # Engine.logits_log


@dataclass
class Launched:
    """A step handed to the forward: its batch, its sampler rows' owners and its result
    (or a Future of it)."""

    batch: Batch
    owners: Owners
    result: Future | StepResult
    chain_safe: bool
    failed: dict[int, BaseException]  # owner index -> what failed for it before sampling
    scored: list[tuple[Request, int, int]]  # prompt rows scored (PreparedBatch.scored)
    score: PromptScore | None  # their logprobs, once the forward has run

    def wait(self) -> StepResult:
        return self.result.result() if isinstance(self.result, Future) else self.result


class StepCompute:
    def __init__(self, runner: ModelRunner, sample_stage: SampleStage, backend: Backend,
                 faults: FaultInjector):
        self.runner = runner
        self.sample_stage = sample_stage
        self.backend = backend
        self.faults = faults

    def __call__(self, prepared: PreparedBatch, rows: list[SamplerRow], owners: Owners,
                 prev_result: Future | StepResult | None, step_reqs: list[Request],
                 logits_log: LogitsLog | None) -> StepResult:
        """The forward and sampling of a step; its decode inputs are `prev_result`'s
        sampled tokens when it chains on the step before."""
        t1 = time.perf_counter()
        prev_tokens = prev_result.result()[0].tokens if prev_result is not None else None
        self.faults.check("forward", (r.request_id for r in step_reqs))
        head = self.runner.forward(prepared, prev_tokens)
        t2 = time.perf_counter()
        if len(owners) != head.shape[0]:
            head = head[[o[0] for o in owners]]
        if logits_log is not None:  # then the step asked the head for logits alone
            # copies: the next forward may reuse the logits' buffer (LMHead.logits)
            host = self.backend.to_host(head.logits)
            for (_, req), row, lg in zip(owners, rows, host):
                logits_log.append((req.request_id, row.position,
                                   lg.detach().float().cpu().clone()))
        out = self.sample_stage.sample(head, rows, owners)
        self.backend.end_step()
        return out, t2 - t1, time.perf_counter() - t2


def head_hints(ctx: ForwardContext, rows: list[SamplerRow], device: torch.device,
               draws_keyed_rows: bool) -> None:
    """A greedy row needs no logits, only their argmax (the LM head can give those): the
    whole batch, or its greedy rows beside rows that sample; a keyed row sampled by a
    temperature alone needs only its few ids that can win (the head's screen)."""
    greedy = [i for i, r in enumerate(rows) if plain_greedy(r)]
    ctx.argmax_only = len(greedy) == len(rows)
    if 0 < len(greedy) < len(rows):
        ctx.argmax_rows = greedy
    if len(greedy) < len(rows) and draws_keyed_rows:
        ctx.keyed = keyed_rows(rows, device)


def run_now(compute) -> Future | StepResult:
    """Run a step's compute on this thread: its result, or a Future holding its exception."""
    try:
        return compute()
    except Exception as e:  # noqa: BLE001 - raised again by Launched.wait
        failed: Future = Future()
        failed.set_exception(e)
        return failed
