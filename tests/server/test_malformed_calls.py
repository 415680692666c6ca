"""Real models' call outputs that stray from their format's clean form, on the family's
tokenizer, parsed whole and in random token cuts alike: Python-style values typed by the
tool's schema, a call begun inside an unclosed think block, arguments that are not an
object (no call, the block stays content), Llama's calls a line each, Gemma 4's empty
values and trailing dots, DSML values coerced by the schema."""

from __future__ import annotations

import json
import random

from tests.helpers.tokenizers import load_tokenizer
from tests.server.conftest import parse_in_cuts, random_cuts

TOOLS = {"run": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "dry_run": {"type": "boolean"}, "n": {"type": "integer"},
    "x": {"type": "number"}, "opts": {"type": "object"}, "ids": {"type": "array"},
    "note": {"type": "string"}, "any": {}}}}


def parse(family, text, **opts):
    """The merged events, checked to be the same whole, token by token and in cuts."""
    tok = load_tokenizer(family)
    ids = tok.encode(text, add_special_tokens=False)
    opts.setdefault("tool_names", TOOLS)
    whole, _ = parse_in_cuts(tok, ids, [len(ids)], **opts)
    rng = random.Random(1)
    for cuts in [[1] * len(ids)] + [random_cuts(rng, len(ids)) for _ in range(4)]:
        assert parse_in_cuts(tok, ids, cuts, **opts)[0] == whole
    return whole


def calls_of(events):
    """(name, arguments as JSON) of each call, and the content."""
    names = [e.name for e in events if e.kind == "call"]
    args = [json.loads(e.text) for e in events if e.kind == "arguments"]
    content = "".join(e.text for e in events if e.kind == "content")
    return list(zip(names, args, strict=True)), content


