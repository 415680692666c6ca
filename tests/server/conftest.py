"""What the server tests share: request bodies the server must refuse with a 400 naming
their field, and odd ones it must serve (test_server_inprocess.py sends them alone,
test_server_resilience.py beside a live stream), and the tiny chat models
(chat_models.py) as fixtures."""

from __future__ import annotations

import json

from tests.server.chat_models import gpt_oss_chat, qwen3_chat  # noqa: F401  (fixtures)


def nested_schema(levels: int) -> dict:
    """An object schema `levels` objects deep (twice as many JSON levels)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_value(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


_DEEP, _HI = nested_schema(300), [{"role": "user", "content": "x"}]
_WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}
BAD = [  # (route, body, param named in the error)
    ("completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [True], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [[1, 2], "x"], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [-1], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [10**9], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 10000}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "regex": "a("}, "regex"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                          "logprobs": True}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "x"}],
                          "continue_final_message": True}, "continue_final_message"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "documents": ["x"]}, "documents.0"),
    ("responses", {"input": 5}, "input"),
    ("responses", {"input": []}, "input"),
    ("responses", {"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image",
                                                           "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ("responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input.0.call_id"),
    ("responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ("responses", {"input": "hi", "tools": [{"type": "file_search"}]}, "tools.0.type"),
    ("responses", {"input": "hi", "tools": [{"type": "function", "name": "a b"}]},
     "tools.0.name"),
    ("responses", {"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ("responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ("responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ("responses", {"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("responses", {"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ("responses", {"input": "hi", "temperature": "hot"}, "temperature"),
    ("responses", {"input": "hi", "store": True}, "store"),
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    # schemas past the bounds (json_bounds.py), and data nesting past what a render takes
    ("completions", {"prompt": "hi", "json_schema": _DEEP}, "json_schema"),
    ("completions", {"prompt": "hi", "guided_json": json.dumps(_DEEP)}, "json_schema"),
    ("completions", {"prompt": "hi", "json_schema": _WIDE}, "json_schema"),
    ("chat/completions", {"messages": _HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _DEEP}}}, "response_format"),
    ("chat/completions", {"messages": _HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": _DEEP}}]},
     "tools.0.function.parameters"),
    ("chat/completions", {"messages": _HI, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": _WIDE}}]},
     "tools.1.function.parameters"),
    ("chat/completions", {"messages": _HI, "chat_template_kwargs": {"x": nested_value(300)}},
     "chat_template_kwargs"),
    ("chat/completions", {"messages": [*_HI, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {
            "name": "f", "arguments": json.dumps(nested_value(300))}}]}]}, "messages.1"),
]
ODD_BUT_FINE = [  # malformed-looking requests that are valid and must be served
    ("completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 0}),
    ("completions", {"prompt": "hi", "max_tokens": 4, "temperature": 1e-50, "logprobs": 2}),
    ("completions", {"prompt": "hi", "max_tokens": 4, "n": 20, "temperature": 1.0}),
    ("completions", {"prompt": [[5, 6, 7]], "max_tokens": 4}),
    ("chat/completions", {"messages": [{"role": "tool"}], "max_tokens": 4}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                          "logprobs": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 4}),
    # found by tests/server/test_fuzz.py: text parts beside tool calls with empty arguments
    ("chat/completions", {"messages": [{"role": "tool", "content": [{"type": "text", "text": ""}],
                                        "tool_calls": [{"id": "", "function": {
                                            "name": "", "arguments": ""}}]}], "max_tokens": 2}),
]


def parse_in_cuts(tokenizer, ids, cuts, **options):
    """The merged events of one output fed to a fresh parser in the pieces `cuts` (token
    counts), and its reasoning_tokens; call ids blanked after their format is checked."""
    from swaserve.chat.events import merge_events
    from swaserve.chat.registry import make_output_parser

    parser = make_output_parser(tokenizer, **options)
    events, at = [], 0
    for n in cuts:
        events += parser.feed(ids[at:at + n])
        at += n
    events += parser.feed(ids[at:]) + parser.finish()
    return blank_ids(merge_events(events), options.get("tools")), parser.reasoning_tokens


def blank_ids(events, tools):
    """Events with call ids checked (Mistral's nine alphanumerics, else call_ + hex) and
    blanked, so that two parses compare."""
    import dataclasses
    import re

    pattern = r"[A-Za-z0-9]{9}" if tools == "mistral" else r"call_[0-9a-f]+"
    for e in events:
        if e.kind == "call":
            assert re.fullmatch(pattern, e.call_id), e.call_id
    return [dataclasses.replace(e, call_id=None) for e in events]


def random_cuts(rng, total):
    """Piece sizes that add up to at most `total`: short and long pieces mixed."""
    cuts, left = [], total
    while left > 0:
        n = rng.choice([1, 1, 2, 3, 5, 8])
        cuts.append(min(n, left))
        left -= n
    return cuts
