"""Real models' chat templates (chat_templates/, SOURCES.md) rendered by swaserve's
ChatTemplate and by transformers' `apply_chat_template`, with the same special tokens and
the date frozen in both: the texts are equal byte for byte, or both renderers refuse."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from swaserve.chat import template as ct
from swaserve.chat.template import ChatTemplate, ChatTemplateError

TEMPLATES = Path(__file__).parent / "chat_templates"
FROZEN = dt.datetime(2026, 3, 14, 9, 26, 53)
LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
SPECIAL_TOKENS = {  # what each family's tokenizer_config.json names
    "openai-gpt-oss-120b": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                            "pad_token": "<|endoftext|>"},
    "Qwen-Qwen3-0.6B": QWEN,
    "Qwen3.5-4B": QWEN,
    "meta-llama-Llama-3.1-8B-Instruct": LLAMA,
    "meta-llama-Llama-3.2-3B-Instruct": LLAMA,
    "meta-llama-Llama-3.3-70B-Instruct": LLAMA,
    "Mistral-Small-3.2-24B-Instruct-2506": MISTRAL,
    "mistralai-Mistral-Nemo-Instruct-2407": MISTRAL,
    "google-gemma-4-31B-it": {"bos_token": "<bos>", "eos_token": "<eos>",
                              "pad_token": "<pad>", "unk_token": "<unk>"},
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": DEEPSEEK,
    "deepseek-ai-DeepSeek-V3.1": DEEPSEEK,
    "deepseek-ai-DeepSeek-V4": DEEPSEEK,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {"bos_token": "<|begin_of_text|>",
                                                    "eos_token": "<|im_end|>"},
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
USER = {"role": "user", "content": "What's the weather in Paris? \"Quotes\" & <tags>é"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "a1B2c3D4e", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
RESULT = {"role": "tool", "tool_call_id": "a1B2c3D4e", "name": "get_weather",
          "content": '{"temperature": 21, "sky": "clear"}'}
ANSWER = {"role": "assistant", "content": "It is 21 °C and clear in Paris."}
THOUGHT = {"role": "assistant", "content": "Paris is the capital.",
           "reasoning_content": "The user asks for a capital; France's is Paris."}
CASES = {  # name: (messages, render keyword arguments)
    "system_user": ([SYSTEM, USER], {}),
    "multi_turn": ([SYSTEM, USER, ANSWER, {"role": "user", "content": "And tomorrow?"}], {}),
    "tools": ([SYSTEM, USER], {"tools": TOOLS}),
    "tool_round": ([USER, CALL, RESULT, {"role": "user", "content": "Thanks. Berlin?"}],
                   {"tools": TOOLS}),
    "after_tool_result": ([USER, CALL, RESULT], {"tools": TOOLS}),
    "reasoning_history": ([USER, THOUGHT, {"role": "user", "content": "And Italy's?"}], {}),
    "reasoning_named_thinking": ([USER, {"role": "assistant", "content": "Rome.",
                                         "thinking": "Italy: Rome."}, USER], {}),
    "thinking_on": ([SYSTEM, USER], {"kwargs": {"enable_thinking": True}}),
    "thinking_off": ([SYSTEM, USER], {"kwargs": {"enable_thinking": False}}),
    "effort_low": ([SYSTEM, USER], {"kwargs": {"reasoning_effort": "low"}}),
    "effort_high": ([USER], {"kwargs": {"reasoning_effort": "high"}, "tools": TOOLS}),
    "continue_final": ([USER, {"role": "assistant", "content": "It is"}],
                       {"add_generation_prompt": False, "continue_final_message": True}),
    "no_generation_prompt": ([SYSTEM, USER, ANSWER], {"add_generation_prompt": False}),
    "none_keys_dropped": ([{**USER, "name": None}], {}),
}


hf_utils = pytest.importorskip("transformers.utils.chat_template_utils")
if not hasattr(hf_utils, "_alias_reasoning_fields"):
    pytest.skip("this transformers predates the rendering compared here (reasoning aliases)",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def frozen_date(monkeypatch):

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return FROZEN

    monkeypatch.setattr(hf_utils, "datetime", Frozen)
    monkeypatch.setattr(ct, "now", lambda: FROZEN)


def hf_tokenizer(source: str, special: dict[str, str]):
    """A transformers tokenizer carrying the template and special tokens (its vocabulary
    does not matter: the text is compared before tokenization)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"x": 0},
                                                                        unk_token="x")),
                                   chat_template=source, **special)


def outcome(fn) -> tuple[str, str]:
    try:
        return "text", fn()
    except Exception as e:  # noqa: BLE001 - either renderer's refusal
        return "error", type(e).__name__


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", sorted(SPECIAL_TOKENS))
def test_renders_as_transformers(family, case):
    source = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    special = SPECIAL_TOKENS[family]
    messages, kw = CASES[case]
    ours = outcome(lambda: ChatTemplate(source, special).render(
        messages, add_generation_prompt=kw.get("add_generation_prompt", True),
        continue_final_message=kw.get("continue_final_message", False),
        tools=kw.get("tools"), kwargs=kw.get("kwargs")))
    tok = hf_tokenizer(source, special)
    theirs = outcome(lambda: tok.apply_chat_template(
        messages, tools=kw.get("tools"), tokenize=False,
        add_generation_prompt=kw.get("add_generation_prompt", True),
        continue_final_message=kw.get("continue_final_message", False),
        **kw.get("kwargs", {})))
    if ours[0] == "error":
        assert theirs[0] == "error", f"only swaserve refused: {ours[1]}"
    else:
        assert ours == theirs


def test_every_committed_template_is_exercised():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(SPECIAL_TOKENS)


def test_the_mistral_eos_after_an_assistant_turn_renders():
    source = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
    text = ChatTemplate(source, MISTRAL).render([USER, ANSWER, USER])
    assert text.startswith("<s>") and "Paris.</s>[INST]" in text


def test_a_template_that_refuses_is_a_messages_error():
    source = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    bad_id = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": "short"}]}
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, MISTRAL).render([USER, bad_id, {**RESULT, "tool_call_id":
                                                             "short"}], tools=TOOLS)
    assert e.value.param == "messages"
