"""Required and named calls in the family's own syntax (chat/grammar.py): the grammar
accepts a call exactly as the family's real chat template writes it into the history, and
the family's output parser reads that call back; a JSON answer may follow reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swaserve.chat.events import merge_events
from swaserve.chat.grammar import CALL_GRAMMARS, answer_grammar
from swaserve.chat.registry import make_output_parser
from swaserve.chat.tools import ToolPlan
from swaserve.sampling.grammar import GrammarCompiler
from tests.helpers.tokenizers import load_tokenizer

pytest.importorskip("llguidance")
TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                   "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}},
             "required": ["zone"], "additionalProperties": False}}}]
ARGS = {"city": "Paris", "days": 3}
# family tokenizer, template, tool format, reasoning format, the end of the call's turn
FAMILIES = [
    ("gpt-oss", "openai-gpt-oss-120b.jinja", "harmony", "harmony", "<|call|>"),
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", "hermes", "qwen3", "<|im_end|>"),
    ("llama3", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", None, "<|eot_id|>"),
    ("mistral", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", None, "</s>"),
    ("deepseek", "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek", None, "<｜end▁of▁sentence｜>"),
]
SPECIALS = {"gpt-oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
            "qwen3": {"eos_token": "<|im_end|>"},
            "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
            "deepseek": {"bos_token": "<｜begin▁of▁sentence｜>",
                         "eos_token": "<｜end▁of▁sentence｜>"}}


def _plan(mode: str) -> ToolPlan:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    return ToolPlan(mode, params, TOOLS, name="get_weather" if mode == "named" else None)


def _render(template: str, messages: list[dict], family: str, generation: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], tools=TOOLS, chat_template=template,
        add_generation_prompt=generation, **SPECIALS[family])
    return rendered[0]


def _written_call(template: str, family: str, end: str) -> tuple[str, str]:
    """(the prompt, the assistant's call) as the template writes a call into the history."""
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123XYZ", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}}]}
    result = {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny"}
    prompt = _render(template, user, family, True)
    full = _render(template, [*user, call, result], family, False)
    assert full.startswith(prompt), "the template renders the prompt as the history's start"
    written = full[len(prompt):]
    return prompt, written[:written.index(end)]


def _accepts(compiler: GrammarCompiler, grammar: str, ids: list[int]) -> bool:
    matcher = compiler.compile("grammar", grammar).new_matcher()
    return all(matcher.accept(t) for t in ids) and matcher.is_terminated


@pytest.mark.parametrize("family,template,fmt,reasoning,end", FAMILIES,
                         ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("mode", ["named", "required"])
def test_call_grammar_accepts_the_template_syntax(family, template, fmt, reasoning, end,
                                                   mode):
    assert fmt in CALL_GRAMMARS
    tok = load_tokenizer(family)
    source = (TEMPLATES / template).read_text()
    prompt, written = _written_call(source, family, end)
    grammar = answer_grammar(tok, reasoning=reasoning, tools=fmt, template=source,
                             prompt=prompt, plan=_plan(mode), schema=None)
    assert grammar is not None
    compiler = GrammarCompiler(tok, tok.vocab_size, list(tok.eos_token_ids))
    ids = tok.encode(written, add_special_tokens=False)
    assert _accepts(compiler, grammar, ids), (written, grammar)
    # the other tool, named with these arguments, is refused
    wrong = written.replace("get_weather", "get_time")
    assert not _accepts(compiler, grammar, tok.encode(wrong, add_special_tokens=False))
    # and the family's parser reads the call back
    parser = make_output_parser(tok, reasoning=reasoning, tools=fmt, tool_names=["get_weather",
                                "get_time"], prompt=prompt)
    events = merge_events(parser.feed(ids) + parser.finish())
    calls = [e for e in events if e.kind == "call"]
    args = "".join(e.text for e in events if e.kind == "arguments")
    assert [c.name for c in calls] == ["get_weather"] and json.loads(args) == ARGS


def test_harmony_call_after_analysis():
    tok = load_tokenizer("gpt-oss")
    source = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    prompt, written = _written_call(source, "gpt-oss", "<|call|>")
    grammar = answer_grammar(tok, reasoning="harmony", tools="harmony", template=source,
                             prompt=prompt, plan=_plan("named"), schema=None)
    compiler = GrammarCompiler(tok, tok.vocab_size, list(tok.eos_token_ids))
    text = "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant" \
        + written
    assert _accepts(compiler, grammar, tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family,reasoning,prompt_end,answer", [
    ("qwen3", "qwen3", "<|im_start|>assistant\n",
     '<think>\nJust numbers.\n</think>\n\n{"n": 4}'),
    ("qwen3", "qwen3", "<|im_start|>assistant\n", '{"n": 4}'),
    ("qwen3", "deepseek_r1", "<|im_start|>assistant\n<think>\n", 'short</think>{"n": 4}'),
    ("gpt-oss", "harmony", "<|start|>assistant",
     '<|channel|>analysis<|message|>count<|end|><|start|>assistant<|channel|>final'
     '<|message|>{"n": 4}'),
])
def test_json_answer_after_reasoning(family, reasoning, prompt_end, answer):
    tok = load_tokenizer(family)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    grammar = answer_grammar(tok, reasoning=reasoning, tools=None, template="",
                             prompt="...user turn..." + prompt_end, plan=None, schema=schema)
    compiler = GrammarCompiler(tok, tok.vocab_size, list(tok.eos_token_ids))
    assert _accepts(compiler, grammar, tok.encode(answer, add_special_tokens=False))
    assert not _accepts(compiler, grammar, tok.encode(answer.replace("4", '"4"'),
                                                      add_special_tokens=False))


def test_no_grammar_where_the_format_has_none():
    tok = load_tokenizer("qwen3")
    for fmt in ("qwen3_xml", "json", None):
        assert answer_grammar(tok, reasoning=None, tools=fmt, template="", prompt="",
                              plan=_plan("named"), schema=None) is None
    # without reasoning, a schema applies to the whole output as before
    assert answer_grammar(tok, reasoning=None, tools=None, template="", prompt="",
                          plan=None, schema={"type": "object"}) is None


@pytest.mark.parametrize("family,template,fmt,reasoning,end", FAMILIES[:2],
                         ids=[f[0] for f in FAMILIES[:2]])
def test_json_answer_or_a_call_with_tools_on_offer(family, template, fmt, reasoning, end):
    """tool_choice auto beside a schema: the family's call, or the answer, both pass."""
    tok = load_tokenizer(family)
    source = (TEMPLATES / template).read_text()
    prompt, written = _written_call(source, family, end)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    grammar = answer_grammar(tok, reasoning=reasoning, tools=fmt, template=source,
                             prompt=prompt, plan=_plan("auto"), schema=schema)
    compiler = GrammarCompiler(tok, tok.vocab_size, list(tok.eos_token_ids))
    answer = ('<|channel|>final<|message|>{"n": 4}' if fmt == "harmony"
              else '<think>\nok\n</think>\n\n{"n": 4}')
    for text in (written + end, answer, written + "\n" + written + end):
        if fmt == "harmony" and text.count("to=") > 1:
            continue  # a Harmony call ends its turn: one a turn
        assert _accepts(compiler, grammar, tok.encode(text, add_special_tokens=False)), text
    assert not _accepts(compiler, grammar, tok.encode("plain words" + end,
                                                      add_special_tokens=False))
