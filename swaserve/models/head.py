"""The LM head: final-normed hidden rows -> what the sampler reads of them (HeadOutput).

Logits come from the bf16 weight, or from its int8 copy (kernels/q8.py) where a tile kernel
takes the rows. A step that allows it (ForwardContext.argmax_only, argmax_rows, keyed) may
get some or all rows' tokens instead of their logits: plain greedy rows' argmaxes from the
int8 tiles (through the screen, kernels/screen.py, where it runs) and keyed temperature
rows drawn by the screen, each the token the sampler would pick from the logits the whole
step's rows get. Under tensor parallelism rank 0 gathers every rank's logits and the other
ranks get None.

The head holds no parameters: the CausalLM owns the weight (checkpoint loading and sharding
fill it by name) and passes it to each call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from swaserve.kernels.q8 import head_vnni_rows
from swaserve.kernels.q8_weight import Q8Weight
from swaserve.kernels.screen import MIN_TEMPERATURE, HeadScreen
from swaserve.kernels.screen import VNNI_ROWS as SCREEN_VNNI_ROWS
from swaserve.models.context import ForwardContext, KeyedRows
from swaserve.models.layers import linear
from swaserve.profile import timed

log = logging.getLogger("swaserve")

SCORE_ROWS = 64  # prompt rows scored per LM-head call: 64 x 262,144 floats is 64 MiB
LOGITS_MIN_ROWS = 32  # the reused logits buffer holds at least this many rows


class HeadKind(Enum):
    LOGITS = "logits"  # every row's logits
    ARGMAXES = "argmaxes"  # every row is plain greedy: its argmax, no logits
    SPLIT = "split"  # some rows' tokens, the other rows' logits


@dataclass
class HeadOutput:
    """What the LM head gives the sampler for a step's S rows, by `kind`:

    LOGITS: every row's logits (`logits` [S, V]: a torch tensor in the model dtype, or
    float32 from the int8 head, or the MLX model's lazy array).
    ARGMAXES (ForwardContext.argmax_only): each row's first index of its largest logit
    (`tokens` [S]), computed where the logits were (Q8Weight.argmax) instead of writing
    [S, V] floats and reading them back.
    SPLIT: the rows `chosen` got their tokens from the head (plain greedy rows' argmaxes,
    ForwardContext.argmax_rows; keyed rows' draws, ForwardContext.keyed) and the others
    need logits: `tokens` [len(chosen)] and `logits` [S - len(chosen), V], each computed as
    the head computes the whole step's rows (the same kernel), so that every row gets the
    token (and logprobs) full logits would give it."""

    kind: HeadKind
    vocab: int
    logits: Any = None  # the rows without a token, in row order (None: ARGMAXES)
    tokens: torch.Tensor | None = None  # int64: the chosen rows' tokens (ARGMAXES: every row's)
    chosen: list[int] = field(default_factory=list)  # SPLIT: the rows with a token, increasing

    @classmethod
    def of_logits(cls, logits) -> HeadOutput:
        return cls(HeadKind.LOGITS, logits.shape[1], logits)

    @classmethod
    def of_argmaxes(cls, tokens: torch.Tensor, vocab: int) -> HeadOutput:
        return cls(HeadKind.ARGMAXES, vocab, tokens=tokens)

    @classmethod
    def of_split(cls, logits: torch.Tensor, tokens: torch.Tensor, chosen: list[int]
                 ) -> HeadOutput:
        return cls(HeadKind.SPLIT, logits.shape[1], logits, tokens, chosen)

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind is HeadKind.ARGMAXES:
            return (self.tokens.shape[0], self.vocab)
        return (self.logits.shape[0] + len(self.chosen), self.vocab)

    @property
    def others(self) -> list[int]:
        """The rows without a token (whose logits `logits` holds), increasing."""
        if self.kind is HeadKind.ARGMAXES:
            return []
        chosen = set(self.chosen)
        return [i for i in range(self.shape[0]) if i not in chosen]

    def __getitem__(self, rows: slice | list[int]) -> HeadOutput:
        """These rows alone (the engine's fork rows share a logits row; the sampler's
        row-by-row retry takes them one at a time)."""
        if self.kind is HeadKind.LOGITS:
            return HeadOutput.of_logits(self.logits[rows])
        if self.kind is HeadKind.ARGMAXES:
            return HeadOutput.of_argmaxes(self.tokens[rows], self.vocab)
        picked = range(self.shape[0])[rows] if isinstance(rows, slice) else rows
        where = {r: j for j, r in enumerate(self.chosen)}
        others = {r: j for j, r in enumerate(self.others)}
        g = [i for i, r in enumerate(picked) if r in where]
        o = [others[r] for r in picked if r in others]
        return HeadOutput.of_split(self.logits[o], self.tokens[[where[picked[i]] for i in g]], g)


class LMHead:
    """A CausalLM's LM head: logits of final-normed rows (soft-capped where the family caps
    them), and the tokens it can give in their place (`__call__`), from the bf16 weight or
    its int8 copy `q8` with its screen `screen` (`use_q8`)."""

    def __init__(self, softcap: float | None):
        self.softcap = softcap
        self.tp = None  # the TPGroup when the weight is one rank's vocabulary shard
        # the int8 blocks (kernels/q8.py), used for the batches its kernel takes
        # (Q8Weight.takes), and their int8 screen for greedy and keyed rows (kernels/screen.py)
        self.q8: Q8Weight | None = None
        self.screen: HeadScreen | None = None
        self._out: torch.Tensor | None = None  # the reused output of the int8 head (`_buffer`)

    def use_q8(self, q8: Q8Weight, screen: bool) -> None:
        """Take the int8 copy `q8` of the weight (its shape checked by the caller), with its
        screen where `screen` and one runs here."""
        self.q8 = q8
        if q8.tiled:
            q8.vnni_limit = head_vnni_rows()
        self.screen = HeadScreen.for_head(q8) if screen else None
        if self.screen is not None:  # past a few rows the screen beats q8_vnni
            q8.vnni_limit = min(q8.vnni_limit, SCREEN_VNNI_ROWS)

    @property
    def draws_keyed_rows(self) -> bool:
        """Whether `ctx.keyed` can be of use: the int8 head has a screen and its tokens come
        from this process's logits."""
        return self.screen is not None and self.tp is None and not self.softcap

    @property
    def pending_bytes(self) -> int:
        """Memory the screen will allocate (its copy, made at the first large greedy step)."""
        return self.screen.pending_bytes if self.screen is not None else 0

    @timed("lm head")
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext
                 ) -> HeadOutput | None:
        """x's rows as the step asks: with `ctx.argmax_only`, their argmaxes where an int8
        head's tile kernel takes the rows; with `ctx.argmax_rows` or `ctx.keyed`, the tokens
        of those rows it can give and the others' logits; otherwise, or where it gives no
        tokens, every row's logits (None on a tensor-parallel rank past 0)."""
        if self.q8 is not None and self.tp is None and not self.softcap:
            if ctx.argmax_only:
                tokens = self.argmaxes(x, ctx.q8_kernel)
                if tokens is not None:
                    return HeadOutput.of_argmaxes(tokens, self.q8.shape[0])
            if ctx.argmax_rows or ctx.keyed is not None:
                split = self.split(x, ctx)
                if split is not None:
                    return split
        logits = self.logits(x, weight, ctx)
        return None if logits is None else HeadOutput.of_logits(logits)

    def logits(self, x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext
               ) -> torch.Tensor | None:
        """Logits of x's rows, from the int8 head where its kernel takes them, else from
        `weight`; soft-capped; under tensor parallelism all of them on rank 0, None on the
        other ranks. From the int8 head they are float32 in a buffer the next call reuses:
        32 x 262,144 floats are above glibc's largest mmap threshold (32 MB), so a fresh
        tensor each step would come as new pages."""
        logits = None
        if self.q8 is not None and self.q8.takes(x, ctx.q8_kernel):
            logits = self.q8.matmul(x, out=self._buffer(x.shape[0]), kernel=ctx.q8_kernel)
        if logits is None:
            logits = linear(x, weight, ctx.row_block)
        if self.softcap:
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _buffer(self, rows: int) -> torch.Tensor:
        n = self.q8.shape[0]
        if self._out is None or self._out.numel() < rows * n:
            self._out = torch.empty(max(rows, LOGITS_MIN_ROWS) * n, dtype=torch.float32)
        return self._out[:rows * n].view(rows, n)

    def screen_tokens(self, x: torch.Tensor, keyed: KeyedRows | None = None,
                      rows: list[int] | None = None) -> torch.Tensor | None:
        """`HeadScreen.tokens` of x's rows (`keyed`'s rows among `rows`, the step's rows that
        x holds, with their keys; the others greedy); None without a screen or where it
        gives none. A screen that raises is turned off."""
        if self.screen is None:
            return None
        keys = ()
        if keyed is not None:
            at = {r: j for j, r in enumerate(rows)}
            where = torch.tensor([at[r] for r in keyed.rows], dtype=torch.int64)
            temperature = torch.zeros(len(rows), dtype=torch.float32).index_copy_(
                0, where, keyed.temperature.cpu())
            prefix = torch.zeros(len(rows), dtype=torch.int64).index_copy_(
                0, where, keyed.prefix.cpu())
            keys = (temperature, prefix)
        try:
            return self.screen.tokens(x, *keys)
        except Exception as e:  # noqa: BLE001 - it only saves time: the head whole
            log.error("LM head screen failed, off from now on: %s", e, exc_info=e)
            self.screen = None
            return None

    def argmaxes(self, x: torch.Tensor, kernel: str | None) -> torch.Tensor | None:
        """The argmaxes of x's rows from the int8 head's tile kernel `kernel` (as `matmul`
        picks it; through the screen where that is q8_dpbf16): the same tokens as its sums';
        None where no tile kernel takes the rows or a sum is NaN."""
        if self.screen is not None and self.screen.takes(x, kernel):
            tokens = self.screen_tokens(x)
            if tokens is not None:
                return tokens
        return self.q8.argmax(x, kernel)

    def split(self, x: torch.Tensor, ctx: ForwardContext) -> HeadOutput | None:
        """Tokens of `ctx.argmax_rows` (their argmaxes) and of `ctx.keyed`'s rows where the
        screen draws them (a step whose head takes q8_dpbf16), and the other rows' logits,
        each on the kernel the head's matmul takes for all the step's rows (a SPLIT
        output); None where the head would not run them on a tile kernel, on q8_vnni where
        rows beside the greedy ones need logits, or where no row got a token (the caller
        computes every row's logits then)."""
        head = self.q8
        kernel = head.kernel_for(x.shape[0], ctx.q8_kernel, any_rows=True)
        if kernel is None or not head.takes(x, ctx.q8_kernel):
            return None
        greedy = ctx.argmax_rows or []
        rows, tokens, screened = greedy, None, False
        keyed = ctx.keyed
        if (keyed is not None and self.screen is not None
                and self.screen.takes(x, ctx.q8_kernel)
                and bool((keyed.temperature >= MIN_TEMPERATURE).all())):
            rows, screened = sorted(set(greedy) | set(keyed.rows)), True
            tokens = self.screen_tokens(x[rows], keyed, rows)
        if tokens is None:  # the greedy rows alone (not through a screen that just gave none)
            rows = greedy
            if not rows or (kernel == "vnni" and len(rows) < x.shape[0]):
                # q8_vnni streams the whole head for any rows: one pass of every row's
                # logits (the caller's) costs less than argmaxes, then the others' logits
                return None
            tokens = (head.argmax(x[rows], kernel) if screened
                      else self.argmaxes(x[rows], kernel))
            if tokens is None:
                return None
        settled = tokens >= 0  # a keyed row past the screen's cap: -1, it takes logits
        chosen = [r for r, ok in zip(rows, settled.tolist()) if ok]
        if not chosen:
            return None
        others = sorted(set(range(x.shape[0])) - set(chosen))
        logits = (head.matmul(x[others], out=self._buffer(len(others)), kernel=kernel)
                  if others else torch.empty(0, head.shape[0]))
        return None if logits is None else HeadOutput.of_split(logits, tokens[settled], chosen)

    @timed("prompt scoring")
    def score(self, x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext,
              norm: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Fill ctx.score from the last layer's rows x (`norm`: the final norm): each scored
        row's log-softmax, SCORE_ROWS rows at a time, of which only the next token's value
        and the top-n are kept. Always from logits: what the step asks of the head for its
        sampled rows (`ctx.argmax_only`, ...) is not asked of these."""
        score = ctx.score
        rows = score.indices.shape[0]
        score.logprobs = torch.empty(rows, dtype=torch.float32, device=x.device)
        score.top_logprobs = torch.empty(rows, score.top_n, dtype=torch.float32, device=x.device)
        score.top_ids = torch.empty(rows, score.top_n, dtype=torch.int64, device=x.device)
        for a in range(0, rows, SCORE_ROWS):
            b = min(rows, a + SCORE_ROWS)
            logits = self.logits(norm(x[score.indices[a:b]]), weight, ctx)
            if logits is None:  # a tensor-parallel rank past 0: rank 0 scores
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            score.logprobs[a:b] = lp.gather(1, score.targets[a:b, None])[:, 0]
            if score.top_n:
                score.top_logprobs[a:b], score.top_ids[a:b] = lp.topk(score.top_n, dim=-1)
