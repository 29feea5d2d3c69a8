"""The tensor-parallel process group (torch.distributed: gloo on the CPU, NCCL on GPUs) and the
three collectives the sharded model calls: all-reduce, all-gather along the last dimension,
and the broadcast that hands every rank the step rank 0 scheduled."""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

# A worker waits on the next step's broadcast for as long as the engine is idle; rank 0 never
# waits idle, so a rank that died (or never joined) is an error after STEP_TIMEOUT, not a hang.
IDLE_TIMEOUT = datetime.timedelta(days=365)
STEP_TIMEOUT = datetime.timedelta(minutes=5)


def init(rank: int, world: int, init_method: str, device: str = "cpu") -> None:
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=STEP_TIMEOUT if rank == 0 else IDLE_TIMEOUT)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x joined along the last dimension, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast(obj: Any = None) -> Any:
    """Rank 0's obj on every rank (pickled; tensors travel inside)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    if initialized():
        dist.destroy_process_group()
