"""The network in MLX: a CausalLM's weights (loaded, merged and folded by the torch
loader, models/) converted once to MLX arrays, and a forward over the same
ForwardContext the runner builds for torch, reading and writing the KV arrays of
`MLXKV`. Its layer forms (models/family.py `MLXLayer`): pre-norm SwiGLU, sandwich-normed
GeGLU, and attention sinks with routed experts; a family names the form its layers take. Attention is `mx.fast.scaled_dot_product_attention` per group, with the window as
an explicit mask built from ring positions (models/context.py)."""

from __future__ import annotations

import math

import torch

from swaserve.kernels.q8_weight import Q8Weight
from swaserve.memory.layout import LayerKind
from swaserve.mlx import require
from swaserve.mlx.cache import MLXKV, to_mx, to_torch
from swaserve.mlx.quant import QuantizedLinear, quantized
from swaserve.mlx.step import StepGraph
from swaserve.models.base import CausalLM
from swaserve.models.context import ForwardContext
from swaserve.models.family import MLXLayer
from swaserve.models.head import HeadOutput
from swaserve.models.layers import rope_cos_sin


def _form(model: CausalLM) -> MLXLayer:
    form = model.cfg.family.mlx_layer if model.cfg.family is not None else None
    if form is None:
        raise ValueError(f"device: mlx does not run {type(model.layers[0]).__name__} layers")
    return form


