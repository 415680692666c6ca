"""swaserve as a Ray Serve application: engine replicas behind one ingress.

    client ─HTTP─▶ Ray Serve proxy ─▶ Ingress ─handle(prefix=blocks)─▶ EngineReplica × N
                                      (auth, body limit,   (router.py picks the replica)
                                       prefix blocks)

Each `EngineReplica` owns one engine, its thread and the swaserve app (server/factory.py) and
answers forwarded requests through that app (forward.py), so every route, error and limit
is `swaserve serve`'s. Ray Serve places the replicas (their CPUs and GPUs come from the
engine options), restarts one whose process dies or whose health check fails (the health
check is the engine thread's), and streams the answer back. The ingress turns a replica that
died under a request into an OpenAI-style 503, or in a stream an error event and `[DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from swaserve.config import EngineConfig
from swaserve.distributed.workers import usable_cores
from swaserve.ray.forward import ForwardedRequest, ResponseStart, call_asgi
from swaserve.ray.routing import request_blocks
from swaserve.server.app import error_shape
from swaserve.server.errors import error_body, error_response
from swaserve.server.factory import ServerOptions, build_server
from swaserve.server.guard import Guard, add_cors

log = logging.getLogger("swaserve")
ROUTERS = {"prefix": "swaserve.ray.router:PrefixAffinityRouter",
           "round-robin": "swaserve.ray.router:RoundRobinRouter"}
REPLICA_HEADER = b"x-swaserve-replica"
_MAX_ONGOING = 4096  # the engine's own admission (--max-waiting) is the limit that answers
_HEALTH_PERIOD_S = 5.0
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def replica_config(config: EngineConfig, num_cpus: float, node_cpus: int) -> EngineConfig:
    """The engine config a replica runs: its torch threads are the CPUs it reserved, and a
    `mem_fraction` of free memory on a CPU is its share of the node's (replicas on one
    machine would otherwise each plan for all of it)."""
    changes = {}
    if config.num_threads is None:
        changes["num_threads"] = max(1, int(num_cpus))
    if config.mem_fraction is not None and config.device == "cpu" and node_cpus > 0:
        changes["mem_fraction"] = config.mem_fraction * min(1.0, num_cpus / node_cpus)
    return dataclasses.replace(config, **changes)


class EngineReplica:
    def __init__(self, config: EngineConfig, options: ServerOptions, num_cpus: float):
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.server = build_server(replica_config(config, num_cpus, usable_cores()), options)
        log.info("replica %s: %s", self.replica_id, self.server.aengine.engine.plan.describe())

    async def handle(self, req: ForwardedRequest, prefix: list[int] | None = None
                     ) -> AsyncIterator[ResponseStart | bytes]:
        """One forwarded request's answer (`prefix` is the router's, unused here)."""
        async for part in call_asgi(self.server.app, req,
                                    [(REPLICA_HEADER, self.replica_id.encode())]):
            yield part

    def check_health(self) -> None:
        aengine = self.server.aengine
        if not aengine.alive:
            raise RuntimeError(f"the engine stopped: {aengine.dead or 'its thread ended'}")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.aengine.shutdown()


@serve.ingress()
class Ingress:
    def __init__(self, engines: DeploymentHandle, options: ServerOptions):
        self.engines = engines.options(stream=True)
        self.options = options

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.api_route("/{path:path}", methods=_METHODS)
        async def forward(path: str, request: Request):
            return await self.forward(request)

        o = self.options
        app.add_middleware(Guard, api_key=o.api_key, max_body_bytes=o.max_request_bytes,
                           public_paths=o.public_paths, shape=error_shape)
        add_cors(app, o.allowed_origins)  # the ingress's own refusals carry CORS headers too
        return app

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        req = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                               list(request.scope["headers"]), body)
        answer = self.engines.handle.remote(req, prefix=request_blocks(path, body))
        try:
            start = await answer.__anext__()
        except RayError as e:
            answer.cancel()
            return _replica_failed(e)
        if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
            response = StreamingResponse(_relay(answer), status_code=start.status)
        else:
            chunks = []
            try:
                async for chunk in answer:
                    chunks.append(chunk)
            except RayError as e:
                return _replica_failed(e)
            finally:
                answer.cancel()
            response = Response(b"".join(chunks), status_code=start.status)
        response.raw_headers = [(k, v) for k, v in start.headers
                                if k.lower() != b"transfer-encoding"]
        return response


async def _relay(answer) -> AsyncIterator[bytes]:
    """A stream's chunks as the replica sent them; if the replica dies, an error event and
    `[DONE]`, as a request failing inside one engine ends."""
    try:
        async for chunk in answer:
            yield chunk
    except RayError as e:
        log.warning("a replica died under a stream: %s", type(e).__name__)
        event = error_body(_died_message(e), "server_error", None, "replica_failed")
        yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
    finally:  # the client left, or the stream ended: either way the replica may stop
        answer.cancel()


def _died_message(e: RayError) -> str:
    return (f"the replica serving this request failed ({type(e).__name__}); the request "
            f"did not finish: retry it")


def _replica_failed(e: RayError) -> Response:
    log.warning("a replica failed a request: %s", type(e).__name__)
    return error_response(503, _died_message(e), None, "server_error", "replica_failed",
                          headers={"Retry-After": "1"})


def build_app(config: EngineConfig, options: ServerOptions | None = None,
              num_replicas: int = 2, routing: str = "prefix", replica_cpus: float = 1.0,
              name: str = "swaserve"):
    """The Ray Serve application: `serve.run(build_app(config, num_replicas=2))`."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas: must be >= 1, got {num_replicas}")
    if routing not in ROUTERS:
        raise ValueError(f"routing: expected one of {sorted(ROUTERS)}, got {routing!r}")
    if not replica_cpus > 0:
        raise ValueError(f"replica_cpus: must be positive, got {replica_cpus}")
    options = options or ServerOptions()
    num_gpus = 1 if str(config.device).startswith("cuda") else 0
    engines = serve.deployment(
        EngineReplica, name=f"{name}-engine", num_replicas=num_replicas,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=_MAX_ONGOING, health_check_period_s=_HEALTH_PERIOD_S,
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[routing]),
    ).bind(config, options, replica_cpus)
    ingress = serve.deployment(Ingress, name=f"{name}-ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=_MAX_ONGOING)
    return ingress.bind(engines, options)
