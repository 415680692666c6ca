"""SamplingParams: what a request asks of the sampler, validated once at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from swaserve.sampling.json_bounds import SCHEMA_LIMITS, check_schema_size

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (as in vLLM): logits / T overflow


def _f(default, help_: str):
    return field(default=default, metadata={"help": help_})


def _bad(name: str, why: str) -> None:
    raise ValueError(f"{name}: {why}")


def _clean_logit_bias(bias, vocab_size: int | None) -> dict[int, float]:
    """logit_bias as {token id: bias in [-100, 100]}; ValueError on a key that is not a token
    id (of this vocabulary, with `vocab_size`) or a bias that is not a number."""
    if not isinstance(bias, dict):
        _bad("logit_bias", "must map token ids to biases")
    cleaned = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            _bad("logit_bias", f"key {k!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            _bad("logit_bias", f"bias for token {k} must be a number, got {v!r}")
        if isinstance(k, float) or (isinstance(k, str) and not k.strip().isdigit()):
            _bad("logit_bias", f"key {k!r} is not a token id")
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            _bad("logit_bias", f"unknown token id {tid}"
                 + (f" (vocabulary has {vocab_size})" if vocab_size else ""))
        cleaned[tid] = max(-100.0, min(100.0, float(v)))
    return cleaned


@dataclass
class SamplingParams:
    temperature: float = _f(1.0, "0 is greedy; below 1e-5 counts as 0")
    top_k: int = _f(-1, "keep the k most likely tokens (-1 or 0: all)")
    top_p: float = _f(1.0, "keep the smallest set of tokens with this much probability")
    min_p: float = _f(0.0, "drop tokens less likely than min_p times the most likely one")
    frequency_penalty: float = _f(0.0, "subtract this times a token's count in the output")
    presence_penalty: float = _f(0.0, "subtract this from tokens already in the output")
    repetition_penalty: float = _f(1.0, "divide (multiply) positive (negative) logits of "
                                   "tokens seen in prompt or output")
    logit_bias: dict[int, float] | None = _f(None, "token id -> bias added to its logit")
    seed: int | None = _f(None, "this request's seed: the same tokens whatever the batch")
    n: int = _f(1, "completions per prompt")
    max_tokens: int = _f(16, "new tokens at most (0: only compute the prompt, e.g. to score it)")
    min_tokens: int = _f(0, "no eos or stop token before this many new tokens")
    stop: list[str] | str | None = _f(None, "stop string")
    stop_token_ids: list[int] | None = _f(None, "stop token id")
    ignore_eos: bool = _f(False, "keep generating past eos")
    logprobs: int | None = _f(None, "logprobs of the chosen token and this many top ones")
    prompt_logprobs: int | None = _f(None, "logprobs of every prompt token and this many "
                                     "top ones (the prompt is computed cold: no prefix hit)")
    skip_special_tokens: bool = _f(True, "leave special tokens out of the text")
    speculative: bool = _f(True, "draft tokens for this request when the engine speculates "
                           "(False opts out; the output is the same either way)")
    # structured output (at most one): a JSON schema (dict or JSON text), any JSON object,
    # a regular expression, or an EBNF (GBNF or Lark) grammar
    json_schema: dict[str, Any] | str | None = _f(None, "output follows this JSON schema")
    json_object: bool = _f(False, "output is a JSON object")
    regex: str | None = _f(None, "output matches this regular expression")
    grammar: str | None = _f(None, "output follows this EBNF (GBNF) or Lark grammar")

    def __post_init__(self) -> None:
        self.validate()

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids in logit_bias and stop_token_ids exist in this vocabulary (the one
        check that needs the model; ValueError naming the parameter)."""
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"logit_bias: unknown token id {t} (vocabulary has {vocab_size})")
        for t in self.stop_token_ids or []:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: unknown token id {t!r}")

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter (called on construction), in
        field order within each group: how tokens are drawn, how many and what is kept of
        them, where the output stops and which tokens are biased, structured output. With
        `vocab_size`, token ids are checked against it too (`check_token_ids`)."""
        self._validate_drawing()
        self._validate_counts()
        self._validate_tokens(vocab_size)
        self._validate_structured()

    def _number(self, name: str) -> float:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            _bad(name, f"must be a finite number, got {v!r}")
        return float(v)

    def _integer(self, name: str) -> int:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int):
            _bad(name, f"must be an integer, got {v!r}")
        return v

    def _validate_drawing(self) -> None:
        """Temperature, the filters and the penalties."""
        if self._number("temperature") < 0:
            _bad("temperature", f"must be >= 0, got {self.temperature}")
        if self._integer("top_k") < -1:
            _bad("top_k", f"must be -1 or 0 (all) or a positive integer, got {self.top_k}")
        if not 0.0 < self._number("top_p") <= 1.0:
            _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self._number("min_p") < 1.0:
            _bad("min_p", f"must be in [0, 1), got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= self._number(name) <= 2.0:
                _bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self._number("repetition_penalty") <= 0:
            _bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")

    def _validate_counts(self) -> None:
        """n, the token counts, the seed, the logprob counts and the flags."""
        if self._integer("n") < 1:
            _bad("n", f"must be >= 1, got {self.n}")
        if self._integer("max_tokens") < 0:
            _bad("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self._integer("min_tokens") < 0:
            _bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            _bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                _bad("seed", f"must be an integer, got {self.seed!r}")
            if not -(2**63) <= self.seed < 2**64:
                _bad("seed", f"must fit in 64 bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or not 0 <= v <= MAX_LOGPROBS):
                _bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, f"must be true or false, got {getattr(self, name)!r}")

    def _validate_tokens(self, vocab_size: int | None) -> None:
        """Stop strings (one string becomes a list), the logit bias (its keys made token ids,
        its values clamped to [-100, 100]) and the stop token ids."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                _bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.logit_bias is not None:
            self.logit_bias = _clean_logit_bias(self.logit_bias, vocab_size)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                _bad("stop_token_ids", "must be a list of token ids")
            for t in self.stop_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (
                        vocab_size is not None and t >= vocab_size):
                    _bad("stop_token_ids", f"unknown token id {t!r}")

    def _validate_structured(self) -> None:
        """At most one kind of structured output, each of its type (JSON schema text parsed)."""
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                _bad("json_schema", f"is not valid JSON: {e}")
            except RecursionError:
                _bad("json_schema", f"the schema nests too deeply ({SCHEMA_LIMITS})")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            _bad("json_schema", f"must be a JSON object (a schema), got {type(self.json_schema).__name__}")
        if self.json_schema is not None:
            check_schema_size(self.json_schema, "json_schema")
        if not isinstance(self.json_object, bool):
            _bad("json_object", f"must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                _bad(name, "must be a non-empty string")
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            _bad(given[1], f"only one kind of structured output per request; {given[0]} is set too")

    @property
    def structured(self) -> tuple[str, str] | None:
        """(kind, text) of the requested structured output: kind is json | regex | grammar."""
        if self.json_schema is not None:
            return "json", json.dumps(self.json_schema)  # key order is the output order
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
