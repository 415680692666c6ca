"""CausalLM: what every family shares — embedding, a stack of layers, final norm, the LM
head (its weight here, the head itself in models/head.py), and one RoPE table per layer kind
(Gemma 3 uses another base on its sliding layers, Gemma 4 another head size too).

A family sets `layer` (its decoder layer class), `weights` (its checkpoint name map),
`scale_embeddings` when it multiplies embeddings by sqrt(hidden), and `fused_decode` when
its layers are the shape that kernels/decode.c runs a decode step of in one call."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.kernels.norm import qk_norm_rope_bf16
from swaserve.kernels.q8 import same_kernel_rows
from swaserve.kernels.q8_weight import Q8Weight
from swaserve.models.attention import AttentionBackend, SDPABackend
from swaserve.models.config import ModelConfig
from swaserve.models.context import ForwardContext
from swaserve.models.fused_decode import FusedDecode
from swaserve.models.head import HeadOutput, LMHead
from swaserve.models.layers import apply_rope, linear, rms_norm, rope_cos_sin, rope_inv_freq
from swaserve.models.weight_map import WeightMap, load_by_map
from swaserve.profile import timed


class DecoderLayerBase(nn.Module):
    """What every decoder layer has: its index and kind, the attention shapes, merged q/k/v
    and output projections (`qkv`, `o`), and the RMSNorm epsilon. Under tensor parallelism
    (`tp`, set by CausalLM.set_tensor_parallel) its shapes are one rank's and the products
    named in TP_REDUCE (row parallel: a partial sum on each rank) are all-reduced."""

    TP_REDUCE: tuple[str, ...] = ("o", "down")
    tp = None  # the TPGroup, when the layer is one rank's shard

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        h, d, kvh = cfg.hidden_size, cfg.head_dim_of(index), cfg.kv_heads_of(index)
        self.index = index
        self.sliding = cfg.layer_types[index] == "sliding"
        self.q_size, self.kv_size = cfg.num_heads * d, kvh * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, kvh, d
        self.eps = cfg.rms_norm_eps
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h))
        self.o = nn.Parameter(torch.empty(h, self.q_size))
        self.q8: dict[str, Q8Weight] = {}  # exact int8 copies for small batches (use_q8)

    @timed("norms + activations")  # q/k norms and RoPE
    def heads(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of [T, (H + 2 KVH) * D]: q and k RMS-normed per head (when the family
        has those norms) and rotated by RoPE; one C call for bf16 on the CPU."""
        cos, sin = rope
        fused = qk_norm_rope_bf16(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                  q_norm, k_norm, cos, sin, self.eps)
        if fused is not None:
            v = qkv[:, self.q_size + self.kv_size:]
            return (*fused, v.view(qkv.shape[0], self.num_kv_heads, self.head_dim))
        q, k, v = self.split_heads(qkv)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, self.eps), rms_norm(k, k_norm, self.eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def project(self, x: torch.Tensor, name: str, ctx: ForwardContext) -> torch.Tensor:
        """x @ self.<name>.T (`linear`), through the weight's int8 copy where it has one, as
        the step says (ctx.row_block, ctx.q8_kernel)."""
        out = linear(x, getattr(self, name), ctx.row_block, self.q8.get(name), ctx.q8_kernel)
        if self.tp is not None and name in self.TP_REDUCE:
            self.tp.all_reduce(out)
        return out

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (H + 2 KVH) * D] -> q [T, H, D], k and v [T, KVH, D]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(t, self.num_heads, self.head_dim),
                k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))


