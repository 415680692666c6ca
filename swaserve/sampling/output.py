"""SamplerOutput: the sampler's tokens and logprobs for a step's rows, and the rows that got
no token; joined from the outputs of runs of rows or of single rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # int64 [B]
    chosen_logprob: torch.Tensor | None  # float32 [B_lp]
    top_logprobs: torch.Tensor | None  # float32 [B_lp, n]
    top_ids: torch.Tensor | None  # int64 [B_lp, n]
    logprob_rows: list[int]
    failed: dict[int, BaseException] = field(default_factory=dict)  # rows with no token

    @classmethod
    def cat(cls, parts: list[SamplerOutput], device: torch.device) -> SamplerOutput:
        """One output from the outputs of consecutive runs of rows, in order; top-n lists
        padded to the widest (readers slice their own n)."""
        out = cls(torch.cat([p.tokens for p in parts]), None, None, None, [], {})
        lp = []  # the parts with logprob rows
        start = 0
        for p in parts:
            out.logprob_rows += [start + j for j in p.logprob_rows]
            out.failed.update({start + j: e for j, e in p.failed.items()})
            if p.logprob_rows:
                lp.append(p)
            start += p.tokens.shape[0]
        if not lp:
            return out
        out.chosen_logprob = torch.cat([p.chosen_logprob for p in lp])
        width = max(p.top_ids.shape[1] if p.top_ids is not None else 0 for p in lp)
        if width:
            out.top_logprobs = torch.full((len(out.logprob_rows), width), float("-inf"),
                                          device=device)
            out.top_ids = torch.zeros((len(out.logprob_rows), width), dtype=torch.int64,
                                      device=device)
            k = 0
            for p in lp:
                n = len(p.logprob_rows)
                if p.top_ids is not None:
                    out.top_logprobs[k:k + n, :p.top_ids.shape[1]] = p.top_logprobs
                    out.top_ids[k:k + n, :p.top_ids.shape[1]] = p.top_ids
                k += n
        return out

    @classmethod
    def join(cls, parts: list[SamplerOutput | None], failed: dict[int, BaseException],
             device: torch.device) -> SamplerOutput:
        """One output from one-row outputs, in order; a row that failed (None) gets token 0
        and no logprobs. Top-n lists are padded to the widest (readers slice their own n)."""
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        tokens = torch.cat([p.tokens if p is not None else zero for p in parts] or [zero[:0]])
        lp = [j for j, p in enumerate(parts) if p is not None and p.logprob_rows]
        out = cls(tokens, None, None, None, lp, dict(failed))
        if not lp:
            return out
        out.chosen_logprob = torch.cat([parts[j].chosen_logprob for j in lp])
        width = max(parts[j].top_ids.shape[1] if parts[j].top_ids is not None else 0
                    for j in lp)
        if width:
            out.top_logprobs = torch.full((len(lp), width), float("-inf"), device=device)
            out.top_ids = torch.zeros((len(lp), width), dtype=torch.int64, device=device)
            for k, j in enumerate(lp):
                if parts[j].top_ids is not None:
                    n = parts[j].top_ids.shape[1]
                    out.top_logprobs[k, :n] = parts[j].top_logprobs[0]
                    out.top_ids[k, :n] = parts[j].top_ids[0]
        return out
