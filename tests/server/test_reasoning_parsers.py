"""`<think>` reasoning on the real Qwen3 tokenizer: split across tokens, opened by the
prompt, never closed; the same in any cuts; reasoning tokens counted; the rest goes on to
the tool parser. And default_parsers on the real chat templates' syntax."""

from __future__ import annotations

import random

import pytest

from swaserve.chat.events import Event
from swaserve.chat.registry import default_parsers
from tests.helpers.tokenizers import load_tokenizer
from tests.server.conftest import parse_in_cuts, random_cuts

QWEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN_ON = "<|im_start|>assistant\n<think>\n"
# (reasoning parser, prompt, output, expected merged events)
CASES = [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me think.\n</think>\n\nHello!",
     [Event("reasoning", "Let me think.\n"), Event("content", "Hello!")]),
    ("qwen3", "<|im_start|>assistant\n", "Hello <think> there",
     [Event("content", "Hello <think> there")]),
    ("qwen3", QWEN_OFF, "Just the answer.", [Event("content", "Just the answer.")]),
    ("qwen3", QWEN_ON, "Still thinking</think>Answer",
     [Event("reasoning", "Still thinking"), Event("content", "Answer")]),
    ("qwen3", QWEN_ON, "Never closed <th", [Event("reasoning", "Never closed <th")]),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm.\n</think>\n\nYes.",
     [Event("reasoning", "Hmm.\n"), Event("content", "Yes.")]),
    ("deepseek_r1", "<｜Assistant｜></think>", "Yes.", [Event("content", "Yes.")]),
]


@pytest.mark.parametrize("reasoning, prompt, text, want", CASES)
def test_think_blocks_in_any_cuts(reasoning, prompt, text, want):
    tok = load_tokenizer("qwen3")
    ids = tok.encode(text, add_special_tokens=False)
    opts = dict(reasoning=reasoning, tools=None, tool_names=None, prompt=prompt)
    whole, counted = parse_in_cuts(tok, ids, [len(ids)], **opts)
    assert whole == want
    rng = random.Random(1)
    for cuts in [[1] * len(ids)] + [random_cuts(rng, len(ids)) for _ in range(5)]:
        assert parse_in_cuts(tok, ids, cuts, **opts) == (whole, counted)


@pytest.mark.parametrize("prompt, text, want", [
    ("<|turn>model\n", "<|channel>thought\nWhy.<channel|>Because.",
     [Event("reasoning", "Why."), Event("content", "Because.")]),
    ("<|turn>model\n<|channel>thought\n<channel|>", "Because.", [Event("content", "Because.")]),
])
def test_gemma4_thought_channel(prompt, text, want):
    tok = load_tokenizer("gemma4")
    ids = tok.encode(text, add_special_tokens=False)
    opts = dict(reasoning="gemma4", tools="gemma4", tool_names={"get"}, prompt=prompt)
    for cuts in ([len(ids)], [1] * len(ids), [2] * len(ids)):
        assert parse_in_cuts(tok, ids, cuts, **opts)[0] == want


def test_magistral_think_then_a_call():
    tok = load_tokenizer("mistral")
    text = '[THINK]Need the weather.[/THINK]Checking.[TOOL_CALLS]get[ARGS]{"a": 1}'
    ids = tok.encode(text, add_special_tokens=False)
    got, counted = parse_in_cuts(tok, ids, [1] * len(ids), reasoning="mistral",
                                 tools="mistral", tool_names={"get"})
    assert [(e.kind, e.text) for e in got] == [
        ("reasoning", "Need the weather."), ("content", "Checking."), ("call", ""),
        ("arguments", '{"a": 1}')]
    assert counted == len(tok.encode("[THINK]Need the weather.[/THINK]",
                                     add_special_tokens=False))


def test_unknown_parsers_are_refused():
    tok = load_tokenizer("qwen3")
    from swaserve.chat.registry import make_output_parser

    with pytest.raises(ValueError, match="reasoning"):
        make_output_parser(tok, reasoning="nope", tools=None, tool_names=None)
    with pytest.raises(ValueError, match="tool"):
        make_output_parser(tok, reasoning=None, tools="nope", tool_names=None)


