"""Passing blocks around a ring of ranks with torch.distributed's point-to-point operations.

A message is a few tensors packed into one byte buffer, sent to the next rank while the
previous rank's buffer is received (``batch_isend_irecv``: both posted at once, so the ring
cannot deadlock, and the caller computes while they travel).

gloo, the backend torch ships for Macs, takes CPU tensors only: device tensors (MPS) are
staged through CPU buffers -- a device-to-host copy, which waits for the kernels that
produce the tensor, and a host-to-device copy on arrival.  A K/V block that arrives on
the CPU is forwarded from its CPU copy, so each block crosses to the host once per rank.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

# Backends whose point-to-point operations take CPU tensors only (device tensors are staged).
_HOST_ONLY = {"gloo"}


def resolve_group(group) -> tuple[object, int, int]:
    """(group, this rank in it, its size), with clear errors for what cannot be a ring."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first, e.g. under torchrun)")
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives non-members
        raise ValueError(f"ring_attention: this process (global rank {dist.get_rank()}) is not a member of group "
                         f"(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ring_attention: group must be a torch.distributed.ProcessGroup or None (the default "
                        f"group), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"ring_attention: this process (global rank {dist.get_rank()}) is not a member of group "
                         f"(its global ranks: {dist.get_process_group_ranks(group)})")
    return group, rank, dist.get_world_size(group)


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` packed into one byte buffer on ``device`` (one message, whatever their dtypes)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]).to(device)


def unpack(buf: torch.Tensor, like: Sequence[tuple[torch.Size, torch.dtype]],
           device: torch.device) -> list[torch.Tensor]:
    """The tensors of ``like`` (shape, dtype) packed in ``buf``, as views of its copy on ``device``
    (none when it is there already; the copy to a GPU does not wait for it)."""
    buf = buf.to(device, non_blocking=True)
    out, at = [], 0
    for shape, dtype in like:
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[at:at + n].view(dtype).view(shape))
        at += n
    return out


class Ring:
    """The ring of ``group``: messages go to the next rank and come from the previous one."""

    def __init__(self, group, rank: int, world: int, device: torch.device):
        self.group, self.rank, self.world = group, rank, world
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)
        staged = dist.get_backend(group) in _HOST_ONLY and device.type != "cpu"
        self.wire = torch.device("cpu") if staged else device  # where messages live
        self.device = device

    def to_wire(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return pack(tensors, self.wire)

    def from_wire(self, buf: torch.Tensor, like: Sequence[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        return unpack(buf, like, self.device)

    def shift(self, buf: torch.Tensor) -> "Transfer":
        """Start sending ``buf`` (a wire buffer) to the next rank and receiving the previous rank's."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return Transfer(dist.batch_isend_irecv(ops), recv, buf)


class Transfer:
    """A shift in flight; :meth:`wait` returns the received buffer."""

    def __init__(self, works, recv: torch.Tensor, sent: torch.Tensor):
        self.works, self.recv, self.sent = works, recv, sent  # the sent buffer lives until the send completes

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.sent = None
        return self.recv
