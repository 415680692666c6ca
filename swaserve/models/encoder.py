"""Embeddings: a prompt-only forward and the pooling after it.

`Encoder` runs a batch of whole prompts through a model's layers with `PromptAttention`,
which attends over each prompt's own keys and keeps nothing: no KV cache row, no prefix
cache entry, nothing left behind once the call returns. A bidirectional model (EmbeddingGemma:
`ModelConfig.bidirectional`) sees every key on its full layers and the keys within
`sliding_window // 2` either side on its sliding ones, as transformers' Gemma 3 does with
`use_bidirectional_attention`; a decoder model keeps its causal (and sliding) masks.
A bidirectional prompt cannot be cut into chunks, so each one runs whole.

`Pooler` turns one prompt's final-normed hidden states into its vector: mean, first (cls) or
last token, then the sentence-transformers Dense layers, then L2 normalization where the
checkpoint asks for it (checkpoint/sentence.py), all in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from swaserve.models.attention import attend
from swaserve.models.config import ModelConfig
from swaserve.models.context import AttnGroup, ForwardContext, KeyView

POOLINGS = ("mean", "last", "cls")


def attention_mask(n: int, bidirectional: bool, window: int | None,
                   device: torch.device) -> KeyView:
    """Which of a prompt's n keys each of its n queries sees, as a fresh KeyView."""
    if window is None:
        return KeyView(fresh=True, causal=not bidirectional, key_slots=None, mask=None)
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]  # query - key
    # transformers: bidirectional sliding layers see |d| < window // 2 + 1
    allowed = d.abs() <= window // 2 if bidirectional else (d >= 0) & (d < window)
    return KeyView(fresh=True, causal=False, key_slots=None, mask=allowed[None, None])


class PromptAttention:
    """An AttentionBackend over the batch's own keys alone: each group is one prompt whose
    KeyViews give its masks; nothing is written anywhere."""

    def __init__(self, cfg: ModelConfig):
        self.sliding = [kind == "sliding" for kind in cfg.layer_types]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ctx: ForwardContext, scale: float, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        outs = []
        for g in ctx.groups:
            view = g.sliding if self.sliding[layer] else g.full
            n = g.num_queries
            qg, kg, vg = (t[g.start:g.end].view(1, n, -1, head_dim).transpose(1, 2)
                          for t in (q, k, v))
            o = attend(qg, kg, vg, view, sinks, scale, num_heads != k.shape[1])
            outs.append(o.transpose(1, 2).reshape(n, num_heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Encoder:
    """Whole prompts to their final-normed hidden states, through a torch CausalLM."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.device = device
        self.attn = PromptAttention(self.cfg)

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt's hidden states [len, hidden], in the model's dtype."""
        cfg, groups, start = self.cfg, [], 0
        for ids in prompts:
            n = len(ids)
            full = attention_mask(n, cfg.bidirectional, None, self.device)
            sliding = (attention_mask(n, cfg.bidirectional, cfg.sliding_window, self.device)
                       if cfg.sliding_window else full)
            groups.append(AttnGroup(start, 1, n, full, sliding))
            start += n
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(len(p), device=self.device) for p in prompts])
        ctx = ForwardContext(ids, positions, groups,
                             logits_indices=torch.empty(0, dtype=torch.long, device=self.device))
        hidden = self.model.encode(ctx, self.attn)
        return list(hidden.split([len(p) for p in prompts]))


@dataclass(frozen=True)
class DenseLayer:
    """y = activation(x @ weight.T + bias), in float32."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    activation: str  # "identity" | "tanh"


@dataclass(frozen=True)
class SentenceModules:
    """A sentence-transformers checkpoint's modules (checkpoint/sentence.py reads them)."""

    pooling: str | None  # "mean" | "cls" | "last"; None without a Pooling module
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False


@dataclass(frozen=True)
class Pooler:
    """One prompt's hidden states to its embedding (float32)."""

    mode: str  # "mean" | "last" | "cls"
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True
    hidden_size: int = 0
    # its vectors may be shortened (`truncate`): the checkpoint is a sentence-transformers
    # embedding model, whose leading dimensions are trained to stand alone
    matryoshka: bool = False

    @classmethod
    def build(cls, cfg: ModelConfig, modules: SentenceModules | None, pooling: str | None,
              device: torch.device) -> Pooler:
        """The checkpoint's sentence-transformers modules where it has them (`pooling`
        replaces their mode); otherwise `pooling`, by default mean for a bidirectional model
        and the last token for a decoder, then L2 normalization."""
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        if modules is None:
            default = "mean" if cfg.bidirectional else "last"
            return cls(pooling or default, (), True, cfg.hidden_size, False)
        dense = tuple(DenseLayer(d.weight.to(device),
                                 None if d.bias is None else d.bias.to(device), d.activation)
                      for d in modules.dense)
        mode = pooling or modules.pooling or ("mean" if cfg.bidirectional else "last")
        return cls(mode, dense, modules.normalize, cfg.hidden_size, True)

    @property
    def dimensions(self) -> int:
        """The size of the vectors it gives."""
        return self.dense[-1].weight.shape[0] if self.dense else self.hidden_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        if self.mode == "mean":
            x = h.mean(dim=0)
        else:
            x = h[-1] if self.mode == "last" else h[0]
        for d in self.dense:
            x = F.linear(x, d.weight, d.bias)
            if d.activation == "tanh":
                x = torch.tanh(x)
        return F.normalize(x, dim=-1) if self.normalize else x


def truncate(vector: list[float], dimensions: int) -> list[float]:
    """A Matryoshka embedding's first `dimensions` values, L2-normalized again."""
    v = torch.tensor(vector[:dimensions], dtype=torch.float32)
    return F.normalize(v, dim=-1).tolist()
