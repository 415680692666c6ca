"""What the sampler reads of a step's rows: SamplerRow (one row's params, seed, position and
token history), the predicates that sort rows by the work they need (`plain`, `light`, ...),
and SamplingTensors, their parameters packed once per batch. `keyed_rows` tells the LM head
which rows it may draw itself (models/head.py KeyedRows)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swaserve.kernels import murmur
from swaserve.models.head import KeyedRows
from swaserve.sampling.params import SamplingParams


@dataclass
class SamplerRow:
    """What the sampler needs of one row: its params, seed, position and token history."""

    params: SamplingParams
    seed: int | None
    position: int  # absolute position of the last input token
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    suppress: Sequence[int] = ()  # token ids banned this step (eos/stop before min_tokens)
    grammar_bias: torch.Tensor | None = None  # float32 [V]: 0 allowed, -inf banned


@dataclass
class SamplingTensors:
    """Per-row parameters packed once per batch."""

    greedy: torch.Tensor  # bool [B]
    temperature: torch.Tensor  # float32 [B] (1 for greedy rows)
    top_k: torch.Tensor  # int64 [B], V for "all"
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    prefix: torch.Tensor  # int64 [B] murmur state after (seed_lo, seed_hi, pos)
    filter_rows: list[int]
    temp_rows: list[int]
    greedy_rows: list[int]
    bias_index: tuple[torch.Tensor, torch.Tensor] | None
    bias_value: torch.Tensor | None
    penalty_rows: list[int]
    edited_rows: list[int]  # rows with a logit bias, suppressed tokens, a mask or penalties
    logprob_rows: list[int]
    num_logprobs: int

    @classmethod
    def build(cls, rows: list[SamplerRow], vocab: int, device: torch.device) -> SamplingTensors:
        b = len(rows)
        greedy = [r.params.greedy for r in rows]
        temps = [1.0 if g else float(r.params.temperature) for g, r in zip(greedy, rows)]
        top_k = [vocab if r.params.top_k in (-1, 0) else min(r.params.top_k, vocab) for r in rows]
        filtering = [not g and (k < vocab or r.params.top_p < 1.0 or r.params.min_p > 0.0)
                     for g, k, r in zip(greedy, top_k, rows)]
        t = lambda data, dt: torch.tensor(data, dtype=dt, device=device)  # noqa: E731
        prefix = row_prefixes(rows, device)
        bi, bt, bv = [], [], []
        for i, r in enumerate(rows):
            for tok, val in (r.params.logit_bias or {}).items():
                bi.append(i), bt.append(tok), bv.append(val)
            for tok in r.suppress:
                bi.append(i), bt.append(tok), bv.append(float("-inf"))
        want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        return cls(
            greedy=t(greedy, torch.bool), temperature=t(temps, torch.float32),
            top_k=t(top_k, torch.int64), top_p=t([float(r.params.top_p) for r in rows], torch.float32),
            min_p=t([float(r.params.min_p) for r in rows], torch.float32),
            prefix=prefix,
            filter_rows=[i for i in range(b) if filtering[i]],
            temp_rows=[i for i in range(b) if not greedy[i] and not filtering[i]],
            greedy_rows=[i for i in range(b) if greedy[i]],
            bias_index=(t(bi, torch.int64), t(bt, torch.int64)) if bi else None,
            bias_value=t(bv, torch.float32) if bi else None,
            penalty_rows=[i for i, r in enumerate(rows) if has_penalty(r.params)],
            edited_rows=[i for i, r in enumerate(rows) if r.params.logit_bias or r.suppress
                         or r.grammar_bias is not None or has_penalty(r.params)],
            logprob_rows=want_lp,
            num_logprobs=max((rows[i].params.logprobs for i in want_lp), default=0),
        )


def row_prefixes(rows: list[SamplerRow], device: torch.device) -> torch.Tensor:
    """int64 [B]: each row's murmur prefix of (seed, position); an unkeyed row's seed as 0."""
    lo_hi = [murmur.split_seed(r.seed if r.seed is not None else 0) for r in rows]
    t = lambda data: torch.tensor(data, dtype=torch.int64, device=device)  # noqa: E731
    return murmur.row_prefix(t([x[0] for x in lo_hi]), t([x[1] for x in lo_hi]),
                             t([r.position for r in rows]))


def keyed_rows(rows: list[SamplerRow], device: torch.device) -> KeyedRows | None:
    """The rows whose token the model may find itself (ForwardContext.keyed): light rows
    that sample (by a temperature alone, already keyed: `Sampler.keyed`); None if none."""
    idx = [i for i, r in enumerate(rows)
           if light(r) and not r.params.greedy and r.seed is not None]
    if not idx:
        return None
    picked = [rows[i] for i in idx]
    return KeyedRows(idx, torch.tensor([float(r.params.temperature) for r in picked],
                                       dtype=torch.float32, device=device),
                     row_prefixes(picked, device))


def plain(r: SamplerRow) -> bool:
    """No edits of its logits (bias, suppressed tokens, grammar, penalties), no logprobs."""
    p = r.params
    return (not p.logit_bias and p.logprobs is None and not r.suppress
            and r.grammar_bias is None and not has_penalty(p))


def plain_greedy(r: SamplerRow) -> bool:
    return r.params.greedy and plain(r)


def light(r: SamplerRow) -> bool:
    """A row whose sampling makes no float copy of its logits: plain greedy, or plain
    temperature-only (its candidates come from gumbel.c)."""
    p = r.params
    return plain(r) and (p.greedy or (p.top_k in (-1, 0) and p.top_p >= 1.0 and p.min_p <= 0.0))


def has_penalty(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
