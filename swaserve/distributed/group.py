"""The tensor-parallel group: torch.distributed (gloo on CPUs, NCCL on GPUs) and the few
collectives the model and the engine use.

Rank 0 owns the scheduler, the sampler and the server; every step it broadcasts what the
step does (the KV copies since the last step and the ForwardContext) and every rank runs
its shard of the forward. Layers all-reduce after their row-parallel products; the LM
head's vocabulary shards are gathered on rank 0 only, where the sampler runs (the sampler
needs every logit: top-p, min-p, penalties and logprobs are over the whole vocabulary).

A rank that fails breaks the group: a collective that raises marks it `broken`, and the
engine then stops rather than wait on a peer that will not answer.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# how long a collective may wait for a peer: long enough for a worker's idle wait between
# steps to be bounded only by the peer's death (its closed socket fails the wait at once)
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


class GroupBroken(RuntimeError):
    """A tensor-parallel collective failed: a rank died or cannot be reached."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    rank: int
    size: int
    vocab_size: int  # the whole vocabulary (the LM head's shards are padded to a split)
    broken: str | None = None
    _pg: object = field(default=None, repr=False)

    @classmethod
    def join(cls, rank: int, size: int, address: str, port: int, vocab_size: int,
             backend: str = "gloo") -> TPGroup:
        """This process's place in the group (blocks until all `size` ranks joined)."""
        if dist.is_initialized():  # torch.distributed has one default group a process
            raise ValueError("tensor_parallel_size: this process already belongs to a "
                             "tensor-parallel group; close that engine first")
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}",
                                rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, size, vocab_size, _pg=dist.group.WORLD)

    @property
    def first(self) -> bool:
        return self.rank == 0

    def _guard(self, what: str, fn):
        if self.broken is not None:
            raise GroupBroken(f"the tensor-parallel group is broken: {self.broken}")
        try:
            return fn()
        except (RuntimeError, OSError) as e:  # gloo: a peer's socket closed or timed out
            self.broken = f"{what} failed on rank {self.rank}: {e}"
            raise GroupBroken(self.broken) from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        self._guard("all_reduce", lambda: dist.all_reduce(x))
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """[S, V / size] on each rank -> [S, V] on rank 0 (None elsewhere)."""
        local = local.contiguous()
        if not self.first:
            self._guard("gather", lambda: dist.gather(local, None, dst=0))
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self._guard("gather", lambda: dist.gather(local, parts, dst=0))
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]

    def broadcast(self, obj=None):
        """Rank 0's object on every rank (pickled: the step's small tensors travel in it)."""
        box = [obj]
        self._guard("broadcast", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks run, as seen by this process: its rank, the ranks it starts
    (rank 0 starts the rest of the first machine's; another machine's first process starts
    the rest of that machine's) and the rendezvous."""

    size: int
    rank: int
    spawn: tuple[int, ...]
    address: str
    port: int


def placement(size: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
              master_port: int | None = None) -> Placement:
    """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: one process a rank,
    nothing to start) when they are set, else `size` ranks over `nnodes` machines of
    size / nnodes ranks each; one machine picks a free port."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size: {size}, but torchrun started "
                             f"WORLD_SIZE={env['WORLD_SIZE']} processes")
        return Placement(size, int(env["RANK"]), (), env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", "29500")))
    address = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    port = master_port or int(env.get("MASTER_PORT") or 0)
    if not port:
        if nnodes > 1:
            raise ValueError("master_port: ranks on several machines need one rendezvous "
                             "port (--master-port or MASTER_PORT)")
        port = free_port()
    per_node = size // nnodes
    first = node_rank * per_node
    return Placement(size, first, tuple(range(first + 1, first + per_node)), address, port)
