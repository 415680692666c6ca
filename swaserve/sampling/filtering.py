"""Filtering rows (top-k, top-p, min-p): the keep mask of sorted candidates
(`filter_sorted`, the definition) and the draws (`draw_filtered`).

Rows whose float32 logits kernels/gumbel.c reads take their kept set from it without
sorting (`_draw_nucleus`); the others, and rows it leaves, draw on `[B, K_max]` candidates
(`ordered_top`: the first of (x descending, id ascending), ties at the cut included) when
every one of them has top_k <= BOUNDED_TOP_K, else on WIDE_TOP_K candidates or the sorted
vocabulary (`_draw_sorted`, `_draw_wide`). A row's noise is keyed by vocabulary id
(kernels/murmur.py), so every path draws the same token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swaserve.kernels import gumbel, murmur

if TYPE_CHECKING:
    from swaserve.sampling.rows import SamplingTensors

BOUNDED_TOP_K = 1024
WIDE_TOP_K = 8192  # the second width tried before a row sorts the whole vocabulary


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as a tensor: `index_select` gathers rows faster than t[list]."""
    return torch.tensor(idx, dtype=torch.int64, device=device)


# candidates past the width that show whether equal values cross the cut (bf16 rows start
# at the second: their 1,024th largest logit often ties with tens of others)
TIE_SLACK = (16, 512)


