"""The MLX array backend (`device="mlx"`): the model's forward and the KV data in MLX,
for Apple silicon (and MLX's CPU build on Linux). The scheduler, the KV bookkeeping,
the prefix cache and the server are the torch path's, unchanged (see docs/architecture.md)."""

from __future__ import annotations


def require():
    """The `mlx.core` module, or a clear error naming what to install."""
    try:
        import mlx.core as mx
    except ImportError as e:
        raise RuntimeError("device: mlx needs the mlx package (`pip install mlx` on Apple "
                           "silicon, `pip install \"mlx[cpu]\"` on Linux); it could not be "
                           f"imported: {e}") from e
    return mx


def available() -> bool:
    try:
        require()
    except RuntimeError:
        return False
    return True
