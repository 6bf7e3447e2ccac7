"""Tensor parallelism: the process group, the collectives the layers call, and the worker ranks.

Megatron-style sharding: q/k/v, gate/up and the vocabulary are split by rows (each rank holds a slice
of the heads, the MLP width and the vocabulary); o_proj and down_proj are split by columns and their
partial outputs are summed with an all-reduce. Rank 0 runs the whole engine and broadcasts each step's
inputs; ranks 1..N-1 only run forward passes (``worker.worker_main``). NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1


_GROUP = TPGroup()


def tp() -> TPGroup:
    return _GROUP


def init_group(rank: int, size: int, port: int, device: torch.device) -> None:
    global _GROUP
    _GROUP = TPGroup(rank, size)
    if size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=device if device.type == "cuda" else None)


def destroy_group() -> None:
    global _GROUP
    if _GROUP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _GROUP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_tensor(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype everywhere)."""
    if _GROUP.size > 1:
        dist.broadcast(t, src=0)
    return t


def broadcast_object(obj=None):
    """Rank 0 sends ``obj``; every rank returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_min(value: int, device: torch.device) -> int:
    if _GROUP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
