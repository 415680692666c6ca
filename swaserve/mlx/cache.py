"""The KV data of a KVCache, in MLX arrays: one K and one V array per layer of each pool
("full", "ring", "window_pages"), at the shapes and slot addresses of the torch pools
(memory/). The KVCache itself runs with its data on torch's meta device and logs every KV
move it makes outside a forward (forks, prefix hits: `copy_log`); `replay` applies them
here before the next forward."""

from __future__ import annotations

import numpy as np
import torch

from swaserve.memory.kv_cache import KVCache
from swaserve.mlx import require

MX_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_mx(t: torch.Tensor):
    """A torch CPU tensor as an MLX array (bf16 through float32: numpy has no bf16)."""
    mx = require()
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a) -> torch.Tensor:
    mx = require()
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return torch.from_numpy(np.array(a))


class MLXKV:
    def __init__(self, cache: KVCache, dtype: torch.dtype):
        mx = require()
        self.cache = cache
        cache.copy_log = []  # from here on every KV move outside a forward is logged
        self.dtype = getattr(mx, MX_DTYPES[dtype])
        self.pools: dict[str, tuple[list, list]] = {}
        self.reset()
        mx.eval(self.arrays())  # now, on this thread's stream: a forward may run on another

    def reset(self) -> None:
        """Zeroed K/V arrays, lazy (at start, and after a failed forward left them unusable:
        then on the forward's thread, which evaluates them with its next step)."""
        mx = require()
        cache = self.cache
        for name, pool in (("full", cache.full), ("ring", cache.window),
                           ("window_pages", cache.window_pages)):
            if pool is not None:
                self.pools[name] = ([mx.zeros(tuple(t.shape), dtype=self.dtype) for t in pool.k],
                                    [mx.zeros(tuple(t.shape), dtype=self.dtype) for t in pool.v])

    def replay(self) -> None:
        """The KVCache's logged copies since the last forward, in order."""
        for dst_pool, dst, src_pool, src in self.cache.take_copies():
            d, s = self.pools[dst_pool], self.pools[src_pool]
            di, si = to_mx(dst), to_mx(src)
            for dk, sk in zip(d, s):  # K list, then V list
                for i in range(len(dk)):
                    dk[i][di] = sk[i][si]

    def arrays(self) -> list:
        """Every K/V array (what a step's one `mx.eval` also evaluates)."""
        return [a for k, v in self.pools.values() for a in k + v]
