"""The sampler in MLX ops: sampling/sampler.py's contract on the MLX logits of a step, built
into the same lazy graph as the forward and evaluated with it in one `mx.eval`.

Same order of edits and filters (logit bias and grammar masks -> penalties -> temperature
-> logprobs -> top-k / top-p / min-p -> Gumbel-max), same noise: MurmurHash3 keyed by
(seed, position, token id) in uint32 ops (MLX's uint32 products wrap mod 2**32, so no
16-bit split is needed), the Gumbel transform, the final add and argmax in float64 on a
CPU stream (Metal has no float64). A seeded row therefore draws the token the torch
sampler draws from the same logits. Unseeded rows get a fresh seed per step from the
sampler's generator and go down the same path.

Filtering rows draw from sorted candidates: a row with top_k <= BOUNDED_TOP_K from that
many, a larger top_k from WIDE_TOP_K or the whole vocabulary; a row with top_k = all from
BOUNDED_TOP_K candidates, which is exact when its last candidate is filtered out (top-p
and min-p are monotone in rank). When that last candidate is kept the graph cannot know it
before it runs, so those rows alone are drawn again from wider candidates after the step's
eval: a second, small eval, only for nuclei wider than BOUNDED_TOP_K.
"""

from __future__ import annotations

import torch

from swaserve.kernels import murmur
from swaserve.mlx import require
from swaserve.mlx.cache import to_mx, to_torch
from swaserve.mlx.step import StepGraph
from swaserve.models.head import HeadKind, HeadOutput
from swaserve.sampling.filtering import BOUNDED_TOP_K, WIDE_TOP_K
from swaserve.sampling.output import SamplerOutput
from swaserve.sampling.rows import SamplerRow, SamplingTensors, plain_greedy
from swaserve.sampling.sampler import Sampler


def _u32(c: int):
    mx = require()
    return mx.array(c, dtype=mx.uint32)


def _rotl(x, r: int):
    return (x << r) | (x >> (32 - r))


def _block(h, k):
    k = _rotl(k * _u32(murmur.C1), 15) * _u32(murmur.C2)
    return _rotl(h ^ k, 13) * _u32(5) + _u32(0xE6546B64)


def murmur_hash(prefix, tokens):
    """kernels/murmur.py's `murmur_hash` in uint32 MLX ops: prefix [B] (the row state after
    seed and position), tokens [B, N] or [N] -> uint32 hashes [B, N], bit for bit."""
    mx = require()
    if tokens.ndim == 1:
        tokens = tokens[None, :]
    h = _block(prefix.astype(mx.uint32)[:, None], tokens.astype(mx.uint32)) ^ _u32(16)
    h = (h ^ (h >> 16)) * _u32(murmur.F1)
    h = (h ^ (h >> 13)) * _u32(murmur.F2)
    return h ^ (h >> 16)


def gumbel_from_hash(h):
    """Gumbel noise in float64 (call on a CPU stream): -log(max(-log u, 2^-32)),
    u = h / (2^32 - 1), as kernels/murmur.py. MLX's float64 log is not always correctly
    rounded (torch's is), so a value may differ from torch's in its last bit."""
    mx = require()
    u = h.astype(mx.float64) / float(murmur.M32)
    return -mx.log(mx.maximum(-mx.log(u), murmur.NOISE_MAX_EXP_CLAMP))


