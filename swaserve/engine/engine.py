"""Engine: owns the model, memory, scheduler and sampler, and runs the step loop

    schedule -> prepare inputs -> run model -> sample -> postprocess

The offline API calls `step` in a loop; the server runs it in its own thread and talks to
it through queues.

Overlap scheduling (on by default on a GPU, off on a CPU): the forward and sampling of a
step run on a worker thread (torch releases the GIL in its kernels) while the engine thread
schedules and prepares the next step and postprocesses the previous one (stop checks,
detokenization, streaming). The next step's decode tokens are the in-flight step's sampled
tokens, copied on the device right before its forward. A step is chain-safe, and the next
one is launched before its tokens are read, only when no row that continues needs its token
on the host: grammar rows (their next mask depends on it), stop strings (which may cut the
request), penalties (they count it) and a prompt whose n > 1 siblings fork from it.
Otherwise the step is read back first. A request that stops while the next step already
computes it loses that extra token, and its memory is freed once the step is done. Outputs
are the same with and without overlap.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from swaserve.config import EngineConfig, parse_bytes
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.request import FinishReason, Request, RequestStatus
from swaserve.engine.runner import TORCH_DTYPES, ModelRunner, build_model
from swaserve.engine.scheduler import Batch, ScheduledSeq, Scheduler
from swaserve.kernels import q8
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.planner import MemoryPlan, plan_memory
from swaserve.model.loader import load_q8_weights
from swaserve.model.source import ModelLoadError, resolve_model
from swaserve.model.tokenizer import load_tokenizer
from swaserve.models.registry import model_class
from swaserve.sampling.grammar import CompiledGrammar, GrammarCompiler, mask_biases
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import Sampler, SamplerOutput, SamplerRow, has_penalty

log = logging.getLogger("swaserve")
DEFAULT_KV_MEMORY = 1024**3


@dataclass
class StepStats:
    num_tokens: int
    num_seqs: int
    seconds: float
    forward_seconds: float
    sample_seconds: float  # exact on CPU, where kernels run synchronously


@dataclass
class _Launched:
    """A step handed to the forward: its batch, its sampler rows' owners and its result
    ((SamplerOutput, forward seconds, sample seconds), or a Future of it)."""

    batch: Batch
    owners: list[tuple[int, Request]]
    result: Future | tuple[SamplerOutput, float, float]
    chain_safe: bool

    def wait(self) -> tuple[SamplerOutput, float, float]:
        return self.result.result() if isinstance(self.result, Future) else self.result


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
        if (config.int8_weights and self.dtype != torch.float32 and self.device.type == "cpu"
                and not config.batch_invariant and q8.available()):
            # float32 stays the plain reference path; batch-invariant mode needs one kernel
            # for every row count
            fast = {name: w.for_activations(self.dtype)
                    for name, w in load_q8_weights(self.source, cfg.num_layers).items()}
            self.model.use_q8({name: w for name, w in fast.items() if w is not None})
        self.layout = cfg.cache_layout()
        # a prefix hit starts a prompt's chunks at the hit, not at fixed positions
        self.prefix_cache = config.prefix_cache and not config.batch_invariant
        self.plan = self._plan()
        log.info(self.plan.describe())
        self.cache = KVCache(self.layout, self.plan, self.max_model_len, self.dtype, self.device,
                             prefix_cache=self.prefix_cache)
        self.runner = ModelRunner(self.model, cfg, self.cache, self.device,
                                  batch_invariant=config.batch_invariant)
        self.scheduler = Scheduler(self.cache, config.chunk_size,
                                   aligned_chunks=config.batch_invariant)
        self.vocab_size = cfg.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, config.seed)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(eos))
        # on a CPU the host work would take a core from the forward's threads
        self.overlap = config.overlap if config.overlap is not None else self.device.type != "cpu"
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="swaserve-forward")
                        if self.overlap else None)
        self._inflight: _Launched | None = None
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
        if self.prefix_cache and self.layout.sliding_layers:
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

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar `params` asks for (cached), or None. Raises ValueError naming
        the parameter for a malformed schema, regex or grammar. Thread-safe: the server
        calls it off the engine loop before it queues the request."""
        spec = params.structured
        return None if spec is None else self.grammars.compile(*spec)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    grammar: CompiledGrammar | None = None) -> list[Request]:
        """Queue a prompt; returns its n completions' requests (all must finish)."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt)
        if grammar is None:
            grammar = self.compile_grammar(params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            reqs.append(Request(f"{rid}-{i}" if params.n > 1 else rid, ids, params,
                                self.max_model_len, seed=seed,
                                grammar=grammar.new_matcher() if grammar else None))
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
        return self.scheduler.has_work() or self._inflight is not None

    def settle(self) -> None:
        """Finish the step in flight, so that finished requests' memory is released."""
        while self._inflight is not None:
            self.step()

    def release(self, request_id: str) -> None:
        """Forget a finished request (its outputs were read)."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            self._detok.pop(request_id, None)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that gained a token or finished. With overlap
        these are the previous step's, and the next step is already computing."""
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        if prev is None:
            prev = self._launch(None)
            if prev is None:
                self.last_step = None
                return []
        try:
            if prev.chain_safe:
                self._inflight = self._launch(prev)
            out, forward_s, sample_s = prev.wait()
        except BaseException:
            self._inflight = None
            raise
        changed = self.postprocess(prev.batch, prev.owners, out)
        if self.overlap and self._inflight is None:
            self._inflight = self._launch(None)  # computes while the caller streams these
        self.last_step = StepStats(prev.batch.num_tokens, len(prev.batch.seqs),
                                   time.perf_counter() - t0, forward_s, sample_s)
        return changed

    def _launch(self, prev: _Launched | None) -> _Launched | None:
        """Schedule and prepare a step and hand it to the forward. `prev` is the step still
        in flight, whose sampled tokens are this step's decode inputs."""
        batch = self.scheduler.schedule(can_retract=prev is None)
        if not batch.seqs:
            return None
        pending = None
        if prev is not None:
            pending = {req.request_id: j for j, (_, req) in enumerate(prev.owners)}
        prepared = self.runner.prepare(batch, pending)
        rows, owners = self._sampler_rows(prepared.sampled)
        for s in batch.seqs:
            s.request.num_computed_tokens += s.num_tokens
            s.request.in_flight += 1
        for s in prepared.sampled:
            s.request.num_pending += 1
        chain_safe = self.overlap and not batch.blocked and all(
            self._chains(s.request) for s in prepared.sampled)
        prev_result = prev.result if prev is not None else None

        def compute() -> tuple[SamplerOutput, float, float]:
            t1 = time.perf_counter()
            prev_tokens = prev_result.result()[0].tokens if prev_result is not None else None
            logits = self.runner.forward(prepared, prev_tokens)
            t2 = time.perf_counter()
            if len(owners) != logits.shape[0]:
                logits = logits[[o[0] for o in owners]]
            if self.logits_log is not None:
                # copies: the next forward may reuse the logits' buffer (CausalLM.forward)
                for (_, req), row, lg in zip(owners, rows, logits):
                    self.logits_log.append((req.request_id, row.position,
                                            lg.detach().float().cpu().clone()))
            out = self.sampler(logits, rows)
            return out, t2 - t1, time.perf_counter() - t2

        result = self._worker.submit(compute) if self._worker is not None else compute()
        return _Launched(batch, owners, result, chain_safe)

    def _chains(self, req: Request) -> bool:
        """Can the step after this one be built before this one's token is read back?"""
        p = req.params
        return (req.grammar is None and not p.stop and not has_penalty(p)
                and req.request_id not in self._forks)

    def _sampler_rows(self, sampled: list[ScheduledSeq]
                      ) -> tuple[list[SamplerRow], list[tuple[int, Request]]]:
        """One sampler row per sampled seq, plus one per waiting n>1 sibling of a seq whose
        prompt just completed (they share its logits row)."""
        rows, owners = [], []
        for i, s in enumerate(sampled):
            req = s.request
            family = [req]
            if req.num_generated == 0 and req.request_id in self._forks:
                family += self._forks[req.request_id]
            for r in family:
                rows.append(self._row(r, s.start + s.num_tokens - 1))
                owners.append((i, r))
        grammar_rows = [j for j, (_, r) in enumerate(owners) if r.grammar is not None]
        if grammar_rows:
            biases = mask_biases([owners[j][1].grammar for j in grammar_rows], self.vocab_size,
                                 self.device)
            for j, bias in zip(grammar_rows, biases):
                rows[j].grammar_bias = bias
        return rows, owners

    def _row(self, req: Request, position: int) -> SamplerRow:
        suppress: list[int] = []
        if req.num_generated < req.params.min_tokens:
            # a grammar decides itself when the text may end
            if not req.params.ignore_eos and req.grammar is None:
                suppress = list(self.eos_token_ids)
            suppress += list(req.params.stop_token_ids or [])
        return SamplerRow(req.params, req.seed, position, req.prompt_token_ids,
                          req.output_token_ids, suppress)

    def postprocess(self, batch: Batch, owners: list[tuple[int, Request]],
                    out: SamplerOutput) -> list[Request]:
        for s in batch.seqs:
            s.request.in_flight -= 1
            if s.sample:
                s.request.num_pending -= 1
        self.scheduler.release_deferred()
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
            if req.is_finished:  # it stopped while this step computed it: a surplus token
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
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(req, tok)
            changed.append(req)
        for req in batch.retracted:
            log.debug("retracted %s (preemption %d)", req.request_id, req.num_preemptions)
        return changed

    def _advance_grammar(self, req: Request, tok: int) -> None:
        if not req.grammar.accept(tok):  # the mask allowed it, so this is an engine bug
            log.warning("%s: grammar rejected token %d: %s", req.request_id, tok,
                        req.grammar.error)
            req.stop_reason = "grammar_error"
            self.scheduler.finish(req, FinishReason.STOP)
        elif req.grammar.is_terminated:
            self.scheduler.finish(req, FinishReason.STOP)

    def _fork(self, parent: Request, child: Request) -> None:
        """Give an n>1 sibling the parent's prompt KV: shared full pages, copied rings."""
        siblings = self._forks.get(parent.request_id, [])
        if child in siblings:
            siblings.remove(child)
        if not siblings:
            self._forks.pop(parent.request_id, None)
        row = self.cache.fork_row(parent.row, parent.num_prompt_tokens)
        if row is not None:
            child.row = row
            child.num_computed_tokens = parent.num_prompt_tokens
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
