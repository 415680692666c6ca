"""/v1/embeddings through the official client, in process: float and base64 vectors equal
SentenceTransformer.encode, `dimensions` shortens and renormalizes them, usage counts the
prompt tokens, bad bodies are 400s naming their field; on a decoder model, a completion
beside embedding requests gets the tokens it gets alone and the cache is whole after."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from tests.conftest import inprocess_served, run_client
from tests.helpers.embeddings import write_embedding_gemma

TOL = 1e-5
TEXTS = ["hello world", "abc " * 12, '{"name": "abc", "age": 12}']


@pytest.fixture(scope="module")
def gemma_embed(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedding_gemma_server")
    write_embedding_gemma(path, seed=1)
    return str(path)


@pytest.fixture(scope="module")
def served(gemma_embed):
    yield from inprocess_served(gemma_embed, kv_memory="16MiB", max_model_len=128)


@pytest.fixture(scope="module")
def reference(gemma_embed):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(gemma_embed, device="cpu").encode(TEXTS)


def test_client_float_base64_dimensions(served, reference):
    app, aeng = served

    async def go(client, http):
        plain = await client.embeddings.create(model="tiny", input=TEXTS,
                                               encoding_format="float")
        packed = await client.embeddings.create(model="tiny", input=TEXTS)  # base64
        short = await client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=8)
        ids = aeng.engine.tokenize(TEXTS[0])
        by_ids = await client.embeddings.create(model="tiny", input=[ids, ids],
                                                encoding_format="float")
        raw = (await http.post("/v1/embeddings", json={"input": TEXTS[0],
                                                       "encoding_format": "base64"})).json()
        return plain, packed, short, by_ids, raw, ids

    plain, packed, short, by_ids, raw, ids = run_client(app, go)
    assert plain.model == "tiny" and [d.index for d in plain.data] == [0, 1, 2]
    tokens = sum(len(aeng.engine.tokenize(t)) for t in TEXTS)
    assert plain.usage.prompt_tokens == plain.usage.total_tokens == tokens
    for resp in (plain, packed):
        got = np.array([d.embedding for d in resp.data])
        assert got.shape == (3, 32) and np.abs(got - reference).max() < TOL
    want = reference[1][:8] / np.linalg.norm(reference[1][:8])
    assert len(short.data[0].embedding) == 8
    assert np.abs(np.array(short.data[0].embedding) - want).max() < TOL
    assert by_ids.usage.prompt_tokens == 2 * len(ids)
    assert np.abs(np.array(by_ids.data[1].embedding) - reference[0]).max() < TOL
    item = raw["data"][0]
    assert raw["object"] == "list" and item["object"] == "embedding"
    import base64

    vec = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert np.abs(vec - reference[0]).max() < TOL
    aeng.engine.check_integrity()
    assert aeng.engine.cache.is_fully_free()


BAD = [  # (body, param named in the 400)
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": [5] * 129}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": -3}, "dimensions"),
    ({"input": "hi", "dimensions": 33}, "dimensions"),
    ({"input": "hi", "dimensions": "8"}, "dimensions"),
]


def test_bad_bodies_name_their_field(served):
    app, aeng = served

    async def go(client, http):
        return [(await http.post("/v1/embeddings", json=body)) for body, _ in BAD]

    for (body, param), r in zip(BAD, run_client(app, go)):
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())

    async def completion(client, http):
        return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    r = run_client(app, completion)  # an embedding model does not generate
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert aeng.engine.cache.is_fully_free()


def test_request_timeout_ends_an_embedding(served):
    """An embedding request past --request-timeout is a 504 and its prompts leave the
    queue; the next request is served."""
    import openai

    app, aeng = served
    aeng.request_timeout = 1e-6  # past before the engine thread first looks at it
    try:
        async def late(client, http):
            with pytest.raises(openai.APIStatusError) as err:
                await client.embeddings.create(model="tiny", input=TEXTS)
            return err.value

        err = run_client(app, late)
    finally:
        aeng.request_timeout = None
    assert err.status_code == 504 and err.body["code"] == "request_timeout"
    assert not aeng.engine.embedder.has_work()

    async def again(client, http):
        return await client.embeddings.create(model="tiny", input=TEXTS[0])

    assert len(run_client(app, again).data) == 1


def test_client_that_leaves_drops_its_prompts(served, monkeypatch):
    """A client that disconnects while its prompts wait drops those not yet run: the
    embedder runs the slice it had started and no other."""
    app, aeng = served
    embedder = aeng.engine.embedder
    real_step = embedder.step
    entered, go, slices = threading.Event(), threading.Event(), []

    def gated_step():
        if not slices:  # hold the first slice until the client has gone
            entered.set()
            go.wait(30)
        slices.append(real_step())
        return slices[-1]

    monkeypatch.setattr(embedder, "step", gated_step)
    monkeypatch.setattr(embedder, "budget", 8)  # one 5-token prompt per slice
    body = json.dumps({"model": "tiny", "input": [[5] * 5] * 4}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/embeddings",
             "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}

    async def call() -> list[dict]:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.to_thread(entered.wait, 30)  # the engine holds the prompts
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent

    sent = asyncio.run(call())
    go.set()
    deadline = time.monotonic() + 30
    while embedder.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a slice that should not run would run now
    assert sent[0]["status"] == 499
    assert not embedder.has_work() and len(slices) == 1 and slices[0] == []
    aeng.engine.check_integrity()


@pytest.fixture(scope="module")
def decoder(tiny_with_tokenizer):
    yield from inprocess_served(tiny_with_tokenizer, chunk_size=16)


def test_generation_beside_embeddings(decoder):
    """A decoder model embeds by its last token; a completion running beside embedding
    requests gets exactly its tokens alone; `dimensions` is refused (no Matryoshka)."""
    app, aeng = decoder
    body = {"prompt": "hello world " * 6, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}

    async def go(client, http):
        alone = (await http.post("/v1/completions", json=body)).json()
        embeds = [http.post("/v1/embeddings", json={"input": TEXTS * 4,
                                                    "encoding_format": "float"})
                  for _ in range(4)]
        both = await asyncio.gather(http.post("/v1/completions", json=body), *embeds)
        refused = await http.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
        return alone, [r.json() for r in both], refused

    alone, (beside, *embedded), refused = run_client(app, go)
    assert beside["choices"][0]["text"] == alone["choices"][0]["text"]
    for key in ("prompt_tokens", "completion_tokens"):  # the second hits the prefix cache
        assert beside["usage"][key] == alone["usage"][key]
    first = np.array([d["embedding"] for d in embedded[0]["data"]])
    assert first.shape[0] == 12
    for e in embedded[1:]:  # sliced differently beside the completion: round-off apart
        assert np.abs(np.array([d["embedding"] for d in e["data"]]) - first).max() < TOL
    assert abs(np.linalg.norm(first[0]) - 1) < TOL
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    aeng.engine.check_integrity()


def test_live_server_embeds(gemma_embed, reference):
    """`swaserve serve` of the embedding model (its pooling named by --pooling) answers the
    official client as SentenceTransformer.encode does."""
    import openai

    from tests.conftest import start_server, stop_server

    base, proc = start_server("--model", gemma_embed, "--dtype", "float32",
                              "--kv-memory", "16MiB", "--pooling", "mean")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        got = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
        assert np.abs(np.array([d.embedding for d in got.data]) - reference).max() < TOL
    finally:
        stop_server(proc)
