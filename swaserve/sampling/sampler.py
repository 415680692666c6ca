"""On-device sampler: pure tensor functions over the batch, parameters packed once per step.

Order for each row (docs/architecture.md, Contracts: Sampling):
float32 logits -> + additive edit row (logit_bias; grammar masks join here as 0 / -inf rows)
-> penalties -> / temperature -> logprobs read here -> top-k / top-p / min-p -> Gumbel-max.

Greedy rows take the exact argmax and consume no randomness; a row that samples without a
seed draws one from the sampler's generator and is keyed like a seeded row. Temperature-only
rows skip the sort and hash only the ids that can win. Filtering rows (top-k, top-p, min-p)
draw in filtering.py; every path picks the same token for a keyed row because its noise is
keyed by vocabulary id (kernels/murmur.py).

A step's input is what the LM head gave (models/head.py HeadOutput): every row's logits, or
some or all rows' tokens beside the others' logits. The rows and their packed parameters are
in rows.py, the output in output.py.
"""

from __future__ import annotations

import dataclasses

import torch

from swaserve.kernels import gumbel, murmur
from swaserve.models.head import HeadKind, HeadOutput
from swaserve.sampling.filtering import BOUNDED_TOP_K, draw_filtered
from swaserve.sampling.output import SamplerOutput
from swaserve.sampling.rows import SamplerRow, SamplingTensors, light, plain_greedy

# float32 bytes of whole rows a call works on at once, in runs of rows: glibc gives every
# allocation of 32 MiB or more fresh pages from mmap, so [32, 262144] float32 temporaries
# would pay page faults on every call; 8 MiB ones come back from the heap
SAMPLE_BYTES = 8 << 20


ARGMAX_CHUNK = 512


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of the maximum of each row of x [B, V], like `argmax`, faster on CPU.

    `amax` is vectorised where `max(dim)` and `argmax` are not, so: the maximum of every chunk of ARGMAX_CHUNK entries, the first chunk that holds the
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
        """Row numbers as a tensor: `index_select` gathers rows faster than t[list]."""
        return torch.tensor(idx, dtype=torch.int64, device=self.device)

    def keyed(self, rows: list[SamplerRow]) -> list[SamplerRow]:
        """Rows that sample without a seed get a fresh one from the sampler's generator, so
        every sampling row's noise is keyed by vocabulary id: a temperature-only row hashes
        only the tokens that can win (`_seeded_gumbel_max`) instead of drawing float64
        noise for the whole vocabulary. Greedy rows consume no randomness. The
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
        """Every row sampled from its logits [B, V]: the float32 copies of the rows that need
        one, edited (`_widened`), each row's token (`_draw`), the logprobs asked for."""
        if all(plain_greedy(r) for r in rows):  # the common fast path: no edits, no copy
            return SamplerOutput(_argmax(logits), None, None, None, [])
        chunk = max(1, SAMPLE_BYTES // (logits.shape[1] * 4))
        if sum(not light(r) for r in rows) > chunk:  # whole-row temporaries, a run at a time
            return SamplerOutput.cat([self._sample(logits[i:i + chunk], rows[i:i + chunk])
                                      for i in range(0, len(rows), chunk)], self.device)
        rows = self.keyed(rows)
        st = SamplingTensors.build(rows, self.vocab, self.device)
        fl, pos = self._widened(logits, rows, st)
        tokens = self._draw(logits, fl, pos, st, len(rows))
        out = SamplerOutput(tokens, None, None, None, st.logprob_rows)
        if st.logprob_rows:
            idx = st.logprob_rows  # from their edited float32 copies, temperature-scaled
            edited = fl.index_select(0, self._index([pos[i] for i in idx]))
            lp = torch.log_softmax(edited / st.temperature[idx, None], dim=-1)
            out.chosen_logprob = lp.gather(1, tokens[idx][:, None])[:, 0]
            if st.num_logprobs:
                out.top_logprobs, out.top_ids = lp.topk(st.num_logprobs, dim=-1)
        return out

    def _widened(self, logits: torch.Tensor, rows: list[SamplerRow], st: SamplingTensors
                 ) -> tuple[torch.Tensor | None, dict[int, int]]:
        """(float32 copies of the rows that are edited, asked for logprobs or filtered past
        BOUNDED_TOP_K, with their logit bias, suppressed tokens, grammar masks and penalties;
        each such row's place among them). The other rows are read in the model dtype, which
        is exact: the widening is monotone and a positive temperature does not reorder a row."""
        # filtering rows with top_k above the bound need their whole row in float32, unless
        # gumbel.c reads the logits as they are (filtering.py `_draw_nucleus`)
        direct = gumbel.readable(logits) and gumbel.nucleus_entry() is not None
        wide_filter = [] if direct else [i for i in st.filter_rows
                                         if int(st.top_k[i]) > BOUNDED_TOP_K]
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
        return fl, pos

    def _draw(self, logits: torch.Tensor, fl: torch.Tensor | None, pos: dict[int, int],
              st: SamplingTensors, b: int) -> torch.Tensor:
        """int64 [b]: each row's token, from its float32 copy in `fl` (row `pos[i]`) where it
        has one, else from `logits` as they are: greedy rows' argmax, temperature-only
        rows' keyed Gumbel-max, filtering rows' draw (filtering.py)."""
        tokens = torch.empty(b, dtype=torch.int64, device=self.device)
        raw_greedy = [i for i in st.greedy_rows if i not in pos]
        if len(raw_greedy) * 2 >= b:  # most rows: reduce in place, no gathered copy
            tokens[raw_greedy] = _argmax(logits)[raw_greedy]
        elif raw_greedy:
            tokens[raw_greedy] = _argmax(logits.index_select(0, self._index(raw_greedy)))
        wide_greedy = [i for i in st.greedy_rows if i in pos]
        if wide_greedy:
            tokens[wide_greedy] = _argmax(fl.index_select(0, self._index([pos[i] for i in wide_greedy])))
        if st.temp_rows:  # every one keyed (`keyed`): hashing only the tokens that can win
            edited = [i for i in st.temp_rows if i in pos]
            if edited:
                tokens[edited] = self._seeded_gumbel_max(
                    fl.index_select(0, self._index([pos[i] for i in edited])), st, edited)
            raw = [i for i in st.temp_rows if i not in pos]
            if raw:
                src = logits if raw == list(range(b)) else logits.index_select(
                    0, self._index(raw))
                tokens[raw] = self._seeded_gumbel_max(src, st, raw)
        if st.filter_rows:
            tokens[st.filter_rows] = draw_filtered(logits, fl, pos, st, self.vocab)
        return tokens

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
