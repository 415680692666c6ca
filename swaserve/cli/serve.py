"""`swaserve serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import uvicorn

from swaserve.chat.registry import REASONING_PARSERS, TOOL_PARSERS
from swaserve.chat.template import ChatTemplate
from swaserve.cli.args import add_engine_args, add_model_arg, engine_config
from swaserve.server.app import DEFAULT_MAX_REQUEST_BYTES
from swaserve.server.factory import ServerOptions

log = logging.getLogger("swaserve")


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop accepting (new requests get 503), let running requests
    finish for up to `shutdown_timeout` seconds, then end each one left with an error event
    (and `[DONE]`), so that uvicorn never has to cut a body. uvicorn re-raises the signal
    after its graceful shutdown, so the process would die of it; a clean, drained shutdown
    is exit status 0."""

    def __init__(self, config: uvicorn.Config, aengine, shutdown_timeout: float):
        super().__init__(config)
        self.aengine = aengine
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if not self.aengine.draining:
            self.aengine.draining = True
            threading.Thread(target=self._drain, name="swaserve-drain", daemon=True).start()
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.aengine.num_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.aengine.num_streams:
            log.info("shutting down: ending %d unfinished requests", self.aengine.num_streams)
            self.aengine.fail_streams("the server is shutting down: this request did not "
                                      f"finish within --shutdown-timeout "
                                      f"({self.shutdown_timeout:g} s)")

    @contextmanager
    def capture_signals(self):
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SWASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's ids: requests may name any of them, answers report the "
                        "first (default: the hub id or the model's file name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="accepted requests not running yet beyond which new ones get 503 + "
                        "Retry-After")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which an unfinished request ends with an error "
                        "(default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds running requests get to finish before they are "
                        "ended with an error event")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (413 beyond)")
    p.add_argument("--public-path", action="append", default=[],
                   help="with --api-key, a path served without the key (e.g. /metrics); "
                        "repeatable. /health is always open")
    p.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                   help="CORS: browser origins allowed to call the API (e.g. "
                        "https://app.example.com, or *); repeatable or comma-separated. "
                        "Default: none (no CORS)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (Jinja) to use instead of the model's own: a file's "
                        "path, or the template's text")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   metavar="JSON", help="template variables every chat gets unless its "
                   "request's chat_template_kwargs set them, e.g. '{\"enable_thinking\": "
                   "false}'")
    p.add_argument("--reasoning-parser", default="auto",
                   choices=["auto", "none", *REASONING_PARSERS],
                   help="how the model's reasoning is told from its answer "
                        "(message.reasoning_content); auto: from the chat template")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS],
                   help="the syntax the model writes tool calls in; auto: from the chat "
                        "template (json: bare JSON objects, fenced or in <tool_call>)")
    g = p.add_argument_group("replicas (Ray Serve: pip install 'ray[serve]')")
    g.add_argument("--data-parallel-size", "--replicas", dest="data_parallel_size", type=int,
                   default=1, help="engine replicas behind the one port, each a Ray Serve "
                   "replica with its own engine; above 1 without --ray-address a local Ray "
                   "instance is started on this machine")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'head:6379') and place the "
                        "replicas on its nodes")
    g.add_argument("--routing", choices=("prefix", "round-robin"), default="prefix",
                   help="how requests pick a replica: the one that most likely holds the "
                        "prompt's prefix, unless it is much busier (default), or in turn")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs each replica reserves (default: --num-threads, else the "
                        "cluster's CPUs shared among the replicas); its torch threads follow")
    add_engine_args(p)
    p.set_defaults(func=run)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: an existing file's text, else the value itself (as vLLM reads it);
    checked to compile before the model loads."""
    if value is None:
        return None
    try:
        is_file = os.path.isfile(value)
    except (OSError, ValueError):  # too long or odd to be a path: a template's text
        is_file = False
    text = open(value, encoding="utf-8").read() if is_file else value
    ChatTemplate(text)
    return text


def server_options(args: argparse.Namespace) -> ServerOptions:
    origins = tuple(o.strip() for given in args.allowed_origins for o in given.split(",")
                    if o.strip())
    return ServerOptions(api_key=args.api_key,
                         served_model_name=tuple(args.served_model_name or ()),
                         max_waiting=args.max_waiting, request_timeout=args.request_timeout,
                         shutdown_timeout=args.shutdown_timeout,
                         max_request_bytes=args.max_request_bytes,
                         public_paths=frozenset(args.public_path),
                         chat_template=read_chat_template(args.chat_template),
                         default_chat_template_kwargs=args.default_chat_template_kwargs,
                         reasoning_parser=args.reasoning_parser,
                         tool_call_parser=args.tool_call_parser, allowed_origins=origins)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("swaserve").setLevel(logging.INFO)
    options = server_options(args)
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size: must be >= 1, got {args.data_parallel_size}")
    config = engine_config(args)
    if config.tensor_parallel_size > 1:
        from swaserve.distributed.workers import config_placement, run_compute_node

        if config_placement(config).rank != 0:  # another machine's ranks: compute only
            return run_compute_node(config)
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from swaserve.ray.launch import serve_on_ray

        return serve_on_ray(config, options, host=args.host, port=args.port,
                            num_replicas=args.data_parallel_size, address=args.ray_address,
                            routing=args.routing, replica_cpus=args.replica_cpus)
    from swaserve.server.factory import build_server

    server = build_server(config, options)
    aengine, app, name = server.aengine, server.app, server.model_name
    exit_code = 0

    @asynccontextmanager
    async def lifespan(_app):
        log.info("serving %s on http://%s:%d", name, args.host, args.port)
        yield
        aengine.shutdown()  # aborts what is still running, then stops the engine thread

    app.router.lifespan_context = lifespan
    # uvicorn's own limit is only a backstop: the drain above ends every stream first
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=options.shutdown_timeout + 5)
    uv = GracefulServer(config, aengine, options.shutdown_timeout)
    tp = aengine.engine.tp
    if tp is not None:  # a lost rank: unhealthy at once, then exit for the supervisor

        def broken(why: str) -> None:
            nonlocal exit_code
            exit_code = 1
            aengine.dead = aengine.dead or why
            aengine.fail_streams(f"the engine stopped: {why}")
            uv.should_exit = True

        tp.on_broken.append(broken)
    uv.run()
    return exit_code


def ray_app(args: dict[str, str]):
    """The application builder for `serve run swaserve.cli.serve:ray_app model=PATH
    data_parallel_size=2 routing=prefix ...`: keys are `swaserve serve`'s flags (with
    underscores), values as on its command line ("true"/"false" for switches)."""
    from swaserve.ray.app import build_app
    from swaserve.ray.launch import APP_NAME, default_replica_cpus

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() in ("true", "false"):
            argv.append(flag if str(value).lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="swaserve")  # `serve` alone: cli/__init__ imports us
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    config = engine_config(ns)
    return build_app(config, server_options(ns), ns.data_parallel_size, ns.routing,
                     ns.replica_cpus or default_replica_cpus(config, ns.data_parallel_size),
                     name=APP_NAME)
