"""swaserve on Ray Serve: engine replicas behind one endpoint with prefix-affinity routing
(app.py, router.py, routing.py). `build_app(config, num_replicas=N)` for `serve.run`;
`app` is the builder for `serve run swaserve.ray:app key=value ...`. Needs `ray[serve]`,
imported only when one of them is used."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        from swaserve.ray.launch import app

        return app
    if name == "build_app":
        from swaserve.ray.app import build_app

        return build_app
    raise AttributeError(f"module 'swaserve.ray' has no attribute {name!r}")
