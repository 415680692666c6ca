"""Starting the Ray Serve application for `swaserve serve --data-parallel-size N` (a local
Ray instance on this machine, or `--ray-address` to join a cluster); `serve run
swaserve.cli.serve:ray_app key=value ...` (Ray's own CLI) builds the same application from
`swaserve serve`'s flags in cli/serve.py."""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager

from swaserve.config import EngineConfig
from swaserve.distributed.workers import usable_cores
from swaserve.server.factory import ServerOptions

log = logging.getLogger("swaserve")
APP_NAME = "swaserve"


def default_replica_cpus(config: EngineConfig, num_replicas: int) -> float:
    """CPUs a replica reserves: --num-threads if given, else the cluster's CPUs shared among
    the replicas, at most one node's (1 before Ray is up)."""
    if config.num_threads is not None:
        return float(config.num_threads)
    import ray

    if not ray.is_initialized():
        return 1.0
    per_node = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    total = sum(per_node)
    return float(max(1, int(min(total / num_replicas, max(per_node, default=1.0)))))


def serve_on_ray(config: EngineConfig, options: ServerOptions, host: str, port: int,
                 num_replicas: int, address: str | None = None, routing: str = "prefix",
                 replica_cpus: float | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the replicas are shut down (each drains its engine)."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise RuntimeError("replicas run on Ray Serve: pip install 'ray[serve]'") from e
    from swaserve.ray.app import build_app

    t0 = time.monotonic()
    if address is None:  # one machine: a private Ray instance with all its cores
        ray.init(num_cpus=usable_cores(), include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    # after ray.init, whose own handler would kill the process on SIGTERM; a signal during
    # the start (the proxy may answer before serve.run returns) stops it as cleanly
    with _stop_signals() as stop:
        try:
            cpus = replica_cpus or default_replica_cpus(config, num_replicas)
            serve.start(http_options={"host": host, "port": port})
            serve.run(build_app(config, options, num_replicas, routing, cpus), name=APP_NAME,
                      route_prefix="/")
            log.info("serving on http://%s:%d: %d replicas of %.3g CPUs, %s routing, up in "
                     "%.1f s", host, port, num_replicas, cpus, routing, time.monotonic() - t0)
            while not stop:
                time.sleep(0.2)
            log.info("shutting down the replicas")
            # bounded: a supervisor that signals the whole process group has stopped Ray too
            stopper = threading.Thread(target=serve.shutdown, name="swaserve-ray-stop",
                                       daemon=True)
            stopper.start()
            stopper.join(options.shutdown_timeout + 15)
            if stopper.is_alive():
                log.warning("the replicas did not stop within %.0f s",
                            options.shutdown_timeout + 15)
        finally:
            ray.shutdown()
    return 0


@contextmanager
def _stop_signals():
    """A list that SIGINT and SIGTERM append to (a handler must take no lock: a second
    signal arriving inside the first's would deadlock on it)."""
    stop: list[int] = []
    old = {s: signal.signal(s, lambda sig, _: stop.append(sig))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)

