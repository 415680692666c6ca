"""Engine: owns the model, memory, scheduler and sampler, and runs the step loop

    schedule -> prepare inputs -> run model -> sample -> postprocess

Synchronous and single-threaded: the offline API calls `step` in a loop; the server runs it
in its own thread and talks to it through queues.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from swaserve.config import EngineConfig, parse_bytes
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.request import FinishReason, Request, RequestStatus
from swaserve.engine.runner import TORCH_DTYPES, ModelRunner, build_model
from swaserve.engine.scheduler import Batch, ScheduledSeq, Scheduler
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.planner import MemoryPlan, plan_memory
from swaserve.model.source import ModelLoadError, resolve_model
from swaserve.model.tokenizer import load_tokenizer
from swaserve.models.registry import model_class
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import Sampler, SamplerOutput, SamplerRow

log = logging.getLogger("swaserve")
DEFAULT_KV_MEMORY = 1024**3


@dataclass
class StepStats:
    num_tokens: int
    num_seqs: int
    seconds: float
    forward_seconds: float
    sample_seconds: float  # exact on CPU, where kernels run synchronously


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig(**overrides)
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        if str(config.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no CUDA device")
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        t0 = time.monotonic()
        self.source = resolve_model(config.model)
        self.model_config = cfg = self.source.model_config()
        model_class(cfg.architecture)  # unsupported architectures fail before any loading
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's context "
                             f"length {cfg.max_position_embeddings}")
        self.tokenizer = load_tokenizer(self.source)
        try:
            self.model = build_model(self.source, cfg, self.dtype, self.device)
        except ModelLoadError:
            raise
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"{self.source.path}: cannot load weights: {e}") from e
        self.layout = cfg.cache_layout()
        self.plan = self._plan()
        log.info(self.plan.describe())
        self.cache = KVCache(self.layout, self.plan, self.max_model_len, self.dtype, self.device,
                             prefix_cache=config.prefix_cache)
        self.runner = ModelRunner(self.model, cfg, self.cache, self.device)
        self.scheduler = Scheduler(self.cache, config.chunk_size)
        self.vocab_size = cfg.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, config.seed)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._forks: dict[str, list[Request]] = {}  # parent id -> siblings waiting for its prompt
        self._ids = itertools.count()
        self.load_seconds = time.monotonic() - t0
        self.last_step: StepStats | None = None
        # diagnostics: when a list, every sampled logits row is appended as
        # (request_id, position, float32 logits); tests compare them to a reference
        self.logits_log: list[tuple[str, int, torch.Tensor]] | None = None

    def _plan(self) -> MemoryPlan:
        c = self.config
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        budget = c.kv_memory_bytes
        if budget is None and c.mem_fraction is not None:
            budget = int(_free_memory_bytes(self.device) * c.mem_fraction)
        budget = budget or DEFAULT_KV_MEMORY
        window_cache = 0
        if c.prefix_cache and self.layout.sliding_layers:
            window_cache = (parse_bytes(c.window_cache_memory) if c.window_cache_memory
                            else budget // 5)
        return plan_memory(self.layout, budget, dtype_bytes,
                           chunk_size=c.chunk_size, page_size=c.page_size,
                           max_model_len=self.max_model_len,
                           max_running_requests=c.max_running_requests,
                           window_cache_bytes=window_cache)

    # -- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer files; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> list[Request]:
        """Queue a prompt; returns its n completions' requests (all must finish)."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            reqs.append(Request(f"{rid}-{i}" if params.n > 1 else rid, ids, params,
                                self.max_model_len, seed=seed))
        self.scheduler.add(reqs[0])
        for r in reqs:
            self.requests[r.request_id] = r
            if self.tokenizer is not None:
                self._detok[r.request_id] = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens)
        if len(reqs) > 1:
            self._forks[reqs[0].request_id] = reqs[1:]
        return reqs

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        for sib in self._forks.pop(request_id, []):
            self._finish_waiting(sib, FinishReason.ABORT)
        self.scheduler.abort(req)

    def _finish_waiting(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.WAITING and req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def release(self, request_id: str) -> None:
        """Forget a finished request (its outputs were read)."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            self._detok.pop(request_id, None)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that gained a token or finished."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self.last_step = None
            return []
        prepared = self.runner.prepare(batch)
        t1 = time.perf_counter()
        logits = self.runner.forward(prepared)
        t2 = time.perf_counter()
        rows, owners = self._sampler_rows(prepared.sampled, logits)
        if len(owners) != logits.shape[0]:
            logits = logits[[o[0] for o in owners]]
        if self.logits_log is not None:
            for (_, req), row, lg in zip(owners, rows, logits):
                self.logits_log.append((req.request_id, row.position, lg.detach().float().cpu()))
        out = self.sampler(logits, rows)
        t3 = time.perf_counter()
        changed = self.postprocess(batch, owners, out)
        self.last_step = StepStats(batch.num_tokens, len(batch.seqs), time.perf_counter() - t0,
                                   t2 - t1, t3 - t2)
        return changed

    def _sampler_rows(self, sampled: list[ScheduledSeq], logits: torch.Tensor
                      ) -> tuple[list[SamplerRow], list[tuple[int, Request]]]:
        """One sampler row per sampled seq, plus one per waiting n>1 sibling of a seq whose
        prompt just completed (they share its logits row)."""
        rows, owners = [], []
        for i, s in enumerate(sampled):
            req = s.request
            family = [req]
            if req.num_output_tokens == 0 and req.request_id in self._forks:
                family += self._forks[req.request_id]
            for r in family:
                rows.append(self._row(r, s.start + s.num_tokens - 1))
                owners.append((i, r))
        return rows, owners

    def _row(self, req: Request, position: int) -> SamplerRow:
        suppress: list[int] = []
        if req.num_output_tokens < req.params.min_tokens:
            suppress = [t for t in self.eos_token_ids if not req.params.ignore_eos]
            suppress += list(req.params.stop_token_ids or [])
        return SamplerRow(req.params, req.seed, position, req.prompt_token_ids,
                          req.output_token_ids, suppress)

    def postprocess(self, batch: Batch, owners: list[tuple[int, Request]],
                    out: SamplerOutput) -> list[Request]:
        for s in batch.seqs:
            s.request.num_computed_tokens += s.num_tokens
        tokens = out.tokens.tolist()  # the one host sync of the step
        lp_pos = {row: j for j, row in enumerate(out.logprob_rows)}
        chosen = out.chosen_logprob.tolist() if out.chosen_logprob is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        # forks first: a parent that finishes on this token frees the row its siblings copy
        parent_of: dict[int, Request] = {}
        for i, req in owners:
            if i not in parent_of:
                parent_of[i] = req
            else:
                self._fork(parent_of[i], req)
        changed = []
        now = time.monotonic()
        for j, ((_, req), tok) in enumerate(zip(owners, tokens)):
            if req.is_finished:
                continue
            if not req.output_token_ids and req.row is not None:
                self.scheduler.on_prompt_done(req)
            req.output_token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.logprobs is not None and j in lp_pos:
                k = lp_pos[j]
                entry = {tok: chosen[k]}
                for t, v in zip(top_ids[k][:req.params.logprobs], top_lp[k][:req.params.logprobs]):
                    entry.setdefault(t, v)
                req.logprobs.append(entry)
            self._check_stop(req, tok)
            changed.append(req)
        for req in batch.retracted:
            log.debug("retracted %s (preemption %d)", req.request_id, req.num_preemptions)
        return changed

    def _fork(self, parent: Request, child: Request) -> None:
        """Give an n>1 sibling the parent's prompt KV: shared full pages, copied rings."""
        siblings = self._forks.get(parent.request_id, [])
        if child in siblings:
            siblings.remove(child)
        if not siblings:
            self._forks.pop(parent.request_id, None)
        row = self.cache.fork_row(parent.row, parent.num_computed_tokens)
        if row is not None:
            child.row = row
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.scheduler.running.append(child)
        else:  # no free row or page now: it prefills on its own later (same tokens, slower)
            self.scheduler.waiting.append(child)

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        detok = self._detok.get(req.request_id)
        if detok is not None:
            prev = len(detok.text)
            detok.add(tok)
            req.output_text = detok.text
            if p.stop and req.num_output_tokens >= p.min_tokens:
                longest = max(len(s) for s in p.stop)
                start = max(0, prev - longest + 1)
                hits = [(req.output_text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    req.output_text = req.output_text[:i]
                    req.stop_reason = s
                    self.scheduler.finish(req, FinishReason.STOP)
                    return
        if req.num_output_tokens >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                self.scheduler.finish(req, FinishReason.STOP)
                return
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.stop_reason = tok
                self.scheduler.finish(req, FinishReason.STOP)
                return
        if req.num_output_tokens >= req.max_new_tokens:
            self.scheduler.finish(req, FinishReason.LENGTH)

    # -- introspection ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.cache.check_integrity()
        for r in self.requests.values():
            r.check()


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return DEFAULT_KV_MEMORY
