"""What the engine tests share: spec_engine, a tiny engine whose speculative drafts are
not gated by timings (test_speculative_*.py)."""

from __future__ import annotations

from tests.conftest import tiny_engine


def spec_engine(path, **kw):
    """tiny_engine whose drafts are not gated by timings (CostGate is tested on its own:
    a tiny model's step times are noise)."""
    eng = tiny_engine(path, **kw)
    if eng.speculator is not None:
        eng.speculator.gate.allow = lambda n: True
    return eng
