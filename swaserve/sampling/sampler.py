"""On-device sampler: pure tensor functions over the batch, parameters packed once per step.

Order for each row (docs/architecture.md, Contracts: Sampling):
float32 logits -> + additive edit row (logit_bias; grammar masks join here as 0 / -inf rows)
-> penalties -> / temperature -> logprobs read here -> top-k / top-p / min-p -> Gumbel-max.

Greedy rows take the exact argmax and consume no randomness; a row that samples without a
seed draws one from the sampler's generator and is keyed like a seeded row. Temperature-only
rows skip the sort and hash only the ids that can win. Filtering rows (top-k, top-p, min-p)
draw in filtering.py; every path picks the same token for a keyed row because its noise is
keyed by vocabulary id (murmur.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swaserve.kernels import gumbel
from swaserve.models.head import HeadKind, HeadOutput, KeyedRows
from swaserve.sampling import murmur
from swaserve.sampling.filtering import BOUNDED_TOP_K, draw_filtered
from swaserve.sampling.params import SamplingParams

# float32 bytes of whole rows a call works on at once, in runs of rows: glibc gives every
# allocation of 32 MiB or more fresh pages from mmap, so [32, 262144] float32 temporaries
# cost ~12 ms of page faults each (a copy into reused memory: 2.7 ms); 8 MiB ones come
# back from the heap
SAMPLE_BYTES = 8 << 20


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


ARGMAX_CHUNK = 512


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of the maximum of each row of x [B, V], like `argmax`, faster on CPU.

    `amax` is vectorised and ~5x faster than `max(dim)` (itself ~3x faster than `argmax`),
    so: the maximum of every chunk of ARGMAX_CHUNK entries, the first chunk that holds the
    row's maximum, then the index within that chunk alone."""
    b, n = x.shape
    c = ARGMAX_CHUNK
    k = n // c
    if k < 4:
        return x.max(dim=-1).indices
    chunk_max = x[:, :k * c].unflatten(1, (k, c)).amax(dim=-1)
    if n > k * c:
        chunk_max = torch.cat([chunk_max, x[:, k * c:].amax(dim=-1, keepdim=True)], dim=1)
    first = (chunk_max == chunk_max.amax(dim=-1, keepdim=True)).to(torch.int8).argmax(dim=-1)
    # the chunk's ids; a short last chunk repeats its final id, which cannot come first
    idx = (first[:, None] * c + torch.arange(c, device=x.device)).clamp_(max=n - 1)
    return idx.gather(1, x.gather(1, idx).max(dim=-1, keepdim=True).indices)[:, 0]


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


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow], idx: list[int],
                    pos: dict[int, int] | None = None) -> None:
    """In place on the rows of `logits` that hold batch rows `idx` (row `pos[i]`, or `i`):
    frequency/presence over output counts (OpenAI), repetition (CTRL) over tokens seen in
    prompt or output."""
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    at = [pos[i] for i in idx] if pos is not None else idx
    sub = logits[at]
    counts = torch.zeros(len(idx), vocab, dtype=torch.float32, device=device)
    seen = torch.zeros(len(idx), vocab, dtype=torch.bool, device=device)
    for j, i in enumerate(idx):
        out = torch.tensor(list(rows[i].output_ids), dtype=torch.int64, device=device)
        if out.numel():
            counts[j].scatter_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        prompt = torch.tensor(list(rows[i].prompt_ids), dtype=torch.int64, device=device)
        seen[j, prompt] = True
    seen |= counts > 0
    p = [rows[i].params for i in idx]
    freq = torch.tensor([x.frequency_penalty for x in p], device=device)[:, None]
    pres = torch.tensor([x.presence_penalty for x in p], device=device)[:, None]
    rep = torch.tensor([x.repetition_penalty for x in p], device=device)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[at] = sub


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _index(self, idx: list[int]) -> torch.Tensor:
        """Row numbers as a tensor: `index_select` gathers rows ~4x faster than t[list]."""
        return torch.tensor(idx, dtype=torch.int64, device=self.device)

    def keyed(self, rows: list[SamplerRow]) -> list[SamplerRow]:
        """Rows that sample without a seed get a fresh one from the sampler's generator, so
        every sampling row's noise is keyed by vocabulary id: a temperature-only row hashes
        only the tokens that can win (`_seeded_gumbel_max`) where float64 exponential noise
        for all 262,144 ids took ~11 ms a row. Greedy rows consume no randomness. The
        engine keys a step's rows before its forward (the LM head may draw keyed rows'
        tokens, `keyed_rows`); a call with unkeyed rows keys them itself."""
        free = [i for i, r in enumerate(rows) if r.seed is None and not r.params.greedy]
        if not free:
            return rows
        fresh = torch.randint(0, 2**62, (len(free),), generator=self.generator).tolist()
        rows = list(rows)
        for i, seed in zip(free, fresh):
            rows[i] = dataclasses.replace(rows[i], seed=seed)
        return rows

    @torch.inference_mode()
    def __call__(self, head: HeadOutput | torch.Tensor, rows: list[SamplerRow]
                 ) -> SamplerOutput:
        """A token for each of `rows` from what the LM head gave for them (a plain tensor:
        every row's logits), with the logprobs the rows ask for."""
        if not isinstance(head, HeadOutput):
            return self._sample(head, rows)
        if head.kind is HeadKind.LOGITS:
            return self._sample(head.logits, rows)
        if head.kind is HeadKind.ARGMAXES:
            if not all(plain_greedy(r) for r in rows):
                raise ValueError("the model returned argmaxes for rows that sample")
            return SamplerOutput(head.tokens, None, None, None, [])
        return self._split(head, rows)

    def _split(self, head: HeadOutput, rows: list[SamplerRow]) -> SamplerOutput:
        """The chosen rows' tokens as the model gave them (plain greedy rows and keyed
        temperature-only ones: `light`), the others sampled from their logits; logprob rows
        and failures indexed by the step's rows."""
        if len(rows) != head.shape[0] or not all(
                light(rows[i]) and (rows[i].params.greedy or rows[i].seed is not None)
                for i in head.chosen):
            raise ValueError("the model returned tokens for rows it cannot sample")
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        tokens[head.chosen] = head.tokens.to(self.device)
        others = head.others
        if not others:
            return SamplerOutput(tokens, None, None, None, [])
        out = self._sample(head.logits, [rows[i] for i in others])
        tokens[others] = out.tokens
        return SamplerOutput(tokens, out.chosen_logprob, out.top_logprobs, out.top_ids,
                             [others[i] for i in out.logprob_rows],
                             {others[i]: e for i, e in out.failed.items()})

    def _sample(self, logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerOutput:
        """Every row sampled from its logits [B, V]."""
        if all(plain_greedy(r) for r in rows):  # the common fast path: no edits, no copy
            return SamplerOutput(_argmax(logits), None, None, None, [])
        chunk = max(1, SAMPLE_BYTES // (logits.shape[1] * 4))
        if sum(not light(r) for r in rows) > chunk:  # whole-row temporaries, a run at a time
            return SamplerOutput.cat([self._sample(logits[i:i + chunk], rows[i:i + chunk])
                                      for i in range(0, len(rows), chunk)], self.device)
        rows = self.keyed(rows)
        st = SamplingTensors.build(rows, self.vocab, self.device)
        # filtering rows with top_k above the bound need their whole row in float32, unless
        # gumbel.c reads the logits as they are (filtering.py `_draw_nucleus`)
        direct = gumbel.readable(logits) and gumbel.nucleus_entry() is not None
        wide_filter = [] if direct else [i for i in st.filter_rows
                                         if int(st.top_k[i]) > BOUNDED_TOP_K]
        # Only rows that are edited, asked for logprobs or filtered past the bound get a
        # float32 copy; the others are read in the model dtype, which is exact: the widening
        # is monotone and a positive temperature does not reorder a row.
        wide = sorted(set(st.edited_rows) | set(st.logprob_rows) | set(wide_filter))
        pos = {r: j for j, r in enumerate(wide)}
        fl = logits.index_select(0, self._index(wide)).float() if wide else None
        if st.bias_index is not None:
            remap = torch.full((len(rows),), -1, dtype=torch.int64, device=self.device)
            remap[wide] = torch.arange(len(wide), device=self.device)
            fl.index_put_((remap[st.bias_index[0]], st.bias_index[1]), st.bias_value,
                          accumulate=True)
        for i, r in enumerate(rows):  # in place, row by row: no gather of the masked rows
            if r.grammar_bias is not None:
                fl[pos[i]].add_(r.grammar_bias)
        apply_penalties(fl, rows, st.penalty_rows, pos)
        temp = st.temperature

        def scaled(idx: list[int]) -> torch.Tensor:  # edited, temperature-scaled, float32
            return fl.index_select(0, self._index([pos[i] for i in idx])) / temp[idx, None]

        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        raw_greedy = [i for i in st.greedy_rows if i not in pos]
        if len(raw_greedy) * 2 >= len(rows):  # most rows: reduce in place, no gathered copy
            tokens[raw_greedy] = _argmax(logits)[raw_greedy]
        elif raw_greedy:
            tokens[raw_greedy] = _argmax(logits.index_select(0, self._index(raw_greedy)))
        wide_greedy = [i for i in st.greedy_rows if i in pos]
        if wide_greedy:
            tokens[wide_greedy] = _argmax(fl.index_select(0, self._index([pos[i] for i in wide_greedy])))
        if st.temp_rows:  # every one keyed (`_keyed`): hashing only the tokens that can win
            edited = [i for i in st.temp_rows if i in pos]
            if edited:
                tokens[edited] = self._seeded_gumbel_max(
                    fl.index_select(0, self._index([pos[i] for i in edited])), st, edited)
            raw = [i for i in st.temp_rows if i not in pos]
            if raw:
                src = logits if raw == list(range(len(rows))) else logits.index_select(
                    0, self._index(raw))
                tokens[raw] = self._seeded_gumbel_max(src, st, raw)
        if st.filter_rows:
            tokens[st.filter_rows] = draw_filtered(logits, fl, pos, st, self.vocab)
        out = SamplerOutput(tokens, None, None, None, st.logprob_rows)
        if st.logprob_rows:
            lp = torch.log_softmax(scaled(st.logprob_rows), dim=-1)
            out.chosen_logprob = lp.gather(1, tokens[st.logprob_rows][:, None])[:, 0]
            if st.num_logprobs:
                out.top_logprobs, out.top_ids = lp.topk(st.num_logprobs, dim=-1)
        return out

    def _seeded_gumbel_max(self, logits: torch.Tensor, st: SamplingTensors, idx: list[int]
                           ) -> torch.Tensor:
        """argmax(x + g) over the whole vocabulary for keyed rows `idx` (their logits [R, V],
        edited where edited; x = float64(float32(logits) / temperature)), hashing only the
        tokens that can win. Noise never exceeds NOISE_MAX (the u = 1 clamp), so a token
        whose x is below (x[a] + g[a]) - NOISE_MAX for any token a cannot beat a; with a =
        the largest logit this keeps a few hundred ids instead of the whole vocabulary, and
        kernels/gumbel.c (float32 logits) those few of them whose hash can carry them to
        that score. Otherwise the candidates are found on the logits themselves, against
        the bound times the temperature less a margin (2^-20 of it, past float32's rounding
        of x). x is only computed for the candidates. Exact: the same token as hashing every
        id, ties to the smallest id like argmax."""
        rows_t = torch.tensor(idx, dtype=torch.int64, device=self.device)
        prefix = st.prefix[rows_t]
        temp = st.temperature[rows_t]
        top = _argmax(logits)  # a largest x too: dividing by a temperature keeps the order
        best = murmur.keyed_scores(logits.gather(1, top[:, None])[:, 0], temp, prefix, top)
        found = gumbel.candidates(logits, temp, best, prefix)
        if found is not None:
            r, t = found
        else:
            bound = best - murmur.NOISE_MAX
            margin = (bound.abs() + 1) * 2.0**-20
            r, t = (logits >= ((bound - margin) * temp.double()).float()[:, None]).nonzero(
                as_tuple=True)
        first = murmur.keyed_max(r, t, murmur.keyed_scores(logits[r, t], temp[r], prefix[r], t),
                                 len(idx))
        # a row without candidates has a NaN logit (its bound is NaN): its largest, as a
        # token in range (whose request the engine then goes on with, as for a greedy row)
        return torch.where(first >= 0, first, top)
