"""A greedy step's tokens from the LM head without all of its bf16 products: an int8 screen
(kernels/screen.c) rules out every column that cannot be a row's argmax, and the few left
are multiplied exactly, so each row gets the very token q8_dpbf16's argmax gives it.

Where it runs: a CPU with AVX-512 VNNI and BF16 and no AMX (AMD Zen 4 and 5), for the head
calls q8_dpbf16 would take (decode steps past the head's q8_vnni rows, prompt steps). The
head is most of such a step, and VPDPBUSD gives twice VDPBF16PS's products an instruction.

The screen's copy of the head: its bf16 values (those q8_dpbf16 multiplies) with the input
channels ordered by how large they run in the head's inputs and cut into groups (16, 48,
192, 384 of Gemma 3's 640), each column's group in int8 with its own scale, and each row's
group with its own. Tens of channels of the final hidden state run several times larger
than the rest, so one scale a row would leave far more candidates than a scale per group.
The order comes from the first BUILD_ROWS rows the head is called with, and the copy is made
then (its int8 size again in memory). A row with more than CAP candidates goes to q8_dpbf16
alone.

Keyed sampling rows (a temperature, no other edits: sampling/sampler.py) are screened on
their Gumbel-max scores (screen.c): a step of greedy and sampled rows reads the copy once,
and each sampled row gets the token the sampler would draw from q8_dpbf16's logits.
"""

from __future__ import annotations

import logging
import time

import torch

from swaserve.kernels import build, murmur, q8
from swaserve.kernels.q8_weight import Q8Weight

log = logging.getLogger("swaserve")

CAP = 512  # candidates a row may keep; past them it is multiplied whole
# each group's share of the input channels, in fortieths (Gemma 3: 16, 48, 192, 384)
GROUP_SHARES = (1, 3, 12, 24)
# the rows whose channels order the copy: a few rows order them as well as hundreds, one
# row alone orders them by its own extremes; calls before those rows are seen multiply the
# head whole
BUILD_ROWS = 16
# the head's q8_vnni rows where a screen runs: past them q8_dpbf16's tokens through the
# screen cost less than q8_vnni's products (benchmarks/head_screen.py --vnni-limits), and a
# step's keyed rows are drawn there too
VNNI_ROWS = 6
# a keyed row under this temperature takes its logits: past 2^10 x the head's largest sums
# its scores' bounds could overflow float32
MIN_TEMPERATURE = 2.0 ** -10


def _entry():
    return build.function("screen", "head_screen")


def _pack_entry():
    return build.function("screen", "head_screen_pack")


def available() -> bool:
    """The screen runs here: its kernels build (AVX-512 VNNI and BF16), and q8_dpbf16, not
    q8_amx, takes the head's larger calls."""
    return not q8.amx_available() and q8.dpbf16_available() and _entry() is not None


