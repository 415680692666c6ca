"""Two engine replicas of the bundled model on a local Ray cluster started here (2 CPUs, no
dashboard), through Ray Serve's HTTP proxy and the official openai client: completions and
streams, the ingress's auth and errors, prefix-affinity routing (a second request sharing
a 1,000-token prefix is served from the cache of the replica that holds it), and a replica
killed mid-stream (its stream ends with an error event, later requests are served, Ray
brings the replica back). `swaserve serve --data-parallel-size 2` is the same application
started by the CLI: its start, answer and clean SIGTERM are checked too."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

KEY = "dp-test-key"
NAMES, ORIGIN = ("dp-model", "dp-alias"), "https://app.example.com"
APP = "swaserve"
ENGINE = f"{APP}-engine"
WORDS = ("river stone cloud paper garden window music field light harbor forest engine "
         "letter market bridge winter silver yellow morning quiet").split()


@pytest.fixture(scope="module")
def base():
    from swaserve.config import EngineConfig
    from swaserve.ray.app import build_app
    from swaserve.server.factory import ServerOptions

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(kv_memory="256MiB", max_model_len=4096)
        options = ServerOptions(api_key=KEY, served_model_name=NAMES, allowed_origins=(ORIGIN,))
        serve.run(build_app(config, options, num_replicas=2, replica_cpus=1), name=APP,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        if ray.is_initialized():  # the CLI test ends this cluster before it starts its own
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _model(client) -> str:
    return client.models.list().data[0].id


def _text(n_words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n_words))


def test_completions_streams_and_errors_through_the_replicas(base, client):
    model = _model(client)
    a = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    b = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text  # either replica
    assert a.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own validation
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi"},  # the ingress's guard
                   headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_served_names_and_cors_through_the_ingress(base, client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    a = client.completions.create(model=NAMES[1], prompt="Hi", max_tokens=2)
    assert a.model == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)
    r = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(base + "/v1/models", headers={"Origin": ORIGIN,
                                                "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_a_shared_prefix_is_served_from_the_replica_that_holds_it(client):
    model = _model(client)
    for seed in range(3):  # 3 prefixes: by chance alone all 3 would pair up 1 time in 8
        prefix = _text(1000, seed)
        first = client.completions.with_raw_response.create(
            model=model, prompt=prefix + " First question:", max_tokens=2, temperature=0)
        other = client.completions.create(model=model, prompt=_text(300, 100 + seed),
                                          max_tokens=2)
        second = client.completions.with_raw_response.create(
            model=model, prompt=prefix + " Second question:", max_tokens=2, temperature=0)
        usage = second.parse().usage
        assert usage.prompt_tokens >= 1000
        assert usage.prompt_tokens_details.cached_tokens >= 900, (seed, usage)
        assert second.headers["x-swaserve-replica"] == first.headers["x-swaserve-replica"]
        assert other.choices[0].text is not None


def _replica_ids() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#{ENGINE}#")}


def test_a_killed_replica_fails_its_requests_only_and_comes_back(base, client):
    before = _replica_ids()
    assert len(before) == 2
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    events, t0 = [], time.monotonic()
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        victim = r.headers["x-swaserve-replica"]
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 5:
                ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    assert time.monotonic() - t0 < 60
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    assert len(events) < 200  # it ended when the replica died, not after 2,000 tokens
    model = _model(client)
    for _ in range(3):  # the survivor serves at once
        done = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert done.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = serve.status().applications[APP].deployments[ENGINE]
        if status.replica_states.get("RUNNING", 0) == 2 and len(_replica_ids() - before) == 1:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the replica did not come back: {status}")
    assert victim not in _replica_ids()
    (replacement,) = _replica_ids() - before
    deadline = time.monotonic() + 60  # once the ingress's router hears of it, it serves
    while time.monotonic() < deadline:
        r = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=2)
        if r.headers["x-swaserve-replica"] == replacement:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the replacement replica was never sent a request")


def test_the_cli_starts_replicas_and_stops_on_sigterm(base, tmp_path):
    """After the fixture's cluster: `swaserve serve --data-parallel-size 2` starts its own
    local Ray instance, answers, and exits 0 on SIGTERM."""
    serve.shutdown()
    ray.shutdown()
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # Ray's logs would fill a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", "--port", str(port),
                             "--data-parallel-size", "2", "--kv-memory", "128MiB",
                             "--max-model-len", "2048"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "SWASERVE_NO_PROGRESS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                               timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert r.status_code == 200 and r.headers["x-swaserve-replica"]
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        log.seek(0)
        out = log.read()
    assert proc.returncode == 0, out[-3000:]
    assert "2 replicas" in out