class CausalLM(nn.Module):
    layer: type[nn.Module]
    weights: WeightMap
    scale_embeddings = False  # Gemma multiplies embeddings by sqrt(hidden)
    fused_decode = False  # decode steps' layers in one C call (kernels/decode.c)
    runs_on_mlx = True  # the MLX backend (mlx/model.py) has this family's layers

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.final_norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=torch.float32))
        self.layers = nn.ModuleList(self.layer(cfg, i) for i in range(cfg.num_layers))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.tp = None  # the TPGroup when this is one rank's shard (set_tensor_parallel)
        # the LM head over `head_weight` (models/head.py); `use_q8` gives it int8 blocks
        self.head = LMHead(cfg.final_logit_softcapping)
        self._q8_tilings: frozenset[tuple[bool, int | None]] | None = None  # same_numerics_rows
        self.scale = cfg.attn_scale
        self.attn: AttentionBackend | None = None
        self._fused: tuple[AttentionBackend, FusedDecode] | None = None  # for self.attn
        full_dim, local_dim = cfg.kind_head_dim(False), cfg.kind_head_dim(True)
        full = rope_inv_freq(full_dim, cfg.rope_theta, cfg.rope_scaling)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        same = (local_theta == cfg.rope_theta and cfg.rope_local_scaling == cfg.rope_scaling
                and local_dim == full_dim)
        local = full if same else rope_inv_freq(local_dim, local_theta, cfg.rope_local_scaling)
        self.rope = {False: full, True: local}  # keyed by layer.sliding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from HF-named checkpoint tensors."""
        load_by_map(self, weights, self.weights, self.layers)

    @staticmethod
    def dense_weights(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as plain dense ones (a family with packed formats
        unpacks them here), for slicing by name (checkpoint/shard.py)."""
        return weights

    def set_tensor_parallel(self, group) -> None:
        """Make this model (built at one rank's shapes, checkpoint/shard.py) rank
        `group.rank`'s shard: embedding lookups and row-parallel products are summed over
        the group, the LM head's logits gathered on rank 0. The fused C decode step reads
        whole layers: it is off."""
        self.tp = group
        self.head.tp = group
        self.fused_decode = False
        for layer in self.layers:
            layer.tp = group

    def use_q8(self, q8: dict[str, Q8Weight], head_screen: bool = True,
               int8_activations: bool = False) -> None:
        """Exact int8 copies of weights (loader.load_q8_weights): "lm_head", "<i>.qkv",
        "<i>.gate_up", "<i>.o", "<i>.down"; each is checked against its bf16 parameter's
        shape. With `head_screen`, greedy steps take the head's tokens through its screen
        where one runs here; with `int8_activations`, the layers' weights take int8
        activations where they would take bf16 ones on q8_dpbf16 (q8_dpbusd)."""
        def fits(w: Q8Weight | None, p: torch.Tensor | None) -> bool:
            return w is not None and p is not None and w.shape == tuple(p.shape)

        self._fused = None  # it holds the weights' addresses: rebuilt on the next step
        self._q8_tilings = None
        head = q8.get("lm_head")
        if fits(head, self.head_weight):
            self.head.use_q8(head, head_screen)
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "gate_up", "o", "down"):
                w = q8.get(f"{i}.{name}")
                if fits(w, getattr(layer, name, None)):
                    w.int8_activations = int8_activations
                    layer.q8[name] = w

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's bf16 weight [V, hidden]: the embedding where the family ties them."""
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def draws_keyed_rows(self) -> bool:
        """Whether `ctx.keyed` can be of use (LMHead.draws_keyed_rows: ForwardContext.keyed
        is built each step only then)."""
        return self.head.draws_keyed_rows

    @property
    def pending_bytes(self) -> int:
        """Memory the model will allocate after loading (the LM head screen's copy, made at
        the first large greedy step)."""
        return self.head.pending_bytes

    def same_numerics_rows(self, m: int) -> int:
        """The most rows a decode step of m rows may grow to with speculative drafts and
        still multiply each row with the kernel it takes without them (q8.same_kernel_rows)."""
        if self._q8_tilings is None:  # once per set of int8 weights (use_q8 resets it)
            weights = [w for layer in self.layers for w in getattr(layer, "q8", {}).values()]
            if self.head.q8 is not None:
                weights.append(self.head.q8)
            self._q8_tilings = frozenset((w.tiled, w.vnni_limit, w.int8_activations)
                                         for w in weights)
        return min((same_kernel_rows(m, *tiling) for tiling in self._q8_tilings),
                   default=1 << 62)

    @property
    def fused_decode_steps(self) -> int | None:
        """Decode steps the fused call ran since it was (re)built; None before any decode
        step asked for it, 0 when it declines this model's layers."""
        if self._fused is None:
            return None
        return self._fused[1].steps if self._fused[1].ok else 0

    @timed("fused decode layers")
    def _fused_layers(self, x: torch.Tensor, rope: dict, ctx: ForwardContext
                      ) -> torch.Tensor | None:
        """All layers of a decode step in one C call where the family and the step allow
        (models/fused_decode.py, kernels/decode.c): the same bits as the layers one by one."""
        if not self.fused_decode or not isinstance(self.attn, SDPABackend):
            return None
        if self._fused is None or self._fused[0] is not self.attn:
            self._fused = (self.attn, FusedDecode(self.layers, self.attn))
        return self._fused[1].run(x, rope, ctx, self.scale)

    @timed("forward (embedding, rope, rest)")
    def forward(self, ctx: ForwardContext) -> HeadOutput | None:
        """What the LM head gives for the flattened batch rows `ctx.logits_indices`
        (models/head.py: their logits, or tokens where the step allows); None on a
        tensor-parallel rank past 0. Logits are in the model dtype: the sampler widens them
        to float32 only where it edits or samples (a greedy batch takes the argmax of the
        bf16 values, which is the argmax of their float32 copies)."""
        x, rope = self._inputs(ctx)
        x = self.run_layers(x, rope, ctx)
        if ctx.score is not None:  # before the sampled rows: they reuse the head's buffer
            self.head.score(x, self.head_weight, ctx, self._final_norm)
        return self.head(self._final_norm(x[ctx.logits_indices]), self.head_weight, ctx)

    def run_layers(self, x: torch.Tensor, rope: dict, ctx: ForwardContext) -> torch.Tensor:
        """The decoder layers over the embedded rows `x` (`rope`: cos/sin by layer.sliding)."""
        fused = self._fused_layers(x, rope, ctx)
        if fused is not None:
            return fused
        for layer in self.layers:
            x = layer(x, rope[layer.sliding], ctx, self.attn, self.scale)
        return x

    def encode(self, ctx: ForwardContext, attn: AttentionBackend) -> torch.Tensor:
        """The final-normed hidden state of every row of `ctx` [T, hidden], attending
        through `attn`: an embedding forward (models/encoder.py), which keeps no KV and
        reads no LM head."""
        x, rope = self._inputs(ctx)
        for layer in self.layers:
            x = layer(x, rope[layer.sliding], ctx, attn, self.scale)
        return self._final_norm(x)

    def _inputs(self, ctx: ForwardContext) -> tuple[torch.Tensor, dict]:
        """The rows' embeddings (scaled where the family scales them) and the RoPE cos/sin
        of their positions per layer kind."""
        x = self._embed(ctx.input_ids)
        if self.scale_embeddings:
            x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)
        rope = {}
        for sliding, (inv, s) in self.rope.items():
            same = sliding and self.rope[True] is self.rope[False]
            rope[sliding] = rope[False] if same else rope_cos_sin(ctx.positions, inv, x.dtype, s)
        return x, rope

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.embed)
        rows = self.embed.shape[0]  # this rank's vocabulary shard
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))
