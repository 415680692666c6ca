"""Structured output: JSON schemas, regular expressions and EBNF grammars, through llguidance.

A grammar is compiled once per (kind, text) and cached; every request gets a deep copy of
the compiled matcher. Each step a grammar row's allowed tokens come out as a packed bitmask,
unpacked into the additive row (0 / -inf) the sampler adds (docs/architecture.md, Sampling) before penalties,
temperature and filtering, so greedy, seeded and filtered rows all respect it. The matcher
then consumes the chosen token; the request finishes when the grammar can go no further.

llguidance is an optional dependency (`pip install 'swaserve[grammar]'`); a request that
needs it without it gets a ValueError naming the parameter, like any other bad input.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import torch

from swaserve.sampling.json_bounds import bound_schema

log = logging.getLogger("swaserve")

PARAM_OF_KIND = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}
# compact, Python-style separators and no free whitespace: a model cannot pad the output
# with endless blanks; a schema's own "x-guidance" options override these
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


class CompiledGrammar:
    """A compiled grammar in its start state; `new_matcher` gives each request its own."""

    def __init__(self, matcher):
        self._pristine = matcher

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy())


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher):
        self._m = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 [ceil(V/32)], CPU, contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (none consumed)."""
        return int(self._m.validate_tokens(tokens))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._m.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits no further token (only end of sequence)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error()


def _bit_table() -> torch.Tensor:
    """[256, 8] float32: entry (b, k) is 0 when bit k of byte b is set, else -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))


_BIT_TABLE = _bit_table()


def mask_biases(matchers: list[GrammarMatcher], vocab_size: int,
                device: torch.device) -> torch.Tensor:
    """float32 [G, V] additive rows, 0 where each matcher allows the next token and -inf
    where it bans it. Bit k of the little-endian bitmask's byte j is token 8 j + k, so one
    lookup per byte unpacks it (in the sampler an add of such a row is far cheaper than a masked_fill)."""
    packed = torch.empty(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(packed[i])
    return _unpack(packed, vocab_size, device)


def mask_biases_along(matcher: GrammarMatcher, draft: list[int], vocab_size: int,
                      device: torch.device) -> torch.Tensor:
    """float32 [len(draft) + 1, V]: the mask now and after each draft token (speculative
    decoding verifies each position as if the draft before it was accepted). The matcher
    ends where it began. Rows past a token that ends the grammar repeat its mask (no token
    is taken from them: the request stops there)."""
    packed = torch.empty(len(draft) + 1, (vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(packed[0])
    taken = 0
    try:
        for i, tok in enumerate(draft):
            if matcher.is_terminated or not matcher.accept(tok):
                packed[i + 1:] = packed[i]
                break
            taken += 1
            if matcher.is_terminated:
                packed[i + 1:] = packed[i]
                break
            matcher.fill_bitmask(packed[i + 1])
    finally:
        if taken:
            matcher.rollback(taken)
    return _unpack(packed, vocab_size, device)


def _unpack(packed: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    rows = _BIT_TABLE.index_select(0, packed.view(torch.uint8).flatten().int())
    return rows.view(packed.shape[0], packed.shape[1] * 32)[:, :vocab_size].to(device)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe: the server compiles in
    worker threads so that a slow schema never holds up the engine loop."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 json_bounds: bool = True):
        self._tokenizer = tokenizer
        self._json_bounds = json_bounds  # json_bounds.py: open numbers get digit limits
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    @staticmethod
    def available() -> bool:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    def _ll(self, param: str):
        """The llguidance token table, built on first use (seconds for a 262k vocabulary)."""
        try:
            import llguidance
        except ImportError:
            raise ValueError(f"{param}: structured output needs llguidance; install it with "
                             "pip install 'swaserve[grammar]'") from None
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ValueError(f"{param}: structured output needs the model's tokenizer, "
                                     "and this model has none")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self._vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the token table in the background, so the first grammar request is fast."""
        if self.available() and self._tokenizer is not None:
            threading.Thread(target=self._ll, args=("grammar",), daemon=True,
                             name="swaserve-grammar-warmup").start()

    def compile(self, kind: str, text: str) -> CompiledGrammar:
        """Raises ValueError("<param>: <why>") for a malformed schema, regex or grammar."""
        param = PARAM_OF_KIND[kind]
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        tok = self._ll(param)
        import llguidance

        try:
            if kind == "json":
                schema = bound_schema(json.loads(text)) if self._json_bounds else json.loads(text)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                        defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llguidance.grammar_from("grammar", text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{param}: {e}") from None
        except RecursionError:  # a schema past the bounds that no request field checked
            raise ValueError(f"{param}: nested too deeply to compile") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{param}: {_first_line(error)}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{param}: {_first_line(matcher.get_error())}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _first_line(msg: str) -> str:
    """llguidance's multi-line diagnostics, on one line."""
    text = " ".join(line.strip() for line in msg.splitlines() if line.strip())
    return (text[:400] + "...") if len(text) > 400 else (text or "invalid")
