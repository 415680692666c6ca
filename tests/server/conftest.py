"""What the server tests share: request bodies the server must refuse with a 400 naming
their field, and odd ones it must serve (test_server_inprocess.py sends them alone,
test_server_resilience.py beside a live stream)."""

from __future__ import annotations

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
