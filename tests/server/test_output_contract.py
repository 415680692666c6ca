"""The parsers' contract on outputs no format promises: text drawn from each format's
fragments (markers, pieces of markers, JSON pieces, words) in random order, parsed whole,
per token, in random token cuts and random character cuts, gives one merged result.
(Arguments stream as the model writes them: a malformed or cut-short call keeps what it
had, so only well-formed calls promise JSON, as test_tool_parsers.py checks.)"""

from __future__ import annotations

import random

import pytest

from swaserve.chat.events import merge_events
from swaserve.chat.registry import make_output_parser
from tests.helpers.tokenizers import load_tokenizer
from tests.server.conftest import blank_ids, parse_in_cuts, random_cuts

JSON_BITS = ['{"name": "get", "arguments": ', '{"name": "get", "parameters": ', '{"a": 1}',
             '{"b": "x}y\\"', '"}', "}", "]", "[", ", ", "; ", '"arguments": ', "\n", " ",
             '{"name": "nope"', "```json\n", "```", "hello", "ü✓"]
FRAGMENTS = {
    "hermes": JSON_BITS + ["<tool_call>", "</tool_call>", "<tool_", "call>"],
    "json": JSON_BITS + ["<tool_call>", "</tool_call>", "```"],
    "llama3_json": JSON_BITS + ["<|python_tag|>"],
    "mistral": JSON_BITS + ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get", "abc123456"],
    "deepseek": JSON_BITS + ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get",
                             "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>",
                             "<｜DSML｜tool_calls>", '<｜DSML｜invoke name="get">',
                             '<｜DSML｜parameter name="a" string="true">', "</｜DSML｜parameter>",
                             '<｜DSML｜parameter name="n" string="false">', "</｜DSML｜invoke>",
                             "</｜DSML｜tool_calls>", "<｜DSML｜"],
    "gemma4": ["<|tool_call>", "call:get{", "call:nope{", "<tool_call|>", '<|"|>', "k:", "1",
               "[", "]", "{", "}", ",", "text", " ", "<|tool_"],
    "qwen3_xml": ["<tool_call>\n", "<function=get>\n", "<function=nope>", "<parameter=a>\n",
                  "<parameter=n>\n", "12", "text", "\n</parameter>\n", "</parameter>",
                  "</function>\n", "</tool_call>", "<tool_", "\n", " "],
}
FAMILY = {"hermes": "qwen3", "json": "qwen3", "qwen3_xml": "qwen3", "llama3_json": "llama3",
          "mistral": "mistral", "deepseek": "deepseek", "gemma4": "gemma4"}
THINK_BITS = ["<think>", "</think>", "<th", "ink>", "</", "\n"]
NAMES = {"get": {"type": "object", "properties": {"a": {"type": "string"},
                                                   "n": {"type": "integer"}}}}


HARMONY_BITS = ["<|start|>assistant", "<|channel|>", "analysis", "final", "commentary",
                " to=functions.get", " to=functions.nope", "<|constrain|>json", "<|message|>",
                "<|end|>", "<|call|>", "<|return|>", '{"a": 1}', "Hi ", "ü✓", "<|endoftext|>"]


@pytest.mark.parametrize("tools, reasoning", [(t, None) for t in sorted(FRAGMENTS)] + [
    (t, "qwen3") for t in sorted(FRAGMENTS) if FAMILY[t] == "qwen3"])
def test_any_output_parses_the_same_in_any_cuts(tools, reasoning):
    tok = load_tokenizer(FAMILY[tools])
    rng = random.Random(f"{tools}-{reasoning}")
    bits = FRAGMENTS[tools] + (THINK_BITS if reasoning else [])
    opts = dict(reasoning=reasoning, tools=tools, tool_names=NAMES,
                prompt=rng.choice(["", "<think>\n"]) if reasoning else "")
    for _ in range(100):
        text = "".join(rng.choice(bits) for _ in range(rng.randint(1, 14)))
        ids = tok.encode(text, add_special_tokens=False)
        whole = parse_in_cuts(tok, ids, [len(ids)], **opts)
        assert parse_in_cuts(tok, ids, [1] * len(ids), **opts) == whole, text
        assert parse_in_cuts(tok, ids, random_cuts(rng, len(ids)), **opts) == whole, text
        parser = make_output_parser(tok, **opts)
        events, at = [], 0
        for n in random_cuts(rng, len(text)):
            events += parser.text.feed(text[at:at + n])
            at += n
        assert blank_ids(merge_events(events + parser.finish()), tools) == whole[0], text


@pytest.mark.parametrize("tool_names", [NAMES, None])
def test_any_harmony_output_parses_the_same_in_any_cuts(tool_names):
    tok = load_tokenizer("gpt-oss")
    rng = random.Random(3)
    opts = dict(reasoning="harmony", tools="harmony", tool_names=tool_names,
                prompt="<|start|>assistant")
    for _ in range(100):
        text = "".join(rng.choice(HARMONY_BITS) for _ in range(rng.randint(1, 16)))
        ids = tok.encode(text, add_special_tokens=False, )
        whole = parse_in_cuts(tok, ids, [len(ids)], **opts)
        assert parse_in_cuts(tok, ids, [1] * len(ids), **opts) == whole, text
        assert parse_in_cuts(tok, ids, random_cuts(rng, len(ids)), **opts) == whole, text