def test_reasoning_tokens_are_the_think_blocks_tokens():
    tok = load_tokenizer("qwen3")
    think = tok.encode("<think>\nA few words of thought.\n</think>", add_special_tokens=False)
    answer = tok.encode("\n\nThe answer.", add_special_tokens=False)
    _, counted = parse_in_cuts(tok, think + answer, [1] * 99, reasoning="qwen3", tools=None,
                               tool_names=None)
    assert counted == len(think)


def test_tags_split_across_tokens():
    tok = load_tokenizer("qwen3")
    # the tags spelt in pieces, as a model may sample them
    ids = [i for piece in ["<", "th", "ink", ">", "Deep", "</", "think", ">", "Done"]
           for i in tok.encode(piece, add_special_tokens=False)]
    got, _ = parse_in_cuts(tok, ids, [1] * len(ids), reasoning="qwen3", tools=None,
                           tool_names=None)
    assert got == [Event("reasoning", "Deep"), Event("content", "Done")]


def test_after_the_reasoning_the_tool_parser_reads():
    tok = load_tokenizer("qwen3")
    text = ('Plan.</think>\n\nCalling.\n<tool_call>\n{"name": "get", "arguments": {"a": 1}}'
            "\n</tool_call>")
    ids = tok.encode(text, add_special_tokens=False)
    got, _ = parse_in_cuts(tok, ids, [1] * len(ids), reasoning="qwen3", tools="hermes",
                           tool_names={"get"}, prompt=QWEN_ON)
    assert [(e.kind, e.text) for e in got] == [
        ("reasoning", "Plan."), ("content", "Calling.\n"), ("call", ""),
        ("arguments", '{"a": 1}')]


def test_eos_is_left_out():
    tok = load_tokenizer("qwen3")
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    got, _ = parse_in_cuts(tok, ids, [1] * 9, reasoning="qwen3", tools=None, tool_names=None)
    assert got == [Event("content", "Hi")]


TEMPLATES = {
    "openai-gpt-oss-120b": '<|start|>assistant<|channel|>final<|message|>',
    "Qwen3": "{{ '<think>\\n\\n</think>' }}<tool_call>\\n{{ tool_call | tojson }}",
    "Qwen3.5": "<think>\\n<tool_call>\\n<function=' + name + '>\\n<parameter=",
    "Qwen2.5": "<tool_call>\\n{\"name\": <function-name>}",
    "GLM-4.6": "<think></think><tool_call>{function-name}\n<arg_key>k</arg_key>",
    "Llama-3.1": "<|python_tag|>{{ call }}<|eom_id|>",
    "Mistral-Small-3.2": "{{- '[TOOL_CALLS]' + name + '[ARGS]' }}",
    "Ministral-3-Reasoning": "[THINK]' + thinking + '[/THINK]'{{- '[TOOL_CALLS]' }}",
    "DeepSeek-V3.1": "<｜Assistant｜><think><｜tool▁calls▁begin｜>",
    "R1-Distill": "<｜Assistant｜><think>\\n",
    "Gemma": "<start_of_turn>model\\n",
    "Gemma 4": "{{- '<|tool_call>call:' + function['name'] + '{' -}}",
}


@pytest.mark.parametrize("name, want", [
    ("openai-gpt-oss-120b", ("harmony", "harmony")), ("Qwen3", ("qwen3", "hermes")),
    ("Qwen3.5", ("qwen3", "qwen3_xml")), ("Qwen2.5", (None, "hermes")),
    ("GLM-4.6", (None, None)),
    ("Llama-3.1", (None, "llama3_json")), ("Mistral-Small-3.2", (None, "mistral")),
    ("Ministral-3-Reasoning", ("mistral", "mistral")),
    ("DeepSeek-V3.1", ("deepseek_r1", "deepseek")), ("R1-Distill", ("deepseek_r1", "json")),
    ("Gemma", (None, "json")), ("Gemma 4", ("gemma4", "gemma4"))])
def test_default_parsers_read_the_template(name, want):
    assert default_parsers(TEMPLATES[name]) == want
    assert default_parsers(None) == (None, "json")
