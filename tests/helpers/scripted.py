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
