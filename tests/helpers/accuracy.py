"""How far an engine's next-token distributions are from the float32 engine's, teacher
forced over the prompts the real-model tests use and a few long ones past 3 W: the mean
KL divergence KL(float32 || engine) per position and the share of positions whose argmax
(greedy token) is float32's. benchmarks/activation_accuracy.py and the slow accuracy test
read it."""

from __future__ import annotations

import argparse
import csv
import email
import importlib
import json
import logging
import subprocess
from dataclasses import dataclass, field

import torch

LONG_TOKENS = 1800  # past 3 W (W = 512 for the bundled model)


def suite_text() -> str:
    """tests/e2e/test_real_model.py's long_text(): the source of its prompts."""
    return "\n\n".join(m.__doc__ for m in (argparse, json, logging, csv, email, subprocess))


def _docs(*names: str) -> str:
    return "\n\n".join(importlib.import_module(n).__doc__ for n in names)


def gate_prompts(tokenize, short: int = 32, long: int = 3) -> list[list[int]]:
    """Token ids: the real-model tests' short prompts (`short` slices of 160 characters of
    their text), then `long` prompts of LONG_TOKENS tokens from other documentation."""
    text = suite_text()
    prompts = [tokenize(text[i * 97:i * 97 + 160]) for i in range(short)]
    sources = [text + "\n\n" + _docs("re"), _docs("pdb"),
               _docs("re", "socket", "unittest", "heapq", "inspect", "itertools")]
    for src in sources[:long]:
        ids = tokenize(src)
        if len(ids) < LONG_TOKENS:
            raise ValueError(f"a long gate prompt has {len(ids)} tokens, under {LONG_TOKENS}")
        prompts.append(ids[:LONG_TOKENS])
    return prompts


def prompt_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids) - 1, V]: the engine's log-softmax of each prompt row's next token,
    from its own prompt steps (the chunks, kernels and LM head it serves prompts with)."""
    from swaserve.sampling.params import SamplingParams

    head = engine.model.head
    rows: list[torch.Tensor] = []
    original = head.score

    def score(x, weight, ctx, norm):
        logits = head.logits

        def keep(r, w, c):
            out = logits(r, w, c)
            if out is not None:
                rows.append(torch.log_softmax(out.float(), dim=-1))
            return out

        head.logits = keep
        try:
            original(x, weight, ctx, norm)
        finally:
            del head.logits

    head.score = score
    try:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        while engine.has_unfinished():
            engine.step()
    finally:
        del head.score
    out = torch.cat(rows)
    if out.shape[0] != len(ids) - 1:
        raise RuntimeError(f"scored {out.shape[0]} rows of a {len(ids)}-token prompt")
    return out


@dataclass
class Distance:
    """Per-position KL(reference || other) and argmax agreement, by prompt."""

    kl: list[torch.Tensor] = field(default_factory=list)  # float64 [positions] a prompt
    same: list[torch.Tensor] = field(default_factory=list)  # bool [positions] a prompt

    def add(self, ref: torch.Tensor, other: torch.Tensor) -> None:
        kl = (ref.exp() * (ref - other)).sum(-1).double()
        self.kl.append(kl)
        self.same.append(ref.argmax(-1) == other.argmax(-1))

    def summary(self, first: int = 0) -> tuple[float, float, int]:
        """(mean KL, greedy agreement, positions) over positions >= `first` of each prompt."""
        kl = torch.cat([k[first:] for k in self.kl])
        same = torch.cat([s[first:] for s in self.same])
        return kl.mean().item(), same.double().mean().item(), kl.numel()
