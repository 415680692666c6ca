"""A scripted sampler for tests: a tiny random model's requests write given token ids, so a
response's parsing (reasoning, tool calls) can be checked on an output the test chose."""

from __future__ import annotations

from collections.abc import Sequence


def script_outputs(engine, tokens: Sequence[int], end: int) -> None:
    """From now on every request of `engine` writes `tokens` in place of what it samples,
    then `end` (a stop token) for ever after. The tokens go through the engine's output
    handling as sampled ones do: detokenizer, stop checks, grammar."""
    output = engine.output
    accept = type(output).accept

    def scripted(req, tok, logprobs, now=None):
        k = len(req.output_token_ids)
        accept(output, req, tokens[k] if k < len(tokens) else end, logprobs, now)

    output.accept = scripted


def script_turns(engine, outputs: Sequence[Sequence[int]], end: int) -> None:
    """Like script_outputs, but the k-th request from now on writes `outputs[k]` (the
    last one for every request after them): a conversation of several turns, scripted."""
    output = engine.output
    accept = type(output).accept
    turn_of: dict[str, int] = {}

    def scripted(req, tok, logprobs, now=None):
        turn = turn_of.setdefault(req.request_id, min(len(turn_of), len(outputs) - 1))
        tokens, k = outputs[turn], len(req.output_token_ids)
        accept(output, req, tokens[k] if k < len(tokens) else end, logprobs, now)

    output.accept = scripted
