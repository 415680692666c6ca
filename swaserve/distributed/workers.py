"""Tensor parallelism on one machine: rank 0 (the engine's process) spawns ranks 1..N-1,
each of which loads its shard of the model, builds its shard of every KV structure from
rank 0's plan (the same rows, pages and slots: one set of indices serves all ranks), and
then runs whatever forward rank 0 broadcasts, until told to stop.

Rank 0 watches its workers: one that exits breaks the group (`TPGroup.broken`), the
engine's next collective raises `GroupBroken` instead of waiting, and `on_broken`
callbacks run at once (the server uses one to report unhealthy and exit non-zero).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from swaserve.config import TORCH_DTYPES, EngineConfig
from swaserve.distributed.group import Placement, TPGroup, placement
from swaserve.models.context import ForwardContext

log = logging.getLogger("swaserve")
_JOIN_S = 10.0  # how long a stopped worker gets to exit before it is terminated
_WATCH_S = 0.2


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads, else the cores this process may run on (a container's cpuset, not the
    host's count) shared among the ranks."""
    if config.num_threads:
        return config.num_threads
    return max(1, usable_cores() // config.tensor_parallel_size)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    if str(config.device).startswith("cuda"):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device(config.device)


def backend(config: EngineConfig) -> str:
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


class TensorParallel:
    """Rank 0's side of the group: the workers, the step broadcast, the watch."""

    def __init__(self, config: EngineConfig, vocab_size: int):
        self.size = config.tensor_parallel_size
        where = config_placement(config)
        if where.rank != 0:
            raise ValueError(f"node_rank: this process is rank {where.rank}: only rank 0 runs "
                             f"the engine (the others run `swaserve serve` with the same "
                             f"flags, which only computes there)")
        self.procs = start_ranks(config, where)
        self.group = TPGroup.join(0, self.size, where.address, where.port, vocab_size,
                                  backend(config))
        self.on_broken: list[Callable[[str], None]] = []
        self._closed = False
        threading.Thread(target=self._watch, name="swaserve-tp-watch", daemon=True).start()

    def init_cache(self, plan, max_model_len: int, prefix_cache: bool) -> None:
        self.group.broadcast(("cache", plan, max_model_len, prefix_cache))

    def step(self, ctx: ForwardContext, copies: list) -> None:
        """Before rank 0's forward: every rank replays the KV copies, then runs ctx."""
        self.group.broadcast(("step", copies, ctx))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.group.broken is None:
            try:
                self.group.broadcast(("stop",))
            except RuntimeError:
                pass
        for p in self.procs:
            try:
                p.wait(_JOIN_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.group.close()

    def _watch(self) -> None:
        while not self._closed:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self._closed:
                    why = f"tensor-parallel rank {r} exited (code {p.returncode})"
                    log.error(why)
                    self.group.broken = self.group.broken or why
                    for fn in self.on_broken:
                        fn(why)
                    return
            time.sleep(_WATCH_S)


def config_placement(config: EngineConfig) -> Placement:
    return placement(config.tensor_parallel_size, config.nnodes, config.node_rank,
                     config.master_addr, config.master_port)


def start_ranks(config: EngineConfig, where: Placement) -> list[subprocess.Popen]:
    """The ranks this process starts, each a fresh interpreter (`python -m`), not
    multiprocessing's spawn, which would re-run the user's script in every worker unless
    it guards its main."""
    spec = json.dumps(dataclasses.asdict(config))
    return [subprocess.Popen([sys.executable, "-m", "swaserve.distributed.workers", str(r),
                              str(where.size), where.address, str(where.port), spec])
            for r in where.spawn]


def run_compute_node(config: EngineConfig) -> int:
    """A machine (or torchrun process) past rank 0: its ranks compute until rank 0 stops
    them; the exit status is non-zero if any of them failed."""
    where = config_placement(config)
    procs = start_ranks(config, where)
    code = 0
    try:
        worker_main(where.rank, where.size, config, where.address, where.port)
    except Exception as e:  # noqa: BLE001 - reported as the exit status, after the others
        log.error("tensor-parallel rank %d failed: %s", where.rank, e)
        code = 1
    for p in procs:
        code = max(code, p.wait())
    return code


def worker_main(rank: int, size: int, config: EngineConfig, address: str, port: int) -> None:
    """Rank `rank`: load the shard, build the KV shard from rank 0's plan, run the steps."""
    from swaserve.checkpoint.loading import load_model
    from swaserve.checkpoint.source import resolve_model
    from swaserve.memory.kv_cache import KVCache
    from swaserve.models.attention import SDPABackend

    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads_per_rank(config))
    cfg = resolve_model(config.model, config.revision).model_config()
    group = TPGroup.join(rank, size, address, port, cfg.vocab_size, backend(config))
    dtype, device = TORCH_DTYPES[config.dtype], rank_device(config, rank)
    model = load_model(config, dtype, device, group).model
    _, plan, max_model_len, prefix_cache = group.broadcast()
    cache = KVCache(model.cfg.cache_layout(), plan, max_model_len, dtype, device,
                    prefix_cache=prefix_cache)  # rank 0's plan: its KV format too
    model.attn = SDPABackend(cache)
    with torch.inference_mode():
        while True:
            msg = group.broadcast()
            if msg[0] == "stop":
                break
            cache.replay_copies(msg[1])
            model(msg[2])
    group.close()


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone (this process handed to init): nothing will ever send a step."""
    while os.getppid() == parent:
        time.sleep(_WATCH_S * 5)
    os._exit(1)


if __name__ == "__main__":  # python -m swaserve.distributed.workers RANK SIZE ADDR PORT CONFIG
    rank_, size_, address_, port_, spec_ = sys.argv[1:6]
    worker_main(int(rank_), int(size_), EngineConfig(**json.loads(spec_)), address_, int(port_))
