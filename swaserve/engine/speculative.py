"""Speculative decoding with n-gram drafts: no second model.

Before a step, each decoding request may get a draft: the tokens that followed the latest
earlier occurrence of its last n tokens (n from `ngram_max` down to `ngram_min`, longest
match first) in its own prompt and output. The step computes the request's last token and
its draft as consecutive decode rows (runner.py) and samples every one of them with the
request's parameters at that position (sample_stage.py), as if the draft tokens before it
had been accepted; the engine then keeps the sampled tokens up to the first one that
differs from the draft, plus that one. Greedy and seeded rows are pure functions of their
logits, so the output is token for token the non-speculative one; unseeded rows get a seed
drawn per request for the same reason, which leaves their distribution unchanged.

How many tokens a request drafts adapts to what it accepts (`DraftState`): one more after
a draft accepted whole, one past what was accepted otherwise, and after drafts that keep
failing none for a while (doubling), so text with nothing to copy costs about nothing.
The step's rows are capped (`speculative_max_rows`, and the rows whose int8 kernel is the
one the step would use without drafts) and the draft tokens go to the requests whose drafts
were accepted best. Whether drafts pay at all depends on what a row costs (its share of the
weights' read, its sampling: a top-p row sorts the vocabulary) against what it brings:
`CostGate` compares the seconds per emitted token of decode steps with and without drafts,
per number of decoding requests, and pauses drafting where it costs more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swaserve.engine.request import Request, RequestStatus

MAX_WAIT = 64  # steps a failing request waits at most before it drafts again
LOOKBACK = 8192  # tokens before a request's first draft that its index reads at most
GATE_SAMPLES = 4  # steps of each kind a comparison needs
GATE_MARGIN = 0.97  # drafts must make a token at least 3 % cheaper
GATE_REFRESH = 64  # drafted steps between two refreshes of the cost without drafts
GATE_MAX_PAUSE = 512  # steps drafting pauses at most (doubling from 16)


class NgramIndex:
    """Where each n-gram of a request's tokens (n in [lo, hi]) last ended, kept up to date
    as tokens are appended, so a lookup costs O(hi) whatever the length. The first lookup
    indexes at most the LOOKBACK tokens before it, so a long prompt neither stalls the step
    that drafts for it first nor holds an entry per prompt token."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # grams ending at positions <= this are recorded

    def extend(self, req: Request) -> None:
        """Catch up with the request's prompt and output tokens."""
        have, prompt = len(self.tokens), req.prompt_token_ids
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(req.output_token_ids[have - len(prompt):])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (of length hi down to lo) seen before; [] when none recurs. An occurrence fewer
        than k tokens back means the text repeats with that period: the draft continues it."""
        t, size = self.tokens, len(self.tokens)
        self.indexed = max(self.indexed, size - LOOKBACK)
        for e in range(self.indexed + 1, size):  # grams ending before the last position
            for n in range(self.lo, min(self.hi, e) + 1):
                self.ends[n][tuple(t[e - n:e])] = e
        self.indexed = max(self.indexed, size - 1)
        for n in range(min(self.hi, size), self.lo - 1, -1):
            e = self.ends[n].get(tuple(t[size - n:]))
            if e is not None:  # fewer than k tokens since: continue the repeat periodically
                period = size - e
                return [t[e + i % period] for i in range(k)] if e + k > size else t[e:e + k]
        return []


@dataclass
class DraftState:
    """One request's drafting: its index, its draft length now and how drafts fared."""

    index: NgramIndex
    k: int
    misses: int = 0  # drafts in a row with nothing accepted
    wait: int = 0  # steps to go before the next draft
    proposed: int = 0
    accepted: int = 0
    acceptance: float = 1.0  # moving share of draft tokens accepted

    def record(self, proposed: int, accepted: int, k_max: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / proposed
        if accepted == proposed:
            self.k = min(k_max, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            if self.misses >= 2:
                self.wait = min(MAX_WAIT, 2 ** (self.misses - 2))


@dataclass
class _Costs:
    on: float = 0.0  # moving seconds per emitted token, steps with drafts
    off: float = 0.0  # and without
    n_on: int = 0
    n_off: int = 0
    since_off: int = 0  # drafted steps since the last step without drafts
    pause: int = 0
    fails: int = 0


class CostGate:
    """Whether drafts pay, per number of decoding requests (1, 2, 3-4, 5-8, ...): seconds per
    emitted token of pure decode steps with drafts against those without, as moving
    averages. Each size first measures GATE_SAMPLES steps without drafts, and again every
    GATE_REFRESH drafted steps; when drafted steps cost more (GATE_MARGIN), drafting pauses
    there for 16 steps, doubling while it keeps failing."""

    def __init__(self):
        self.costs: dict[int, _Costs] = {}

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(0, n - 1).bit_length()

    def allow(self, n: int) -> bool:
        c = self.costs.setdefault(self._bucket(n), _Costs())
        if c.pause:
            c.pause -= 1
            return False
        return c.n_off >= GATE_SAMPLES and c.since_off < GATE_REFRESH

    def observe(self, n: int, drafted: bool, seconds: float, tokens: int) -> None:
        if tokens <= 0:
            return
        c = self.costs.setdefault(self._bucket(n), _Costs())
        per = seconds / tokens
        if drafted:
            c.on = per if c.n_on == 0 else 0.8 * c.on + 0.2 * per
            c.n_on += 1
            c.since_off += 1
            if c.n_on >= GATE_SAMPLES and c.n_off >= GATE_SAMPLES:
                if c.on > GATE_MARGIN * c.off:
                    c.fails += 1
                    c.pause = min(GATE_MAX_PAUSE, 16 << (c.fails - 1))
                    c.n_on = 0  # a fresh trial after the pause
                else:
                    c.fails = 0
        else:
            c.off = per if c.n_off == 0 else 0.8 * c.off + 0.2 * per
            c.n_off += 1
            if c.n_off >= GATE_SAMPLES:
                c.since_off = 0


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the drafted rows produced (accepted + one each)
    drafted_rows: int = 0  # request-steps with a draft
    states: dict[str, DraftState] = field(default_factory=dict, repr=False)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class NgramSpeculator:
    def __init__(self, k_max: int, ngram_min: int, ngram_max: int, max_rows: int):
        self.k_max, self.lo, self.hi, self.max_rows = k_max, ngram_min, ngram_max, max_rows
        self.stats = SpecStats()
        self.gate = CostGate()

    def _state(self, req: Request) -> DraftState:
        st = self.stats.states.get(req.request_id)
        if st is None:
            st = self.stats.states[req.request_id] = DraftState(NgramIndex(self.lo, self.hi),
                                                                self.k_max)
        return st

    def drafts(self, running: list[Request]) -> dict[str, list[int]]:
        """Drafts for this step's decoding requests, best acceptance first, within
        `max_rows` decode rows in all (the scheduler bounds them further). Requests with
        their token still on the device (overlap), in a prompt, or opted out get none."""
        decoding = [r for r in running if r.status is RequestStatus.RUNNING
                    and r.num_uncomputed_tokens == 1 and r.num_pending == 0
                    and r.num_output_tokens > 0]
        budget = self.max_rows - len(decoding)
        if budget <= 0 or not decoding or not self.gate.allow(len(decoding)):
            return {}
        wanted = []
        for req in decoding:
            if not req.params.speculative:
                continue
            st = self._state(req)
            if st.wait:
                st.wait -= 1
                continue
            room = req.max_new_tokens - req.num_generated - 1  # the step adds one more
            k = min(st.k, room)
            if k <= 0:
                continue
            st.index.extend(req)
            draft = st.index.propose(k)
            if draft and req.grammar is not None:  # what the grammar would reject cannot win
                draft = draft[:req.grammar.valid_prefix(draft)]
            if draft:
                wanted.append((st.acceptance, req.arrival, req, draft))
        out = {}
        for _, _, req, draft in sorted(wanted, key=lambda w: (-w[0], w[1])):
            if budget <= 0:
                break
            out[req.request_id] = draft[:budget]
            budget -= len(out[req.request_id])
        return out

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        self._state(req).record(proposed, accepted, self.k_max)
        s = self.stats
        s.proposed += proposed
        s.accepted += accepted
        s.emitted += accepted + 1
        s.drafted_rows += 1

    def forget(self, request_id: str) -> None:
        self.stats.states.pop(request_id, None)
