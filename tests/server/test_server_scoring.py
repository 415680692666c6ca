"""Prompt scoring over HTTP (`echo` with `logprobs`, as lm-eval sends it) and the tokenizer
routes, in process with the official openai client over httpx's ASGI transport: a tiny
float32 model with a real tokenizer, checked against transformers."""

from __future__ import annotations

import json

import pytest

from tests.conftest import (
    HYBRID,
    hf_logprobs,
    inprocess_app,
    run_client,
    write_byte_bpe_tokenizer,
    write_tiny_gemma3,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_scoring")
    vocab = write_byte_bpe_tokenizer(path)
    model = write_tiny_gemma3(path, HYBRID, vocab=vocab, seed=5)
    return str(path), model


@pytest.fixture(scope="module")
def app(tiny):
    # chunks of 7 across the window of 8
    yield from inprocess_app(tiny[0], kv_memory="16MiB", max_running_requests=8,
                             max_model_len=256, chunk_size=7)



TEXT = "hello world 123-4567 true false null [1, 2, 3.5] " * 2


def test_echo_with_logprobs_scores_the_prompt_like_transformers(app, tiny):
    async def fn(client, http):
        ids = (await http.post("/tokenize", json={"prompt": TEXT})).json()["tokens"]
        a = await client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2,
                                            max_tokens=0)
        b = await client.completions.create(model="tiny", prompt=TEXT, echo=True, logprobs=1,
                                            max_tokens=1, temperature=0)
        # the same prompt again: now a prefix-cache hit for anyone not scoring it
        c = await client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2,
                                            max_tokens=0)
        return ids, a, b, c

    ids, a, b, c = run_client(app, fn)
    assert len(ids) > 24  # past three windows of 8
    ref = hf_logprobs(tiny[1], ids)
    for resp, n_new in ((a, 0), (b, 1), (c, 0)):
        ch = resp.choices[0]
        lp = ch.logprobs
        assert len(lp.tokens) == len(ids) + n_new
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            best = ref[i - 1].max().item()
            assert max(lp.top_logprobs[i].values()) == pytest.approx(best, abs=1e-4)
        assert resp.usage.completion_tokens == n_new
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert a.choices[0].text == TEXT  # the text of the prompt ids
    assert b.choices[0].text.startswith(TEXT)  # the prompt as given, then the completion
    assert a.choices[0].finish_reason == "length"
    # the generated token's logprob comes last, as lm-eval reads it ([ctxlen:-1])
    gen = b.choices[0].logprobs.token_logprobs[-1]
    assert gen == pytest.approx(ref[-1].max().item(), abs=1e-4)


def test_echo_streamed_sends_the_prompt_first_once(app):
    async def fn(client, http):
        parts = []
        stream = await client.completions.create(model="tiny", prompt="hello world", echo=True,
                                                 logprobs=1, max_tokens=4, temperature=0,
                                                 stream=True)
        async for ev in stream:
            parts.append(ev.choices[0])
        whole = await client.completions.create(model="tiny", prompt="hello world", echo=True,
                                                logprobs=1, max_tokens=4, temperature=0)
        plain = await client.completions.create(model="tiny", prompt="hello world", echo=True,
                                                max_tokens=4, temperature=0, n=2)
        return parts, whole, plain

    parts, whole, plain = run_client(app, fn)
    assert "".join(p.text for p in parts) == whole.choices[0].text
    assert parts[0].text.startswith("hello world")
    tokens = [t for p in parts for t in p.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert sum(p.logprobs.token_logprobs.count(None) for p in parts) == 1
    for ch in plain.choices:  # echo without logprobs: each choice starts with the prompt
        assert ch.text.startswith("hello world") and ch.logprobs is None


def test_tokenize_detokenize_and_tokenizer_info(app, tiny):
    async def fn(client, http):
        t = await http.post("/tokenize", json={"model": "tiny", "prompt": "hello world"})
        ids = t.json()["tokens"]
        d = await http.post("/detokenize", json={"tokens": ids})
        chat = await http.post("/tokenize", json={"messages": [
            {"role": "user", "content": "hi"}]})
        info = await http.get("/tokenizer_info")
        bad = [await http.post("/tokenize", json=b) for b in (
            {}, {"prompt": "a", "messages": [{"role": "user", "content": "x"}]},
            {"prompt": 5}, {"prompt": "a", "model": "other"})]
        bad += [await http.post("/detokenize", json=b) for b in (
            {"tokens": [10**6]}, {"tokens": [-1]}, {"tokens": "abc"})]
        return t.json(), d.json(), chat.json(), info.json(), bad

    tok, detok, chat, info, bad = run_client(app, fn)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    assert detok["prompt"] == "hello world"
    assert chat["count"] > tok["count"]  # the template's turn markers
    assert "eos_token" in info and info["chat_template"]
    for r, status, param in zip(bad, (400, 400, 400, 404, 400, 400, 400),
                                ("prompt", "prompt", "prompt", "model", "tokens", "tokens.0",
                                 "tokens")):
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_max_tokens_zero_needs_echo(app):
    async def fn(client, http):
        return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})

    r = run_client(app, fn)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    json.dumps(r.json())


def test_a_batch_of_prompts_is_one_request_with_a_choice_per_prompt_and_n(app, tiny):
    """lm-eval's batch_size > 1 sends a list of prompts: prompt k's completion i is choice
    k * n + i, each scored and generated as it is alone."""
    prompts = ["hello world", "true false null", "[1, 2, 3.5] hello"]

    async def fn(client, http):
        batch = await client.completions.create(model="tiny", prompt=prompts, echo=True,
                                                logprobs=1, max_tokens=3, temperature=0, n=2)
        alone = [await client.completions.create(model="tiny", prompt=p, echo=True,
                                                 logprobs=1, max_tokens=3, temperature=0)
                 for p in prompts]
        events = []
        stream = await client.completions.create(model="tiny", prompt=prompts, max_tokens=3,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        async for ev in stream:
            events.append(ev)
        bad = await http.post("/v1/completions", json={"prompt": ["ok", ""], "max_tokens": 2})
        too_many = await http.post("/v1/completions", json={"prompt": ["a"] * 65, "n": 2})
        return batch, alone, events, bad, too_many

    batch, alone, events, bad, too_many = run_client(app, fn)
    assert [c.index for c in batch.choices] == list(range(6))
    for k, one in enumerate(alone):
        for c in batch.choices[2 * k:2 * k + 2]:
            assert c.text == one.choices[0].text and c.text.startswith(prompts[k])
            lps, want = c.logprobs.token_logprobs, one.choices[0].logprobs.token_logprobs
            assert lps[0] is None and lps[1:] == pytest.approx(want[1:], abs=1e-5)
    assert batch.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in alone)
    texts = {}
    for ev in events:
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[k] for k in range(3)] == [o.choices[0].text[len(p):]
                                            for o, p in zip(alone, prompts)]
    assert events[-1].usage.completion_tokens == 9
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