def filter_sorted(vals, top_k, top_p, min_p, log_norm=None):
    """sampling/sampler.py's `filter_sorted` in MLX ops: the keep mask of sorted candidates
    vals [R, N]; `log_norm` = (values [R], rows [R] bool): those rows' probabilities are
    normalised over the whole vocabulary."""
    mx = require()
    n = vals.shape[1]
    rank = mx.arange(n)[None, :]
    keep = rank < top_k[:, None]
    masked = mx.where(keep, vals, -mx.inf)
    probs = mx.softmax(masked, axis=-1)
    if log_norm is not None:
        norm, rows = log_norm
        probs = mx.where(rows[:, None], mx.exp(masked - norm[:, None]), probs)
    before = mx.cumsum(probs, axis=-1) - probs
    keep = keep & (before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    return keep | (rank == 0)


class MLXSampler(Sampler):
    """Called like `Sampler`: `(head, rows) -> SamplerOutput` (torch tensors, read by the
    engine's postprocess), with `head` the MLX model's HeadOutput (every row's logits, a
    lazy MLX array) or that array; `step` is the StepGraph the forward deferred its arrays
    to, evaluated with the sampling graph."""

    def __init__(self, vocab_size: int, step: StepGraph, seed: int = 0):
        super().__init__(vocab_size, torch.device("cpu"), seed)
        self.mx = require()
        self.step = step

    def __call__(self, head, rows: list[SamplerRow]) -> SamplerOutput:
        logits = head
        if isinstance(head, HeadOutput):
            if head.kind is not HeadKind.LOGITS:
                raise ValueError(f"the MLX sampler takes logits, not {head.kind.value}")
            logits = head.logits
        with self.step.stream():
            return self._sample(logits, rows)

    def _ix(self, idx: list[int]):
        return self.mx.array(idx, dtype=self.mx.int32)

    def _sample(self, logits, rows: list[SamplerRow]) -> SamplerOutput:
        mx = self.mx
        if not rows:
            self.step.evaluate()
            return SamplerOutput(torch.zeros(0, dtype=torch.int64), None, None, None, [])
        if all(plain_greedy(r) for r in rows):
            tokens = mx.argmax(logits, axis=-1)
            self.step.evaluate(tokens)
            return SamplerOutput(to_torch(tokens).long(), None, None, None, [])
        rows = self.keyed(rows)
        st = SamplingTensors.build(rows, self.vocab, self.device)
        prefix = to_mx(st.prefix).astype(mx.uint32)
        temp = to_mx(st.temperature)
        x = self._edited(logits.astype(mx.float32), rows, st) / temp[:, None]
        tokens = mx.argmax(x, axis=-1)  # greedy rows keep it; the others are drawn below
        if st.temp_rows:
            ix = self._ix(st.temp_rows)
            ids = mx.arange(self.vocab, dtype=mx.uint32)
            tokens[ix] = self._gumbel_max(x[ix], prefix[ix], ids).astype(tokens.dtype)
        wide: list[tuple[int, object]] = []  # filter rows whose draw waits on their keep mask
        if st.filter_rows:
            tokens, wide = self._filtered(x, tokens, prefix, st)
        lp = chosen = None
        top: tuple = ()
        if st.logprob_rows:
            lp = x[self._ix(st.logprob_rows)]
            # less the max first, as torch's log_softmax: x - logsumexp(x) cancels to the
            # float32 spacing of x (~0.03 at x ~ 5e5: logits over a temperature of 1e-5)
            lp = lp - mx.max(lp, axis=-1, keepdims=True)
            lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
            chosen = self._chosen(lp, tokens, st)
            if st.num_logprobs:
                n = st.num_logprobs
                ids = mx.argpartition(-lp, n - 1, axis=-1)[:, :n]
                vals = mx.take_along_axis(lp, ids, axis=-1)
                order = mx.argsort(-vals, axis=-1)
                top = (mx.take_along_axis(vals, order, axis=-1),
                       mx.take_along_axis(ids, order, axis=-1))
        self.step.evaluate(tokens, *(() if lp is None else (lp, chosen)), *top,
                            *(keep_last for _, keep_last in wide))
        if any(bool(keep_last.item()) for _, keep_last in wide):
            tokens = self._redraw(x, tokens, prefix, st, wide)
            if lp is not None:
                chosen = self._chosen(lp, tokens, st)
        out = SamplerOutput(to_torch(tokens).long(), None, None, None, st.logprob_rows)
        if lp is not None:
            out.chosen_logprob = to_torch(chosen)
            if top:
                out.top_logprobs, out.top_ids = to_torch(top[0]), to_torch(top[1]).long()
        return out

    def _chosen(self, lp, tokens, st: SamplingTensors):
        """Each logprob row's logprob of its token."""
        picked = tokens[self._ix(st.logprob_rows)].astype(self.mx.int32)
        return self.mx.take_along_axis(lp, picked[:, None], axis=-1)[:, 0]

    def _edited(self, x, rows: list[SamplerRow], st: SamplingTensors):
        """float32 logits with the logit bias, the suppressed tokens, the grammar masks and
        the penalties applied, in the torch sampler's order."""
        mx = self.mx
        if st.bias_index is not None:
            r, t = (to_mx(a).astype(mx.int32) for a in st.bias_index)
            x = x.at[r, t].add(to_mx(st.bias_value))
        masked = [i for i, r in enumerate(rows) if r.grammar_bias is not None]
        if masked:
            x = x.at[self._ix(masked)].add(to_mx(torch.stack([rows[i].grammar_bias
                                                               for i in masked])))
        if st.penalty_rows:
            x[self._ix(st.penalty_rows)] = self._penalised(x, rows, st.penalty_rows)
        return x

    def _penalised(self, x, rows: list[SamplerRow], idx: list[int]):
        """sampling/sampler.py's `apply_penalties` on rows `idx` of x."""
        mx = self.mx
        shape = (len(idx), self.vocab)

        def tally(ids_of) -> object:  # [R, V] float32 counts of each row's ids
            r = [j for j, i in enumerate(idx) for _ in ids_of(rows[i])]
            if not r:
                return mx.zeros(shape, dtype=mx.float32)
            t = [t for i in idx for t in ids_of(rows[i])]
            return mx.zeros(shape, dtype=mx.float32).at[self._ix(r), self._ix(t)].add(1.0)

        counts = tally(lambda r: r.output_ids)
        seen = (tally(lambda r: r.prompt_ids) > 0) | (counts > 0)
        p = [rows[i].params for i in idx]
        freq, pres, rep = (mx.array([getattr(q, name) for q in p], dtype=mx.float32)[:, None]
                           for name in ("frequency_penalty", "presence_penalty",
                                        "repetition_penalty"))
        sub = x[self._ix(idx)]
        sub = mx.where(seen, mx.where(sub > 0, sub / rep, sub * rep), sub)
        return sub - freq * counts - pres * (counts > 0).astype(mx.float32)

    def _gumbel_max(self, vals, prefix, ids):
        """argmax(vals + noise) in float64 on this thread's CPU stream -> int positions
        into vals' last axis."""
        mx = self.mx
        h = murmur_hash(prefix, ids)
        with mx.stream(self.step.cpu_stream()):
            return mx.argmax(vals.astype(mx.float64) + gumbel_from_hash(h), axis=-1)

    def _candidates(self, x, width: int):
        """The first `width` entries of each row of x in (value descending, id ascending)
        order, and their ids (filtering.py `ordered_top`: argpartition picks equal values
        at the cut as it likes). argsort is stable: equal values stay in id order."""
        mx = self.mx
        n = x.shape[1]
        if width >= n:
            ids = mx.argsort(-x, axis=-1)
            return mx.take_along_axis(x, ids, axis=-1), ids
        ids = mx.sort(mx.argpartition(-x, width - 1, axis=-1)[:, :width], axis=-1)
        cut = mx.min(mx.take_along_axis(x, ids, axis=-1), axis=-1, keepdims=True)
        # rows where a value equal to the cut was left out: the smallest such ids belong
        crossed = mx.sum(x == cut, axis=-1) > mx.sum(mx.take_along_axis(x, ids, axis=-1) == cut,
                                                    axis=-1)
        if mx.any(crossed).item():  # (a full pass more, only when some tie crosses the cut)
            above, at = x > cut, x == cut
            room = width - mx.sum(above, axis=-1, keepdims=True)
            pick = above | (at & (mx.cumsum(at.astype(mx.int32), axis=-1) <= room))
            pos = mx.arange(n, dtype=mx.int32)
            # the picked ids first (a row with a NaN picks fewer: any others fill it)
            exact = mx.sort(mx.argpartition(mx.where(pick, pos, pos + n), width - 1,
                                            axis=-1)[:, :width], axis=-1)
            ids = mx.where(crossed[:, None], exact.astype(ids.dtype), ids)
        ids = mx.take_along_axis(ids, mx.argsort(-mx.take_along_axis(x, ids, axis=-1), axis=-1),
                                 axis=-1)
        return mx.take_along_axis(x, ids, axis=-1), ids

    def _widths(self) -> list[int]:
        return sorted({min(w, self.vocab) for w in (BOUNDED_TOP_K, WIDE_TOP_K, self.vocab)})

    def _draw(self, x, prefix, st: SamplingTensors, group: list[int], width: int):
        """Rows `group` drawn from `width` sorted candidates -> (tokens, last candidate
        kept). Rows with top_k > width are normalised over the whole vocabulary."""
        mx = self.mx
        ix = self._ix(group)
        sub = x[ix]
        vals, ids = self._candidates(sub, width)
        top_k = to_mx(st.top_k[group]).astype(mx.int32)
        log_norm = None
        if any(int(st.top_k[i]) > width for i in group):
            log_norm = (mx.logsumexp(sub, axis=-1), top_k > width)
        keep = filter_sorted(vals, top_k, to_mx(st.top_p[group]), to_mx(st.min_p[group]),
                             log_norm)
        h = murmur_hash(prefix[ix], ids)
        with mx.stream(self.step.cpu_stream()):
            score = mx.where(keep, vals.astype(mx.float64) + gumbel_from_hash(h), -mx.inf)
            best = mx.argmax(score, axis=-1)
        return mx.take_along_axis(ids, best[:, None], axis=-1)[:, 0], keep[:, -1]

    def _filtered(self, x, tokens, prefix, st: SamplingTensors):
        """Tokens of the filter rows at the first width their top_k fits (top_k = all:
        the first width, provisionally) -> (tokens, [(row, its last candidate kept)]) for the
        provisional rows."""
        widths = self._widths()
        start: dict[int, list[int]] = {}
        for i in st.filter_rows:
            k = int(st.top_k[i])
            w = widths[0] if k >= self.vocab else next(w for w in widths if w >= k)
            start.setdefault(w, []).append(i)
        wide = []
        for w, group in start.items():
            drawn, keep_last = self._draw(x, prefix, st, group, w)
            tokens[self._ix(group)] = drawn.astype(tokens.dtype)
            wide += [(i, keep_last[j]) for j, i in enumerate(group)
                     if int(st.top_k[i]) >= self.vocab and w < self.vocab]
        return tokens, wide

    def _redraw(self, x, tokens, prefix, st: SamplingTensors, wide):
        """Rows with top_k = all whose last candidate was kept: drawn again from wider
        candidates (evaluated: the step's forward already is), up to the whole vocabulary."""
        widths = self._widths()
        left = [i for i, keep_last in wide if bool(keep_last.item())]
        w = widths[0]
        while left:
            w = widths[widths.index(w) + 1]
            drawn, keep_last = self._draw(x, prefix, st, left, w)
            tokens[self._ix(left)] = drawn.astype(tokens.dtype)
            self.mx.eval(tokens, keep_last)
            last = keep_last.tolist()
            left = [i for j, i in enumerate(left) if last[j] and w < self.vocab]
        return tokens
