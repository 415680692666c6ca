"""The tool-call parsers on real (or family-shaped) tokenizers: each output parsed whole,
token by token, in seeded random cuts of tokens and of characters gives the same merged
events; calls are what the format says; content before a call streams before the call's
marker has come; parallel_tool_calls=False keeps one call."""

from __future__ import annotations

import json
import random

import pytest

from swaserve.chat.events import Event, merge_events
from swaserve.chat.registry import make_output_parser
from tests.helpers.tokenizers import load_tokenizer
from tests.server.conftest import blank_ids, parse_in_cuts, random_cuts

GET = {"get": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "n": {"type": "integer"}}}}
ARGS1 = {"city": "Pa}ris \"x\"", "n": 3}
ARGS2 = {"city": "Oslo"}


def hermes(args):
    return "<tool_call>\n" + json.dumps({"name": "get", "arguments": args}) + "\n</tool_call>"


def xml(args):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function=get>\n{params}</function>\n</tool_call>"


def llama(args):
    return json.dumps({"name": "get", "parameters": args})


def ds_call(args):
    return f"<｜tool▁call▁begin｜>get<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def dsml(args, block="tool_calls"):
    d = "｜DSML｜"
    params = "".join(
        f'<{d}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
        f"{v if isinstance(v, str) else json.dumps(v)}</{d}parameter>\n" for k, v in args.items())
    return f'\n\n<{d}{block}>\n<{d}invoke name="get">\n{params}</{d}invoke>\n</{d}{block}>'


def gemma4(args):
    body = ",".join(f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{json.dumps(v)}"
                    for k, v in args.items())
    return "<|tool_call>call:get{" + body + "}<tool_call|>"


