"""Schema-driven fuzzing: schemathesis generates bodies from the app's own OpenAPI schema
(valid ones and ones that break it) for every POST route and sends them to the app in
process. Nothing may answer 5xx, and every error is in its surface's shape (OpenAI's, or
Anthropic's on /v1/messages). Bounded: a fixed number of examples per route, on a tiny
model with a short context, on the torch backend and on the MLX one (its sampler and lazy
step take every sampling parameter too)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from swaserve.mlx import available as mlx_available
from tests.conftest import TEST_DEVICE

EXAMPLES = 60


@pytest.fixture(scope="module", params=[TEST_DEVICE, pytest.param("mlx", marks=[
    pytest.mark.skipif(not mlx_available(),
                       reason="mlx is not installed (pip install \"mlx[cpu]\" on Linux)"),
    pytest.mark.cpu_only])])
def api_schema(request, tiny_with_tokenizer):
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=tiny_with_tokenizer, dtype="float32", device=request.param, kv_memory="16MiB",
                 max_running_requests=16, max_model_len=96, page_size=4, chunk_size=64)
    aeng = AsyncEngine(eng, max_waiting=64)
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(aeng, "tiny"))
    yield schema
    aeng.shutdown()
    eng.check_integrity()
    assert eng.cache.is_fully_free() and not eng.has_unfinished()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(method="POST").parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_body_gets_a_5xx(case):
    r = case.call(timeout=60)
    assert r.status_code < 500, (case.body, r.text[:500])
    anthropic = case.path.startswith("/v1/messages")  # its own error shape
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ({"message", "type"} if anthropic
                            else {"message", "type", "param", "code"}), err
        assert isinstance(err["message"], str) and err["message"]
    elif case.path == "/tokenize":
        assert isinstance(r.json()["tokens"], list)
    elif case.path == "/detokenize":
        assert isinstance(r.json()["prompt"], str)
    elif case.path == "/v1/embeddings":
        assert r.json()["data"]
    elif case.path == "/v1/messages/count_tokens":
        assert r.json()["input_tokens"] > 0
    elif isinstance(case.body, dict) and case.body.get("stream") is True:
        pass
    elif case.path == "/v1/responses":
        assert r.json()["object"] == "response" and r.json()["status"] != "failed"
    else:
        assert r.json()["content" if anthropic else "choices"] is not None