def group_edges(k: int) -> list[int] | None:
    """The groups' first channels, then k: each group a multiple of 16 channels, at least
    16, as many of GROUP_SHARES' groups as k holds; None when k is not a multiple of 32
    (the tiles' blocks)."""
    if k % 32:
        return None
    total = sum(GROUP_SHARES)
    edges = [0]
    for share in GROUP_SHARES[:-1]:
        at = edges[-1] + max(16, k * share // total // 16 * 16)
        if at >= k:
            break
        edges.append(at)
    return edges + [k]


class HeadScreen:
    """The screen of one tiled int8 LM head (see the module docstring)."""

    def __init__(self, head: Q8Weight):
        self.head = head
        self.edges = torch.tensor(group_edges(head.shape[1]), dtype=torch.int32)
        self._copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._failed = False  # a build that failed is not tried again
        # before the copy: each channel's largest |value| in the rows seen, and their count
        self._seen = torch.zeros(head.shape[1])
        self._rows_seen = 0
        self.calls = 0  # calls that gave tokens
        self.drawn = 0  # keyed rows given a token

    @classmethod
    def for_head(cls, head: Q8Weight | None) -> HeadScreen | None:
        """A screen for `head` where one runs here: the kernels build, q8_dpbf16 and not
        q8_amx takes the head's larger calls, and its shape can be screened."""
        if (head is None or not head.tiled or head.shape[0] % 32
                or group_edges(head.shape[1]) is None or not available()):
            return None
        return cls(head)

    def takes(self, x: torch.Tensor, kernel: str | None = None) -> bool:
        """Whether `self.head.argmax(x, kernel)` would run on q8_dpbf16 (`kernel` as the
        model passes it); the screen pays from one row."""
        return (x.dim() == 2 and x.shape[0] > 0 and self.head.takes(x, kernel)
                and self.head.kernel_for(x.shape[0], kernel, any_rows=True) == "dpbf16")

    @property
    def built(self) -> bool:
        return self._copy is not None

    @property
    def pending_bytes(self) -> int:
        """What the copy will take once built (0 once built, or after a failed build): the
        memory planner leaves it out of the KV budget it takes from free memory."""
        if self._copy is not None or self._failed:
            return 0
        n, k = self.head.shape
        return n * k + n * (len(self.edges) - 1) * 2 * 4 + k * 4

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """int64 [M]: each row's argmax of x @ W.T exactly as q8_dpbf16 gives it (its
        float32 sums, ties to the first column); None where the caller should take it
        from q8_dpbf16 itself (the copy is not made yet, a value of x or of W is not
        finite, |x| past 2^64, no memory)."""
        return self.tokens(x)

    def tokens(self, x: torch.Tensor, temperature: torch.Tensor | None = None,
               prefix: torch.Tensor | None = None) -> torch.Tensor | None:
        """int64 [M]: `argmax`'s tokens, and for each keyed row (temperature > 0, at least
        MIN_TEMPERATURE; prefix: its murmur.row_prefix) the token the sampler's keyed
        Gumbel-max draws from q8_dpbf16's logits (`murmur.keyed_scores`), or -1 where
        its candidates are past CAP (the caller gives it logits); None as `argmax`."""
        found = self.candidates(x, temperature, prefix)
        tokens = None if found is None else self._rescore(x, *found, temperature, prefix)
        if tokens is not None:
            self.calls += 1
            if temperature is not None:
                self.drawn += int(((tokens >= 0) & (temperature > 0)).sum())
        return tokens

    def candidates(self, x: torch.Tensor, temperature: torch.Tensor | None = None,
                   prefix: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(columns [M, CAP] int32, count [M]: each row's first `count` columns are its
        candidates; -1 for a row with more than CAP), or None as `argmax`. x: bf16 [M, K],
        contiguous; `tokens`' keys."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.head.shape[1]:
            raise ValueError(f"HeadScreen: x must be bf16 [M, {self.head.shape[1]}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        keys = (0, 0)
        if temperature is not None:
            temperature = temperature.to(torch.float32).contiguous()
            prefix = prefix.to(torch.int64).contiguous()
            if temperature.shape != (x.shape[0],) or prefix.shape != (x.shape[0],):
                raise ValueError("HeadScreen: a temperature and a prefix a row")
            if bool(((temperature > 0) & (temperature < MIN_TEMPERATURE)).any()):
                raise ValueError(f"HeadScreen: a keyed row's temperature is under "
                                 f"{MIN_TEMPERATURE}")
            keys = (temperature.data_ptr(), prefix.data_ptr())
        x = x.contiguous()
        if x.shape[0] == 0:  # a step whose prompt chunks end no prompt
            return None
        if self._copy is None:
            if self._failed:
                return None
            self._seen = torch.maximum(self._seen, x.float().abs().amax(0))
            self._rows_seen += x.shape[0]
            if self._rows_seen < BUILD_ROWS or not self._build():
                return None
        perm, wq, stats = self._copy
        m, (n, k) = x.shape[0], self.head.shape
        cand = torch.empty(m, CAP, dtype=torch.int32)
        count = torch.empty(m, dtype=torch.int64)
        rc = _entry()(x.data_ptr(), perm.data_ptr(), self.edges.data_ptr(), len(self.edges) - 1,
                      wq.data_ptr(), stats.data_ptr(), m, n, k, *keys, CAP, cand.data_ptr(),
                      count.data_ptr(), torch.get_num_threads())
        return (cand, count) if rc == 0 else None

    def _rescore(self, x: torch.Tensor, cand: torch.Tensor, count: torch.Tensor,
                 temperature: torch.Tensor | None, prefix: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """Each row's best candidate by q8_dpbf16's own sums (of the candidates' columns
        taken out of the head: the same sums): the largest for a greedy row, the largest
        keyed score for a keyed one; greedy rows past CAP by q8_dpbf16 whole, keyed ones -1."""
        m = x.shape[0]
        keyed = (torch.zeros(m, dtype=torch.bool) if temperature is None
                 else temperature > 0)
        kept = torch.arange(CAP)[None, :] < count[:, None]
        columns_kept = cand[kept].long()
        union = torch.unique(columns_kept)  # sorted: a tie goes to the first column
        tokens = torch.full((m,), -1, dtype=torch.int64)
        if union.numel():
            pad = -union.numel() % q8.TILE_N
            columns = torch.cat([union, union[-1:].expand(pad)])
            sums = self.head.take(columns).matmul(x, kernel="dpbf16")
            if sums is None:
                return None
            rows = kept.nonzero()[:, 0]
            at = torch.searchsorted(union, columns_kept)
            mine = torch.zeros_like(sums, dtype=torch.bool)
            mine[rows, at] = True
            tokens = union[sums.masked_fill(~mine, float("-inf")).argmax(1)]
            hashed = keyed[rows]
            if bool(hashed.any()):
                r, ids = rows[hashed], columns_kept[hashed]
                score = murmur.keyed_scores(sums[r, at[hashed]], temperature[r], prefix[r], ids)
                drawn = murmur.keyed_max(r, ids, score, m)
                tokens = torch.where(keyed, drawn, tokens)
        over = (count < 0).nonzero()[:, 0]
        tokens[over] = -1
        over = over[~keyed[over]]
        if over.numel():
            whole = self.head.argmax(x[over], "dpbf16")
            if whole is None:
                return None
            tokens[over] = whole
        return tokens

    def _build(self) -> bool:
        """The screen's copy of the head, its channels ordered by the largest |values| seen."""
        t0 = time.perf_counter()
        n, k = self.head.shape
        perm = self._seen.argsort(descending=True).to(torch.int32).contiguous()
        groups = len(self.edges) - 1
        try:
            wq = torch.empty(n // 32, k // 4, 2, 16, 4, dtype=torch.uint8)
            stats = torch.empty(n // 16, groups, 2, 16, dtype=torch.float32)
        except RuntimeError as e:  # out of memory: the head whole, as before
            log.warning("LM head screen not built: %s", e)
            self._failed = True
            return False
        offsets = 0 if self.head.offsets is None else self.head.offsets.data_ptr()
        rc = _pack_entry()(self.head.q.data_ptr(), self.head.scales.data_ptr(), offsets,
                           self.head.tile_flags, perm.data_ptr(), self.edges.data_ptr(),
                           groups, n, k, wq.data_ptr(), stats.data_ptr(),
                           torch.get_num_threads())
        if rc != 0:
            log.warning("LM head screen not built (%d): greedy steps multiply it whole", rc)
            self._failed = True
            return False
        self._copy = (perm, wq, stats)
        log.info("LM head screen built in %.2f s (%d MB)", time.perf_counter() - t0,
                 (wq.numel() + stats.numel() * 4) >> 20)
        return True