CALLS = [("get", ARGS1), ("get", ARGS2)]
# (family, tools, output text, the content, the calls)
CASES = [
    ("qwen3", "hermes", "Let me see.\n" + hermes(ARGS1) + "\n" + hermes(ARGS2),
     "Let me see.\n", CALLS),
    ("qwen3", "hermes", "No <tool_call> here: <tool_call>\n{\"name\": \"other\"}</tool_call>",
     "No <tool_call> here: <tool_call>\n{\"name\": \"other\"}</tool_call>", []),
    ("qwen3", "qwen3_xml", "Sure.\n" + xml(ARGS1) + "\n" + xml(ARGS2), "Sure.\n", CALLS),
    ("llama3", "llama3_json", llama(ARGS1) + "; " + llama(ARGS2), "", CALLS),
    ("llama3", "llama3_json", "<|python_tag|>" + llama(ARGS1), "", CALLS[:1]),
    ("llama3", "llama3_json", "Text {\"name\": \"get\"}", "Text {\"name\": \"get\"}", []),
    ("mistral", "mistral", "Ok.[TOOL_CALLS]get[ARGS]" + json.dumps(ARGS1)
     + "[TOOL_CALLS]get[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(ARGS2), "Ok.", CALLS),
    ("mistral", "mistral", "[TOOL_CALLS]" + json.dumps(
        [{"name": "get", "arguments": ARGS1}, {"name": "get", "arguments": ARGS2}]), "", CALLS),
    ("deepseek", "deepseek", "Hi.<｜tool▁calls▁begin｜>" + ds_call(ARGS1) + ds_call(ARGS2)
     + "<｜tool▁calls▁end｜>", "Hi.", CALLS),
    ("deepseek", "deepseek", "V4." + dsml(ARGS1) + dsml(ARGS2), "V4.\n\n", CALLS),
    ("deepseek", "deepseek", "V3.2." + dsml(ARGS1, "function_calls"), "V3.2.\n\n",
     CALLS[:1]),
    ("gemma4", "gemma4", "Checking.\n" + gemma4(ARGS1) + gemma4(ARGS2), "Checking.\n", CALLS),
    ("gemma4", "gemma4", "<|tool_call>call:get{list:[1,<|\"|>a<|\"|>],o:{k:true}}<tool_call|>",
     "", [("get", {"list": [1, "a"], "o": {"k": True}})]),
    ("qwen3", "json", json.dumps({"name": "get", "arguments": ARGS1}), "", CALLS[:1]),
    ("qwen3", "json", "Here:\n```json\n" + json.dumps(
        [{"name": "get", "arguments": ARGS1}, {"name": "get", "parameters": ARGS2}]) + "\n```",
     "Here:\n", CALLS),
    ("qwen3", "json", '{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    ("qwen3", "json", hermes(ARGS1), "", CALLS[:1]),
]


def expected(content, calls, parallel=True):
    out = [Event("content", content)] if content else []
    for i, (name, args) in enumerate(calls if parallel else calls[:1]):
        out += [Event("call", name=name, index=i), Event("arguments", json.dumps(args), index=i)]
    return out


def normal(events):
    """Arguments compared as JSON values (formats differ in spacing)."""
    return [e if e.kind != "arguments" else (e.index, json.loads(e.text)) for e in events]


@pytest.mark.parametrize("family, tools, text, content, calls", CASES)
def test_parse_is_the_same_in_any_cuts(family, tools, text, content, calls):
    tok = load_tokenizer(family)
    ids = tok.encode(text, add_special_tokens=False)
    opts = dict(reasoning=None, tools=tools, tool_names=GET)
    whole, _ = parse_in_cuts(tok, ids, [len(ids)], **opts)
    assert normal(whole) == normal(expected(content, calls))
    rng = random.Random(0)
    for cuts in [[1] * len(ids)] + [random_cuts(rng, len(ids)) for _ in range(6)]:
        assert parse_in_cuts(tok, ids, cuts, **opts)[0] == whole
    for _ in range(6):  # character cuts: markers split anywhere, not only at tokens
        parser = make_output_parser(tok, **opts)
        events, at = [], 0
        for n in random_cuts(rng, len(text)):
            events += parser.text.feed(text[at:at + n])
            at += n
        assert blank_ids(merge_events(events + parser.finish()), tools) == whole


@pytest.mark.parametrize("family, tools, text, content, calls",
                         [c for c in CASES if len(c[4]) == 2])
def test_parallel_tool_calls_false_keeps_the_first(family, tools, text, content, calls):
    tok = load_tokenizer(family)
    ids = tok.encode(text, add_special_tokens=False)
    got, _ = parse_in_cuts(tok, ids, [1] * len(ids), reasoning=None, tools=tools,
                           tool_names=GET, parallel_tool_calls=False)
    assert normal(got) == normal(expected(content, calls, parallel=False))


@pytest.mark.parametrize("family, tools, text, content, calls",
                         [c for c in CASES if c[3] and c[4]])
def test_content_streams_before_the_call(family, tools, text, content, calls):
    tok = load_tokenizer(family)
    ids = tok.encode(text, add_special_tokens=False)
    parser = make_output_parser(tok, reasoning=None, tools=tools, tool_names=GET)
    said = ""
    for t in ids:
        events = parser.feed([t])
        said += "".join(e.text for e in events if e.kind == "content")
        if any(e.kind == "call" for e in events):
            break
        if tok.decode(ids[:ids.index(t) + 1], False).strip() == content.strip():
            break
    assert said.strip() == content.strip()


def test_arguments_stream_before_the_call_ends():
    tok = load_tokenizer("qwen3")
    ids = tok.encode(hermes({"city": "a long name " * 5}), add_special_tokens=False)
    parser = make_output_parser(tok, reasoning=None, tools="hermes", tool_names=GET)
    fragments = [e for t in ids[:-4] for e in parser.feed([t]) if e.kind == "arguments"]
    assert len(fragments) > 5


@pytest.mark.parametrize("tools", ["hermes", "qwen3_xml", "llama3_json", "json"])
def test_without_tools_everything_is_content(tools):
    tok = load_tokenizer("qwen3")
    text = hermes(ARGS1)
    ids = tok.encode(text, add_special_tokens=False)
    got, _ = parse_in_cuts(tok, ids, [1] * len(ids), reasoning=None, tools=tools,
                           tool_names=None)
    assert got == [Event("content", text)]


def test_qwen3_xml_types_values_by_schema():
    tok = load_tokenizer("qwen3")
    text = xml({"city": "42", "n": "7", "extra": "[1, 2]"})
    ids = tok.encode(text, add_special_tokens=False)
    got, _ = parse_in_cuts(tok, ids, [2] * len(ids), reasoning=None, tools="qwen3_xml",
                           tool_names=GET)
    assert json.loads(got[-1].text) == {"city": "42", "n": 7, "extra": [1, 2]}