def qwen_call(params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=run>\n{body}</function>\n</tool_call>"


def test_qwen3_xml_python_values_typed_by_schema():
    text = qwen_call({"cmd": "True", "dry_run": "True", "n": "3", "x": "1.5",
                      "opts": "{'a': None, 'b': [1, 'x']}", "ids": "[1, 2]",
                      "note": "None", "any": "abc"})
    calls, content = calls_of(parse("qwen3", text, reasoning=None, tools="qwen3_xml"))
    assert calls == [("run", {"cmd": "True", "dry_run": True, "n": 3, "x": 1.5,
                              "opts": {"a": None, "b": [1, "x"]}, "ids": [1, 2],
                              "note": "None", "any": "abc"})]
    assert content == ""


def test_qwen3_xml_value_that_is_not_its_type_stays_a_string():
    text = qwen_call({"dry_run": "maybe", "n": "three", "opts": "{1, 2}"})
    calls, _ = calls_of(parse("qwen3", text, reasoning=None, tools="qwen3_xml"))
    assert calls == [("run", {"dry_run": "maybe", "n": "three", "opts": "{1, 2}"})]


def test_qwen3_call_inside_an_unclosed_think_block_ends_the_reasoning():
    text = "I should run it.\n\n" + qwen_call({"cmd": "ls"})
    for tools in ("qwen3_xml", "hermes"):
        if tools == "hermes":
            text = ("I should run it.\n\n<tool_call>\n"
                    + json.dumps({"name": "run", "arguments": {"cmd": "ls"}}) + "\n</tool_call>")
        events = parse("qwen3", text, reasoning="qwen3", tools=tools,
                       prompt="<|im_start|>assistant\n<think>\n")
        assert events[0].kind == "reasoning" and events[0].text == "I should run it.\n\n"
        assert calls_of(events) == ([("run", {"cmd": "ls"})], "")


def test_qwen3_think_without_tools_keeps_a_tool_call_tag_as_reasoning():
    events = parse("qwen3", "About <tool_call> tags.", reasoning="qwen3", tools=None,
                   tool_names=None, prompt="<|im_start|>assistant\n<think>\n")
    assert [(e.kind, e.text) for e in events] == [("reasoning", "About <tool_call> tags.")]


def dsml_call(params):
    d = "｜DSML｜"
    body = "".join(f'<{d}parameter name="{k}" string="{s}">{v}</{d}parameter>\n'
                   for k, (s, v) in params.items())
    return f'<{d}tool_calls>\n<{d}invoke name="run">\n{body}</{d}invoke>\n</{d}tool_calls>'


def test_dsml_values_coerced_by_schema():
    text = "Ok." + dsml_call({"n": ("true", "5"), "dry_run": ("true", "false"),
                              "cmd": ("false", "null"), "note": ("false", "12"),
                              "x": ("false", "2."), "any": ("false", "[1]")})
    calls, content = calls_of(parse("deepseek", text, reasoning=None, tools="deepseek"))
    assert calls == [("run", {"n": 5, "dry_run": False, "cmd": "null", "note": "12",
                              "x": 2.0, "any": [1]})]
    assert content == "Ok."


def test_hermes_arguments_that_are_not_an_object_are_no_call():
    for args in ('"hello"', "[1, 2]", "5"):
        text = 'Try:\n<tool_call>\n{"name": "run", "arguments": ' + args + "}\n</tool_call>"
        events = parse("qwen3", text, reasoning=None, tools="hermes")
        assert calls_of(events) == ([], text), args
    text = '<tool_call>\n{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>'
    assert calls_of(parse("qwen3", text, reasoning=None, tools="hermes")) == (
        [("run", {"cmd": "ls"})], "")


def test_tagged_call_whose_body_does_not_parse_is_content():
    d = "｜DSML｜"
    text = (f'Ok.<{d}tool_calls>\n<{d}invoke name="run">\n{{"cmd": "ls"}}\n</{d}invoke>\n'
            f"</{d}tool_calls>")
    assert calls_of(parse("deepseek", text, reasoning=None, tools="deepseek")) == ([], text)
    text = '<tool_call>\n<function=run>\n{"cmd": "ls"}\n</function>\n</tool_call>'
    assert calls_of(parse("qwen3", text, reasoning=None, tools="qwen3_xml")) == ([], text)


def llama_call(args):
    return json.dumps({"name": "run", "parameters": args})


def test_llama3_calls_a_line_each_or_after_semicolons():
    for sep in ("\n", ";\n", " ; "):
        text = llama_call({"cmd": "ls"}) + sep + llama_call({"n": 2})
        assert calls_of(parse("llama3", text, reasoning=None, tools="llama3_json")) == (
            [("run", {"cmd": "ls"}), ("run", {"n": 2})], ""), sep


def test_llama3_call_with_invalid_arguments_is_content():
    text = '{"name": "run", "parameters": {"cmd": ls -la, "n": 2}}'
    assert calls_of(parse("llama3", text, reasoning=None, tools="llama3_json")) == ([], text)
    text = llama_call({"cmd": "ls"}) + '\n{"name": "run", "parameters": {"n": }}'
    assert calls_of(parse("llama3", text, reasoning=None, tools="llama3_json")) == (
        [("run", {"cmd": "ls"})], '{"name": "run", "parameters": {"n": }}')


def test_gemma4_empty_values_and_trailing_dots():
    text = ('<|tool_call>call:run{cmd:<|"|>ls<|"|>,n:,x:108.,opts:{a:},ids:[1,2,],'
            'note:<|"|>a,b<|"|>,}<tool_call|>Done.')
    calls, content = calls_of(parse("gemma4", text, reasoning=None, tools="gemma4"))
    assert calls == [("run", {"cmd": "ls", "n": None, "x": 108.0, "opts": {"a": None},
                              "ids": [1, 2], "note": "a,b"})]
    assert content == "Done."


def test_qwen3_think_ends_only_at_its_own_call_opening():
    events = parse("qwen3", "Use ``` fences.</think>Ok.", reasoning="qwen3", tools="json",
                   prompt="<|im_start|>assistant\n<think>\n")
    assert [(e.kind, e.text) for e in events] == [("reasoning", "Use ``` fences."),
                                                   ("content", "Ok.")]
