"""Intake: a prompt and its sampling parameters into the Requests of its n completions.

The prompt's token ids are checked against the vocabulary (a string is tokenized), its
grammar compiled (cached), its completions named "<id>-<index>" when n > 1 and numbered in
arrival order, and an unseeded completion that speculates draws its seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

import torch

from swaserve.checkpoint.tokenizer import Tokenizer
from swaserve.engine.request import Request
from swaserve.sampling.grammar import CompiledGrammar, GrammarCompiler
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import Sampler


class Intake:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 grammars: GrammarCompiler, sampler: Sampler, speculative: bool):
        """`sampler`: whose generator draws the seeds; `speculative`: the engine drafts."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.sampler = sampler
        self.speculative = speculative
        self._ids = itertools.count()
        self._arrivals = itertools.count()

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
        the parameter for a malformed schema, regex or grammar. Thread-safe."""
        spec = params.structured
        return None if spec is None else self.grammars.compile(*spec)

    def requests(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None, grammar: CompiledGrammar | None,
                 taken: Container[str]) -> list[Request]:
        """The n completions' requests, the first (the one scheduled) first. Raises
        ValueError naming the parameter (token ids against this vocabulary, the prompt, a
        request id in `taken`)."""
        params.check_token_ids(self.vocab_size)
        ids = self.tokenize(prompt)
        if grammar is None:
            grammar = self.compile_grammar(params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in taken:
            raise ValueError(f"request_id: {rid!r} is already in use")
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            if seed is None and self.speculative and params.speculative and not params.greedy:
                # drafts are verified against the token a seeded row would sample: an
                # unseeded one draws its seed (its distribution does not change)
                seed = int(torch.randint(0, 2**62, (1,), generator=self.sampler.generator,
                                         device=self.sampler.generator.device))
            reqs.append(Request(f"{rid}-{i}" if params.n > 1 else rid, ids, params,
                                self.max_model_len, seed=seed,
                                grammar=grammar.new_matcher() if grammar else None,
                                arrival=next(self._arrivals), group_id=rid))
        return reqs
