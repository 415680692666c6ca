"""transformers' own results for a model, the reference the engine's are held to."""

from __future__ import annotations

import torch


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over ids: row i predicts token i + 1."""
    return torch.log_softmax(hf_logits(model, ids), dim=-1)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens, eos included like ignore_eos (its
    generate() with min_new_tokens would ban eos instead)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
