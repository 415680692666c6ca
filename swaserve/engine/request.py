"""Request: one sequence being generated, with its named lengths and invariants."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from swaserve.memory.prefix_cache import Node
from swaserve.sampling.grammar import GrammarMatcher
from swaserve.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request failed (its `error` says why); its neighbours go on


@dataclass(frozen=True)
class RequestError:
    """Why one request failed: shown to its client only (HTTP status and OpenAI error type)."""

    message: str
    type: str = "server_error"
    status: int = 500
    code: str | None = None


@dataclass
class Request:
    request_id: str  # "<group_id>-<index>" for the n > 1 completions of one prompt
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    seed: int | None = None  # this completion's seed (params.seed + index for n > 1)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    output_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs: per prompt token, {token: logprob, top ones...}; the first
    # token has none (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: RequestError | None = None  # set with FinishReason.ERROR
    arrival: int = 0  # arrival order (the engine numbers requests): the scheduler's priority
    group_id: str = ""  # the id the prompt was added under (its n completions share it)
    cache_node: Node | None = None  # prefix-cache node this request locks (its prefix)
    grammar: GrammarMatcher | None = None  # for structured output
    # overlap scheduling: tokens sampled on the device but not read back yet, and steps in
    # flight that compute this request (its memory is released only when none is left)
    num_pending: int = 0
    in_flight: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if self.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt: {self.num_prompt_tokens} tokens leave no room for output "
                             f"within max_model_len {self.max_model_len}")
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, read back or not."""
        return self.num_output_tokens + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def max_new_tokens(self) -> int:
        return min(self.params.max_tokens, self.max_model_len - self.num_prompt_tokens)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def check(self) -> None:
        """Invariants of the named lengths (tests and debug runs call this)."""
        if not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise AssertionError(f"{self.request_id}: computed {self.num_computed_tokens} "
                                 f"outside [0, {self.num_tokens}]")
        if self.num_tokens > self.max_model_len:
            raise AssertionError(f"{self.request_id}: {self.num_tokens} tokens > max_model_len")
        # a finished request keeps its row while a step in flight still writes its KV
        holds_row = self.status is RequestStatus.RUNNING or (self.is_finished and self.in_flight > 0)
        if (self.row is not None) != holds_row:
            raise AssertionError(f"{self.request_id}: row {self.row} but status {self.status} "
                                 f"({self.in_flight} steps in flight)")