class MLXCausalLM:
    """Called like the torch model: `model(ctx)` -> HeadOutput of float32 logits [S, V], a
    lazy MLX array the MLXSampler (mlx/sampler.py) samples from; the step's one `mx.eval`
    (`evaluate`) computes them, the KV arrays they wrote and the tokens together."""

    def __init__(self, model: CausalLM, kv: MLXKV, quantized: dict[str, Q8Weight] | None = None):
        self.mx = mx = require()
        self.cfg, self.kv = model.cfg, kv
        self.form = _form(model)
        self.dtype = to_mx(model.embed[:1]).dtype
        self.quant = self._quantized(model, quantized or {})
        head = self.quant.get("lm_head")
        tied = model.lm_head is None
        # a quantized tied head is the embedding too: rows are dequantized as they are looked up
        self.embed = None if head is not None and tied else to_mx(model.embed)
        self.head = (None if head is not None else self.embed if tied
                     else to_mx(model.lm_head))
        self.final_norm = to_mx(model.final_norm)
        self.layers = [{name: to_mx(p) for name, p in layer.named_parameters(recurse=False)
                        if p is not None and f"{i}.{name}" not in self.quant}
                       for i, layer in enumerate(model.layers)]
        self.meta = [(layer.sliding, layer.num_heads, layer.num_kv_heads, layer.head_dim)
                     for layer in model.layers]
        self.moe = ([(layer.top_k, layer.alpha, layer.limit) for layer in model.layers]
                    if self.form is MLXLayer.SINKS_MOE else None)
        self.rope = model.rope
        self.scale = model.scale
        self.scale_embeddings = model.scale_embeddings
        self.layout = kv.cache.layout
        self.dense = [self.layout.dense_index(i) for i in range(len(self.layout.layers))]
        self.attn = None  # the runner sets its torch attention here; unused
        self.step = StepGraph(on_lost=kv.reset)
        self._indices: dict[int, object] = {}  # this forward's context tensors (_index)
        mx.eval(*(a for a in (self.embed, self.head) if a is not None),
                *[a for d in self.layers for a in d.values()],
                *[a for q in self.quant.values() for a in (q.wq, q.scales, q.biases)])

    @staticmethod
    def _quantized(model: CausalLM, weights: dict[str, Q8Weight]) -> dict[str, QuantizedLinear]:
        """The GGUF weights (loader.load_q8_weights names) whose format MLX's quantized
        matmul takes exactly (mlx/quant.py), where their shape is the parameter's."""
        params = {"lm_head": model.head_weight}
        for i, layer in enumerate(model.layers):
            for name in ("qkv", "gate_up", "o", "down"):
                params[f"{i}.{name}"] = getattr(layer, name, None)
        out = {}
        for name, w in weights.items():
            p = params.get(name)
            if p is not None and w.shape == tuple(p.shape):
                q = quantized(w)
                if q is not None:
                    out[name] = q
        return out

    def _linear(self, x, i: int, name: str):
        """x @ layer i's weight `name`.T: MLX's quantized matmul where it holds it."""
        q = self.quant.get(f"{i}.{name}")
        if q is None:
            return x @ self.layers[i][name].T
        return q.apply(x).astype(x.dtype)

    def same_numerics_rows(self, m: int) -> int:
        return 1 << 62  # one kernel for every row count: drafts never change a row's numbers

    fused_decode_steps = None
    draws_keyed_rows = False  # the sampler draws every sampling row (mlx/sampler.py)

    # -- building blocks -------------------------------------------------------------------
    def _norm(self, x, w):
        mx = self.mx
        xf = x.astype(mx.float32)
        y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        return (y * w).astype(x.dtype)

    @staticmethod
    def _rotate(x, cos, sin):
        mx = require()
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    def _heads(self, qkv, meta, rope, p):
        _, h, kvh, d = meta
        t = qkv.shape[0]
        q = qkv[:, :h * d].reshape(t, h, d)
        k = qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)
        v = qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
        if "q_norm" in p:
            q, k = self._norm(q, p["q_norm"]), self._norm(k, p["k_norm"])
        cos, sin = rope
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _attend(self, i: int, q, k, v, ctx: ForwardContext, sinks=None):
        """Write the step's K/V into layer i's pool, then attend group by group."""
        mx = self.mx
        full = self.layout.layers[i].kind is LayerKind.FULL
        name, writes = ("full", ctx.view("full")) if full else ("ring", ctx.view("window"))
        ks, vs = self.kv.pools[name]
        j = self.dense[i]
        s = self._index(writes.slots)
        ks[j][s], vs[j][s] = k, v
        if not full and writes.pages is not None:
            idx, wslots = (self._index(t) for t in writes.pages)
            wk, wv = self.kv.pools["window_pages"]
            wk[j][wslots], wv[j][wslots] = k[idx], v[idx]
        h, d = q.shape[1], q.shape[2]
        outs = []
        for g in ctx.groups:
            view = g.full if full else g.sliding
            qg = q[g.start:g.end].reshape(g.batch, g.num_queries, h, d).transpose(0, 2, 1, 3)
            if view.fresh:
                kg, vg = (x[g.start:g.end].reshape(g.batch, g.num_queries, -1, d)
                          .transpose(0, 2, 1, 3) for x in (k, v))
            else:
                key_slots = self._index(view.key_slots)
                kg, vg = (x[j][key_slots].transpose(0, 2, 1, 3) for x in (ks, vs))
            if view.mask is not None:
                mask = self._index(view.mask)
            else:
                mask = "causal" if view.causal else None
            o = mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=self.scale, mask=mask,
                                                     sinks=sinks)
            outs.append(o.transpose(0, 2, 1, 3).reshape(g.batch * g.num_queries, h * d))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def _index(self, t: torch.Tensor):
        """A ForwardContext tensor as an MLX array, converted once per forward: every layer
        of a kind reads the same slots and masks."""
        a = self._indices.get(id(t))
        if a is None:
            a = self._indices[id(t)] = to_mx(t)
        return a

    # -- layers ----------------------------------------------------------------------------
    def _sandwich_geglu(self, i, x, rope, ctx):
        p, mx = self.layers[i], self.mx
        qkv = self._linear(self._norm(x, p["attn_norm"]), i, "qkv")
        q, k, v = self._heads(qkv, self.meta[i], rope, p)
        x = x + self._norm(self._linear(self._attend(i, q, k, v, ctx), i, "o"), p["post_attn_norm"])
        gate, up = mx.split(self._linear(self._norm(x, p["ffn_norm"]), i, "gate_up"), 2, axis=-1)
        gelu = 0.5 * gate * (1 + mx.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
        return x + self._norm(self._linear(gelu * up, i, "down"), p["post_ffn_norm"])

    def _pre_norm_swiglu(self, i, x, rope, ctx):
        p, mx = self.layers[i], self.mx
        qkv = self._linear(self._norm(x, p["attn_norm"]), i, "qkv")
        if "qkv_bias" in p:
            qkv = qkv + p["qkv_bias"]
        q, k, v = self._heads(qkv, self.meta[i], rope, p)
        x = x + self._linear(self._attend(i, q, k, v, ctx), i, "o")
        gate, up = mx.split(self._linear(self._norm(x, p["ffn_norm"]), i, "gate_up"), 2, axis=-1)
        return x + self._linear(gate * mx.sigmoid(gate) * up, i, "down")

    def _sinks_moe(self, i, x, rope, ctx):
        p, mx = self.layers[i], self.mx
        qkv = self._linear(self._norm(x, p["attn_norm"]), i, "qkv") + p["qkv_bias"]
        q, k, v = self._heads(qkv, self.meta[i], rope, p)
        o = self._attend(i, q, k, v, ctx, sinks=p["sinks"].astype(q.dtype))
        x = x + self._linear(o, i, "o") + p["o_bias"]
        h = self._norm(x, p["ffn_norm"])
        top_k, alpha, limit = self.moe[i]
        logits = h @ p["router"].T + p["router_bias"]
        idx = mx.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k]
        weights = mx.softmax(mx.take_along_axis(logits, idx, axis=-1).astype(mx.float32), axis=-1)
        # each token through its top_k experts only: gather_mm picks the expert matrices
        # [T, 1, 1, H] x gate_up[idx] -> [T, k, 1, 2I]
        gu = mx.gather_mm(h[:, None, None, :], p["gate_up"], rhs_indices=idx)[:, :, 0]
        gu = gu + p["gate_up_bias"][idx]
        gate = mx.minimum(gu[..., ::2], limit)
        up = mx.clip(gu[..., 1::2], -limit, limit)
        act = (up + 1) * gate * mx.sigmoid(gate * alpha)
        y = mx.gather_mm(act[:, :, None, :], p["down"], rhs_indices=idx)[:, :, 0]
        y = y + p["down_bias"][idx]
        out = (y.astype(mx.float32) * weights[:, :, None]).sum(axis=1)
        return x + out.astype(x.dtype)

    # -- the forward -----------------------------------------------------------------------
    def __call__(self, ctx: ForwardContext) -> HeadOutput:
        """The step's float32 logits [S, V] (HeadKind.LOGITS), lazy: the sampler builds on
        them and the step's `evaluate` runs the forward, the KV writes and the sampling in
        one `mx.eval`."""
        with self.step.stream():
            x = self._hidden_states(ctx)
            logits = self._logits(x[to_mx(ctx.logits_indices)])
            score = self._score(x, ctx) if ctx.score is not None else ()
        self.step.defer([logits, *score, *self.kv.arrays()],
                        (lambda: self._hand_score(ctx, score)) if score else None)
        return HeadOutput.of_logits(logits)

    @staticmethod
    def _hand_score(ctx: ForwardContext, score: tuple) -> None:
        sc = ctx.score
        sc.logprobs, sc.top_logprobs, sc.top_ids = (to_torch(a) for a in score)
        sc.top_ids = sc.top_ids.long()

    def _hidden_states(self, ctx: ForwardContext):
        """The last layer's output [S, hidden] (KV writes on the way)."""
        mx = self.mx
        self._indices = {}
        self.kv.replay()
        ids = to_mx(ctx.input_ids)
        x = (self.embed[ids] if self.embed is not None
             else self.quant["lm_head"].rows(ids).astype(self.dtype))
        if self.scale_embeddings:
            x = x * mx.array(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)
        rope = {}
        for sliding, (inv, s) in self.rope.items():
            if sliding and self.rope[True] is self.rope[False]:
                rope[True] = rope[False]
                continue
            cos, sin = rope_cos_sin(ctx.positions, inv, torch.float32, s)
            rope[sliding] = (to_mx(cos).astype(x.dtype), to_mx(sin).astype(x.dtype))
        layer = getattr(self, "_" + self.form.value)
        for i, meta in enumerate(self.meta):
            x = layer(i, x, rope[meta[0]], ctx)
        return x

    def _logits(self, x):
        mx = self.mx
        h = self._norm(x, self.final_norm)
        head = self.quant.get("lm_head")
        logits = (h @ self.head.T if head is None else head.apply(h)).astype(mx.float32)
        cap = self.cfg.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def _score(self, x, ctx: ForwardContext):
        """Prompt logprobs (models/head.py LMHead.score): the next token's and the top n."""
        mx = self.mx
        sc = ctx.score
        logits = self._logits(x[to_mx(sc.indices)])
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, to_mx(sc.targets)[:, None], axis=-1)[:, 0]
        n = max(sc.top_n, 1)
        order = mx.argsort(-lp, axis=-1)[:, :n]
        top = mx.take_along_axis(lp, order, axis=-1)
        return chosen, top[:, :sc.top_n], order[:, :sc.top_n].astype(mx.int64)
