"""swaserve on Ray Serve: engine replicas behind one endpoint with prefix-affinity routing
(app.py, router.py, routing.py). `build_app(config, num_replicas=N)` for `serve.run`; the
builder for Ray's own CLI, `serve run swaserve.cli.serve:ray_app key=value ...`, is the
command line's (cli/serve.py). Needs `ray[serve]`, imported only when `build_app` is used."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "build_app":
        from swaserve.ray.app import build_app

        return build_app
    raise AttributeError(f"module 'swaserve.ray' has no attribute {name!r}")
