"""Embedder: embedding requests, run by the engine thread between generation steps.

An embedding request is a list of whole prompts. It never enters the scheduler: its
forward (models/encoder.py) reads no KV cache and writes none, so a request row, a page or
a prefix-cache entry is never taken for it, and a generation request beside it gets the
tokens it gets alone. After each generation step the engine gives the embedder one slice:
queued prompts in arrival order up to `budget` tokens (the engine's chunk size, the
prompt tokens a prefill step takes), or one prompt when it alone is longer (a bidirectional
prompt cannot be cut), so generation rows wait for a slice as long as for a prefill of
the same size.

A slice that raises fails the requests it held prompts of; the engine goes on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swaserve.checkpoint.sentence import read_sentence_modules
from swaserve.checkpoint.source import ModelSource
from swaserve.config import EngineConfig
from swaserve.engine.request import RequestError
from swaserve.models.encoder import Encoder, Pooler

log = logging.getLogger("swaserve")


@dataclass
class EmbedJob:
    """One embedding request: its prompts' ids, their vectors as they are computed, and
    `done`, called on the engine thread when it finishes or fails."""

    prompts: list[list[int]]
    done: Callable[[EmbedJob], None] | None = None
    vectors: list[list[float] | None] = field(default_factory=list)
    error: RequestError | None = None
    started: int = 0  # prompts handed to a slice

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(v is not None for v in self.vectors)


class Embedder:
    def __init__(self, encoder: Encoder, pooler: Pooler, vocab_size: int, max_model_len: int,
                 budget: int):
        self.encoder, self.pooler = encoder, pooler
        self.vocab_size, self.max_model_len, self.budget = vocab_size, max_model_len, budget
        self._queue: deque[EmbedJob] = deque()

    @property
    def dimensions(self) -> int:
        return self.pooler.dimensions

    def check(self, prompts: list[list[int]]) -> None:
        """Raise ValueError naming `input` for what no forward can take."""
        if not prompts:
            raise ValueError("input: at least one prompt is needed")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"input: prompt {i} is empty")
            if len(p) > self.max_model_len:
                raise ValueError(f"input: prompt {i} has {len(p)} tokens, more than the "
                                 f"model's context of {self.max_model_len}")
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input: token id {bad} is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")

    def add(self, prompts: list[list[int]], done: Callable[[EmbedJob], None] | None = None
            ) -> EmbedJob:
        self.check(prompts)
        job = EmbedJob([list(p) for p in prompts], done, [None] * len(prompts))
        self._queue.append(job)
        return job

    def has_work(self) -> bool:
        return bool(self._queue)

    def cancel(self, job: EmbedJob) -> bool:
        """Drop a queued job (its client left or its time ran out) without calling `done`;
        True if it was still queued. Slices run on the caller's thread, so none is using it."""
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def fail_all(self, error: RequestError) -> None:
        """End every queued job with `error` (the engine is stopping)."""
        jobs, self._queue = list(self._queue), deque()
        for job in jobs:
            job.error = error
            if job.done is not None:
                job.done(job)

    def step(self) -> list[EmbedJob]:
        """Run one slice; returns the jobs that finished or failed in it."""
        taken: list[tuple[EmbedJob, int]] = []
        tokens = 0
        for job in self._queue:
            while job.started < len(job.prompts):
                n = len(job.prompts[job.started])
                if taken and tokens + n > self.budget:
                    break
                taken.append((job, job.started))
                job.started += 1
                tokens += n
            if job.started < len(job.prompts):
                break
        if not taken:
            return []
        try:
            hidden = self.encoder([job.prompts[i] for job, i in taken])
            for (job, i), h in zip(taken, hidden):
                job.vectors[i] = self.pooler(h).tolist()
        except Exception as e:  # noqa: BLE001 - this slice's requests fail, the engine goes on
            log.error("an embedding forward failed: %s", e, exc_info=e)
            err = RequestError(f"the embedding forward failed: {type(e).__name__}: {e}")
            for job, _ in taken:
                job.error = err
        ended = list({id(job): job for job, _ in taken if job.finished}.values())
        for job in ended:
            self._queue.remove(job)
            if job.done is not None:
                job.done(job)
        return ended

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """The prompts' vectors now, in slices of the same budget (the offline path)."""
        job = self.add(prompts)
        while not job.finished:
            self.step()
        if job.error is not None:
            raise RuntimeError(job.error.message)
        return job.vectors


def build_embedder(model, source: ModelSource, config: EngineConfig, device: torch.device,
                   max_model_len: int) -> Embedder:
    """The embedder of a loaded torch CausalLM: pooled as the sentence-transformers modules
    beside its checkpoint say (checkpoint/sentence.py) or as `config.pooling` does, in
    slices of `config.chunk_size` tokens."""
    modules = read_sentence_modules(source.directory) if source.fmt == "hf" else None
    pooler = Pooler.build(model.cfg, modules, config.pooling, device)
    return Embedder(Encoder(model, device), pooler, model.cfg.vocab_size, max_model_len,
                    config.chunk_size)
