"""The Harmony parser on the real o200k_harmony tokenizer: split at every token boundary
it equals the one-shot parse, and both equal openai-harmony's StreamableParser (the
reference, given o200k_base rebuilt offline from the same vocabulary)."""

from __future__ import annotations

import os
import random

import pytest

from swaserve.chat.events import Event, merge_events
from tests.helpers.tokenizers import load_tokenizer, write_tiktoken_file
from tests.server.conftest import parse_in_cuts

TOOLS = {"get_weather", "lookup"}
OUTPUTS = [
    "<|channel|>analysis<|message|>The user wants weather. Ünïcode ✓ 日本.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Tokyo", "unit": "c"}<|call|>',
    "<|channel|>analysis<|message|>Short.<|end|><|start|>assistant<|channel|>final"
    "<|message|>It is **sunny**, 21 °C.<|return|>",
    "<|channel|>commentary<|message|>Checking two things.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.lookup<|message|>{"q": 1}<|call|>'
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Oslo"}<|call|>',
    "<|channel|>analysis<|message|>Unknown tool.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.nope <|constrain|>json<|message|>{"a": 1}<|call|>',
    "<|channel|>final<|message|>Cut short without an end",
]


def expected_from_reference(messages, tool_names):
    events, calls = [], 0
    for m in messages:
        text = "".join(c.text for c in m.content)
        if m.recipient is None:
            events.append(Event("reasoning" if m.channel == "analysis" else "content", text))
        elif m.recipient.startswith("functions.") and m.recipient[10:] in (tool_names or ()):
            events += [Event("call", name=m.recipient[10:], index=calls),
                       Event("arguments", text, index=calls)]
            calls += 1
    return merge_events(events)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """openai-harmony's encoding, or a skip where it cannot load offline."""
    base = tmp_path_factory.mktemp("tiktoken")
    write_tiktoken_file("o200k.vocab", base / "o200k_base.tiktoken")
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(base)
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # noqa: BLE001 - no package, no encoding: the oracle is absent
        pytest.skip(f"openai-harmony cannot load offline: {e}")
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


def _ids(text):
    return load_tokenizer("gpt-oss").encode(text, add_special_tokens=False)


OPTS = dict(reasoning="harmony", tools="harmony", prompt="<|start|>user<|message|>Hi<|end|>"
            "<|start|>assistant")


@pytest.mark.parametrize("tool_names", [TOOLS, None])
@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_equals_one_shot_and_the_reference(text, tool_names, reference):
    from openai_harmony import Role, StreamableParser

    tok = load_tokenizer("gpt-oss")
    ids = _ids(text)
    whole, counted = parse_in_cuts(tok, ids, [len(ids)], tool_names=tool_names, **OPTS)
    for i in range(len(ids)):
        assert parse_in_cuts(tok, ids, [i], tool_names=tool_names, **OPTS) == (whole, counted)
    assert parse_in_cuts(tok, ids, [1] * len(ids), tool_names=tool_names, **OPTS)[0] == whole
    ref = StreamableParser(reference, role=Role.ASSISTANT)
    for t in ids:
        ref.process(t)
    messages = list(ref.messages)
    if ref.current_content:  # the message the output stopped inside
        from openai_harmony import Author, Message, TextContent

        messages.append(Message(author=Author(role=Role.ASSISTANT),
                                content=[TextContent(text=ref.current_content)],
                                channel=ref.current_channel, recipient=ref.current_recipient))
    assert whole == expected_from_reference(messages, tool_names)


def test_reasoning_tokens_are_the_analysis_messages():
    tok = load_tokenizer("gpt-oss")
    analysis = _ids("<|channel|>analysis<|message|>Think a while here.<|end|>")
    final = _ids("<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    _, counted = parse_in_cuts(tok, analysis + final, [1] * 99, tool_names=None, **OPTS)
    assert counted == len(analysis)


def test_parallel_tool_calls_false_keeps_the_first():
    tok = load_tokenizer("gpt-oss")
    ids = _ids(OUTPUTS[2])
    got, _ = parse_in_cuts(tok, ids, [3] * len(ids), tool_names=TOOLS,
                           parallel_tool_calls=False, **OPTS)
    assert [e.kind for e in got] == ["content", "call", "arguments"]
    assert got[1].name == "lookup"


def test_a_prompt_that_opens_the_final_message():
    tok = load_tokenizer("gpt-oss")
    ids = _ids("Already answering.<|return|>")
    got, _ = parse_in_cuts(tok, ids, [1] * len(ids), reasoning="harmony", tools=None,
                           tool_names=None,
                           prompt="<|start|>assistant<|channel|>final<|message|>")
    assert got == [Event("content", "Already answering.")]


def test_random_cuts_of_a_long_output():
    tok = load_tokenizer("gpt-oss")
    ids = _ids("".join(OUTPUTS[:3]).replace("<|channel|>", "<|start|>assistant<|channel|>")
               [len("<|start|>assistant"):])
    whole = parse_in_cuts(tok, ids, [len(ids)], tool_names=TOOLS, **OPTS)
    rng = random.Random(2)
    for _ in range(20):
        cuts = [rng.randint(1, 7) for _ in range(len(ids))]
        assert parse_in_cuts(tok, ids, cuts, tool_names=TOOLS, **OPTS) == whole
