"""Engine: owns the model, memory, scheduler and sampler, and runs the step loop

    schedule -> prepare inputs -> run model -> sample -> postprocess

The offline API calls `step` in a loop; the server runs it in its own thread and talks to
it through queues. The steps themselves run in engine/step_loop.py.

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

Speculative decoding (`speculative="ngram"`, engine/speculative.py): before a step each
decoding request may get a draft; the scheduler adds it to the request's decode token as
more decode rows, the sample stage samples each row as if the draft before it was kept, and
postprocess (engine/postprocess.py) keeps tokens while they equal the draft, then forgets
the KV of the rest. The output is the non-speculative output.

Faults stay with their request: a row whose sampling, grammar mask, detokenization or stop
check raises fails that request only (FinishReason.ERROR with a RequestError); the rest of
the batch gets exactly the tokens it would have got. A fault no request can be blamed for
(the forward) fails the requests of that step, the pools are checked, and the engine goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from swaserve import profile
from swaserve.checkpoint.loading import load_model
from swaserve.checkpoint.shard import local_config
from swaserve.checkpoint.source import resolve_model
from swaserve.config import TORCH_DTYPES, EngineConfig
from swaserve.distributed.group import GroupBroken
from swaserve.distributed.workers import TensorParallel, threads_per_rank
from swaserve.engine.backend import backend_for
from swaserve.engine.embedder import EmbedJob, build_embedder
from swaserve.engine.faults import FaultInjector
from swaserve.engine.forks import ForkGroups
from swaserve.engine.intake import Intake
from swaserve.engine.launch import Launched, LogitsLog, StepCompute
from swaserve.engine.output import OutputProcessor
from swaserve.engine.postprocess import Postprocessor
from swaserve.engine.request import Request
from swaserve.engine.runner import ModelRunner
from swaserve.engine.sample_stage import SampleStage
from swaserve.engine.scheduler import Scheduler
from swaserve.engine.speculative import NgramSpeculator
from swaserve.engine.stats import EngineStats, StepStats
from swaserve.engine.step_loop import StepLoop, StepParts
from swaserve.engine.threads import FIXED_THREADS_ENV, ThreadGovernor
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.planner import plan_kv
from swaserve.models.base import CausalLM
from swaserve.profile import timed
from swaserve.sampling.grammar import CompiledGrammar, GrammarCompiler
from swaserve.sampling.params import SamplingParams

log = logging.getLogger("swaserve")


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        """`Engine(config)`, `Engine(**fields)`, or a config with some fields replaced."""
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        threads = threads_per_rank(config)
        torch.set_num_threads(threads)
        # the array library the model runs on (engine/backend.py): torch, or MLX (mlx/)
        self.backend = backend_for(config)
        self.config = config = self.backend.prepare(config)  # the config this engine runs
        self.device = self.backend.host_device(config)
        self.dtype = TORCH_DTYPES[config.dtype]
        t0 = time.monotonic()
        self._load(config)
        self._build_memory(config)
        self._build_stages(config)
        self._build_step_loop(config, threads)
        # embeddings through the torch model on this process (not under tensor parallelism
        # nor another backend, whose forward is not the torch one)
        self.embedder = (build_embedder(self.model, self.source, config, self.device,
                                        self.max_model_len)
                         if self.tp is None and isinstance(self.model, CausalLM) else None)
        self.load_seconds = time.monotonic() - t0
        # EngineConfig.profile or SWASERVE_PROFILE=1: each part's time (swaserve/profile.py)
        self.profile = profile.start() if config.profile or profile.requested() else None

    def _load(self, config: EngineConfig) -> None:
        """The tensor-parallel ranks (if any), the checkpoint, its tokenizer and this rank's
        model. `whole_model_config` is the whole model's; `model.cfg` this rank's shard."""
        self.tp = None  # tensor parallelism: this process is rank 0 and holds one shard
        if config.tensor_parallel_size > 1:
            whole = resolve_model(config.model, config.revision).model_config()
            local_config(whole, config.tensor_parallel_size)  # fails before any rank starts
            self.tp = TensorParallel(config, whole.vocab_size)
        loaded = load_model(config, self.dtype, self.device,
                            self.tp.group if self.tp is not None else None)
        self.source, self.tokenizer = loaded.source, loaded.tokenizer
        self.whole_model_config = loaded.config
        self.model, self.max_model_len = loaded.model, loaded.max_model_len
        self.vocab_size = self.whole_model_config.vocab_size

    def _build_memory(self, config: EngineConfig) -> None:
        """The KV plan and cache for this rank's KV heads, and the model the backend runs
        over them."""
        self.layout = self.model.cfg.cache_layout(
            config.num_draft_tokens if config.speculative else 0)
        # a prefix hit starts a prompt's chunks at the hit, not at fixed positions
        self.prefix_cache = config.prefix_cache and not config.batch_invariant
        self.plan = plan_kv(config, self.layout, self.max_model_len, self.device,
                            self.prefix_cache, self.model.pending_bytes)
        log.info(self.plan.describe())
        self.cache = KVCache(self.layout, self.plan, self.max_model_len, self.dtype, self.device,
                             prefix_cache=self.prefix_cache, kv_device=self.backend.kv_device)
        p = config.page_size  # recurrent state checkpoints: at whole pages
        self.cache.checkpoint_interval = -(-config.state_checkpoint_interval // p) * p
        self.model = self.backend.model(self.model, self.cache, self.source)
        if self.tp is not None:
            self.cache.copy_log = []
            self.tp.init_cache(self.plan, self.max_model_len, self.prefix_cache)

    def _build_stages(self, config: EngineConfig) -> None:
        """The step's stages: scheduler, runner, sampling, postprocess; and the intake."""
        cfg = self.whole_model_config
        self.runner = ModelRunner(self.model, cfg, self.cache, self.device,
                                  batch_invariant=config.batch_invariant, tp=self.tp)
        self.scheduler = Scheduler(self.cache, config.chunk_size,
                                   aligned_chunks=config.batch_invariant)
        self.sampler = self.backend.sampler(self.vocab_size, self.device, config.seed)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(eos),
                                        json_bounds=config.json_bounds)
        self.requests: dict[str, Request] = {}
        self._faults = FaultInjector()
        self.forks = ForkGroups(self.scheduler)
        self.sample_stage = SampleStage(self.sampler, self.vocab_size, self.device,
                                        self.eos_token_ids, self._faults, self.forks)
        self.output = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids,
                                      self._faults)
        self.speculator = (NgramSpeculator(config.num_draft_tokens, config.ngram_min,
                                           config.ngram_max, config.speculative_max_rows)
                           if config.speculative == "ngram" else None)
        self.post = Postprocessor(self.scheduler, self.cache, self.output, self.speculator,
                                  self.forks)
        self.compute = StepCompute(self.runner, self.sample_stage, self.backend,
                                   self._faults)
        self.intake = Intake(self.tokenizer, self.vocab_size, self.max_model_len,
                             self.grammars, self.sampler, self.speculator is not None)

    def _build_step_loop(self, config: EngineConfig, threads: int) -> None:
        """Overlap scheduling's worker and in-flight steps, and the thread governor."""
        # on a CPU the host work would take a core from the forward's threads
        self.overlap = (config.overlap if config.overlap is not None
                        else self.backend.overlaps_by_default(self.device) and self.tp is None)
        parts = StepParts(self.scheduler, self.cache, self.model, self.device, self.runner,
                          self.sample_stage, self.compute, self.post, self.forks,
                          self.speculator, config.speculative_max_rows, self.check_integrity)
        self.loop = StepLoop(parts, self.overlap)
        # not with overlap: the thread count would change while the worker runs a forward
        self.governor = (ThreadGovernor(threads) if config.adaptive_threads and threads > 1
                         and self.device.type == "cpu" and self.backend.torch_threads
                         and not config.batch_invariant
                         and not self.overlap and not os.environ.get(FIXED_THREADS_ENV)
                         and self.tp is None else None)

    def close(self) -> None:
        """Stop what this engine started beside its own thread (tensor-parallel ranks)."""
        if self.tp is not None:
            self.tp.close()

    @property
    def last_step(self) -> StepStats | None:
        """The last step's figures; None when it had nothing to run."""
        return self.loop.last_step

    @property
    def logits_log(self) -> LogitsLog | None:
        """Diagnostics: when set to a list, every sampled logits row is appended to it as
        (request_id, position, float32 logits); tests compare them to a reference."""
        return self.loop.logits_log

    @logits_log.setter
    def logits_log(self, log: LogitsLog | None) -> None:
        self.loop.logits_log = log

    @property
    def step_in_flight(self) -> Launched | None:
        """With overlap: the step launched and still computing (its `batch`, `owners` and
        whether it was `chain_safe`), else None."""
        return self.loop.inflight

    @property
    def faults(self) -> FaultInjector:
        """A test hook (engine/faults.py), handed to the stages that check it: once armed,
        they raise for the requests it names."""
        return self._faults

    # -- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.intake.tokenize(prompt)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar `params` asks for (cached), or None. Raises ValueError naming
        the parameter for a malformed schema, regex or grammar. Thread-safe: the server
        calls it off the engine loop before it queues the request."""
        return self.intake.compile_grammar(params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    grammar: CompiledGrammar | None = None) -> list[Request]:
        """Queue a prompt; returns its n completions' requests (all must finish). Raises
        ValueError naming the parameter (token ids against this vocabulary, the prompt,
        the request id); SamplingParams checked the rest when it was made."""
        if self.whole_model_config.bidirectional:
            raise ValueError("model: an embedding model (bidirectional attention) embeds "
                             "prompts and does not generate")
        reqs = self.intake.requests(prompt, params or SamplingParams(), request_id, grammar,
                                    self.requests)
        self.scheduler.add(reqs[0])
        for r in reqs:
            self.requests[r.request_id] = r
            self.output.add(r)
        self.forks.add(reqs)
        return reqs

    def add_embedding(self, prompts: list[str | list[int]],
                      done: Callable[[EmbedJob], None] | None = None) -> EmbedJob:
        """Queue prompts to embed: each step runs a slice of them (engine/embedder.py) and
        `done` is called when all have their vectors or the job failed. Raises ValueError
        naming `input`."""
        if self.embedder is None:
            raise ValueError("input: embeddings are not available with tensor parallelism "
                             "or the mlx device")
        return self.embedder.add(self._embedding_ids(prompts), done)

    def embed(self, prompts: list[str | list[int]]) -> list[list[float]]:
        """The prompts' embeddings now (the offline path; no generation step runs)."""
        if self.embedder is None:
            self.add_embedding(prompts)  # raises why
        return self.embedder.embed(self._embedding_ids(prompts))

    def _embedding_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        try:
            return [self.intake.tokenize(p) for p in prompts]
        except ValueError as e:  # the embeddings API calls its prompts `input`
            raise ValueError(str(e).replace("prompt:", "input:", 1)) from e

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        self.forks.abort(req)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self.loop.inflight is not None
                or (self.embedder is not None and self.embedder.has_work()))

    def settle(self) -> None:
        """Finish the step in flight, so that finished requests' memory is released."""
        while self.loop.inflight is not None:
            self.step()

    def release(self, request_id: str) -> None:
        """Forget a finished request (its outputs were read)."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            self.output.release(request_id)
            if self.speculator is not None:
                self.speculator.forget(request_id)

    # -- the step --------------------------------------------------------------------------
    @timed("host (rest of the step)")
    def step(self) -> list[Request]:
        """Run one step; returns the requests that gained a token, finished or failed. With
        overlap these are the previous step's, and the next step is already computing."""
        if self.governor is not None:
            self.governor.before_step()
        try:
            changed = self.loop.step()
        except GroupBroken:  # a rank is gone: no step can run again
            raise
        except Exception as e:  # noqa: BLE001 - no request can be blamed: fail the step's
            return self.loop.fail(e)
        if self.embedder is not None and self.embedder.has_work():
            self.embedder.step()  # its faults stay with its own requests
        if self.governor is not None and self.last_step is not None:
            self.governor.after_step(self.last_step.seconds, self.last_step.num_tokens,
                                    self.last_step.num_seqs)
        return changed

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats.of(self.scheduler, self.cache, self.speculator)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        for r in self.requests.values():
            r.check()