def ordered_top(x: torch.Tensor, width: int, temp: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [B, width]: the first `width` entries of each row of x [B, N] in the
    order kept sets are defined on, value descending then id ascending; values over `temp`
    [B, 1] when given, and ordered as such. `topk` picks and orders equal values as it
    likes: a tie across a top-k or top-p cut would otherwise choose the kept ids by the
    kernel's order, which can change with the width, so with the batch. TIE_SLACK more
    candidates hold every id equal to the cut, or a row whose tie runs past them all is
    sorted whole."""
    n = x.shape[1]
    out_v = out_i = rows = None
    slacks = TIE_SLACK if x.dtype in (torch.float32, torch.float64) else TIE_SLACK[1:]
    for slack in (*slacks, n):
        k = min(n, width + slack)
        src = x if rows is None else x.index_select(0, rows)
        v, i = (src.sort(dim=-1, descending=True, stable=True) if k == n
                else src.topk(k, dim=-1))
        longer = v[:, -1] == v[:, width - 1] if k < n else None  # ties past the slack
        if temp is not None:
            v = v / (temp if rows is None else temp[rows])  # distinct values may round to one
        i, by_id = i.sort(dim=-1)
        v, order = v.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        v, i = v[:, :width], i.gather(1, order[:, :width])
        if rows is None:
            out_v, out_i = v, i
        else:
            out_v[rows], out_i[rows] = v, i
        if longer is None or not longer.any():
            break
        rows = (torch.arange(x.shape[0], device=x.device) if rows is None else rows)[longer]
    return out_v, out_i


def noise(st: SamplingTensors, rows: list[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (float64) for keyed rows `rows` at vocabulary ids `token_ids` ([R, N] or
    [N])."""
    rows_t = torch.tensor(rows, dtype=torch.int64, device=token_ids.device)
    return murmur.gumbel_from_hash(murmur.murmur_hash(st.prefix[rows_t], token_ids))


def filter_sorted(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor,
                  log_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """vals [B, N] sorted descending (temperature-scaled logits). Returns the keep mask:
    top-k by rank, then top-p over the renormalised top-k set, then min-p relative to the
    most likely token. The first candidate is always kept. `log_norm` = (values, rows):
    rows whose vals are only the head of the whole vocabulary, with its log normaliser."""
    n = vals.shape[1]
    rank = torch.arange(n, device=vals.device)[None, :]
    keep = rank < top_k[:, None]
    masked = vals.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    if log_norm is not None:
        norm, rows = log_norm
        probs = torch.where(rows[:, None], torch.exp(masked - norm[:, None]), probs)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each candidate
    keep &= before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return keep


def draw_filtered(logits: torch.Tensor, fl: torch.Tensor | None, pos: dict[int, int],
                  st: SamplingTensors, vocab: int) -> torch.Tensor:
    """Tokens of the filtering rows: from their kept sets in C (`_draw_nucleus`), the rows
    it leaves on sorted candidates (`_draw_sorted`)."""
    idx = st.filter_rows
    tokens = torch.empty(len(idx), dtype=torch.int64, device=logits.device)
    at = {i: j for j, i in enumerate(idx)}
    settled, drawn = _draw_nucleus(logits, fl, pos, st, idx)
    if settled:
        tokens[[at[i] for i in settled]] = drawn
    done = set(settled)
    rest = [i for i in idx if i not in done]
    if rest:
        tokens[[at[i] for i in rest]] = _draw_sorted(logits, fl, pos, st, rest, vocab)
    return tokens


def _draw_nucleus(logits: torch.Tensor, fl: torch.Tensor | None,
                  pos: dict[int, int], st: SamplingTensors, rows: list[int]
                  ) -> tuple[list[int], torch.Tensor]:
    """(the rows settled, their tokens) of filtering rows: gumbel.c finds each row's kept
    set without sorting the vocabulary (a prefix of (x descending, id ascending): its
    first top_k, p = e^(x - max) / their float64 sum, the last kept id where the mass
    before it reaches top_p, min-p by x - max >= log min_p) and its ids that can win;
    their exact scores are torch's float64 as everywhere. A row it leaves (a NaN, a kept
    set past its buckets, too many candidates, no kernel, bf16 logits not copied) goes
    to the sorted candidates."""
    settled: list[int] = []
    drawn: list[torch.Tensor] = []
    for src, group in ((fl, [i for i in rows if i in pos]),
                       (logits, [i for i in rows if i not in pos])):
        if not group:
            continue
        at = [pos[i] for i in group] if src is fl else group
        g = _index(group, logits.device)
        temp, prefix = st.temperature[g], st.prefix[g]
        found = gumbel.nucleus_candidates(src, at, temp, st.top_k[g], st.top_p[g], st.min_p[g],
                                          prefix)
        if found is None:
            continue
        r, ids, ok = found
        x = src[_index(at, logits.device)[r], ids]
        score = murmur.keyed_scores(x, temp[r], prefix[r], ids)
        first = murmur.keyed_max(r, ids, score, len(group))
        ok &= first >= 0
        settled += [i for i, k in zip(group, ok.tolist()) if k]
        drawn.append(first[ok])
    return settled, (torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.int64))


def _float_rows(logits: torch.Tensor, fl: torch.Tensor | None, pos: dict[int, int],
                rows: list[int]) -> torch.Tensor:
    """float32 [R, V]: the rows' edited copies where they have one, else their logits."""
    if all(i in pos for i in rows):
        return fl.index_select(0, _index([pos[i] for i in rows], logits.device))
    out = torch.empty(len(rows), logits.shape[1], dtype=torch.float32, device=logits.device)
    for j, i in enumerate(rows):
        out[j] = fl[pos[i]] if i in pos else logits[i]
    return out


def _draw_sorted(logits: torch.Tensor, fl: torch.Tensor | None, pos: dict[int, int],
                 st: SamplingTensors, idx: list[int], vocab: int) -> torch.Tensor:
    """Filter and draw on sorted candidates: `ordered_top` of width K_max (<= BOUNDED_TOP_K)
    for filtering rows `idx`. A row with top_k = all is exact on those candidates when its
    last candidate is filtered out (top-p and min-p are monotone in rank), with
    probabilities normalised over the whole vocabulary; other wide rows sort the whole
    vocabulary. Seeded noise is keyed by token id, so both give the same token."""
    k = st.top_k[idx]
    temp = st.temperature[idx, None]
    width = min(int(k.max()), BOUNDED_TOP_K)
    at = {i: j for j, i in enumerate(idx)}
    vals = torch.empty(len(idx), width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(len(idx), width, dtype=torch.int64, device=logits.device)
    raw = [i for i in idx if i not in pos]
    if raw:
        v, t = ordered_top(logits.index_select(0, _index(raw, logits.device)), width,
                           temp[[at[i] for i in raw]])
        vals[[at[i] for i in raw]], ids[[at[i] for i in raw]] = v.float(), t
    edited = [i for i in idx if i in pos]
    if edited:
        own = fl.index_select(0, _index([pos[i] for i in edited], logits.device))
        v, t = ordered_top(own, width, temp[[at[i] for i in edited]])
        vals[[at[i] for i in edited]], ids[[at[i] for i in edited]] = v, t
    wide = [j for j, i in enumerate(idx) if int(st.top_k[i]) > width]
    log_norm = rows_full = lse = None
    if wide:  # the whole row's normaliser, for rows whose top-k set is the vocabulary
        log_norm = torch.zeros(len(idx), device=logits.device)
        rows_full = _float_rows(logits, fl, pos, [idx[j] for j in wide]) / temp[wide]
        lse = torch.logsumexp(rows_full, dim=-1)
        log_norm[wide] = lse
        use = torch.zeros(len(idx), dtype=torch.bool, device=logits.device)
        use[wide] = True
        log_norm = (log_norm, use)
    keep = filter_sorted(vals, k, st.top_p[idx], st.min_p[idx], log_norm)
    score = (vals.double() + noise(st, idx, ids)).masked_fill(~keep, float("-inf"))
    tokens = ids.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    sort_rows = [j for j in wide if int(st.top_k[idx[j]]) < vocab or bool(keep[j, -1])]
    if sort_rows:  # the candidates may not hold the whole kept set: wider ones, or all
        sub = [idx[j] for j in sort_rows]
        # those rows of rows_full and their normalisers, as computed above
        of = _index([wide.index(j) for j in sort_rows], logits.device)
        rows, norms = ((rows_full, lse) if sort_rows == wide
                       else (rows_full.index_select(0, of), lse.index_select(0, of)))
        tokens[sort_rows] = _draw_wide(rows, st, sub, vocab, norms)
    return tokens


def _draw_wide(rows: torch.Tensor, st: SamplingTensors, sub: list[int], vocab: int,
               norms: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens of rows (temperature-scaled, float32; `norms` their logsumexp where the
    caller has it) whose kept set may pass BOUNDED_TOP_K: first from WIDE_TOP_K
    candidates, exact for a row whose top_k fits
    them or, with top_k = all, whose last candidate is filtered out (a flat
    distribution's nucleus at T = 1 is often a few thousand tokens: a topk of 8,192 costs
    a fraction of sorting 262,144); the rest sort the whole vocabulary."""
    tokens = torch.empty(len(sub), dtype=torch.int64, device=rows.device)
    top_k, top_p, min_p = st.top_k[sub], st.top_p[sub], st.min_p[sub]
    left = list(range(len(sub)))
    width = WIDE_TOP_K
    if rows.shape[1] > width:
        v, t = ordered_top(rows, width)
        whole = top_k >= vocab
        if norms is None:
            norms = torch.logsumexp(rows, dim=-1)
        keep = filter_sorted(v, top_k, top_p, min_p, (norms, whole))
        score = (v.double() + noise(st, sub, t)).masked_fill(~keep, float("-inf"))
        drawn = t.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
        exact = (top_k <= width) | (whole & ~keep[:, -1])
        tokens[exact] = drawn[exact]
        left = [j for j in left if not bool(exact[j])]
    if left:
        v, t = rows[left].sort(dim=-1, descending=True, stable=True)
        keep = filter_sorted(v, top_k[left], top_p[left], min_p[left])
        score = (v.double() + noise(st, [sub[j] for j in left], t)).masked_fill(
            ~keep, float("-inf"))
        tokens[left] = t.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    return tokens
