"""Which rows of the sequence a rank holds, and which pairs of row runs a causal step computes.

Two layouts of a sequence of ``L = world * L_local`` rows over ``world`` ranks:

* contiguous (``load_balance=False``): rank ``r`` holds rows ``[r * L_local, (r + 1) * L_local)``.
  Under a causal mask rank ``world - 1`` does ``world`` times the work of rank 0.
* head-tail, or zigzag (``load_balance=True``): the sequence is cut into ``2 * world`` chunks of
  ``L_local / 2`` rows and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``, in that order.
  Every rank then sees the same number of (query, key) pairs under a causal mask.
  :func:`zigzag_shard` gives a rank its rows, :func:`zigzag_unshard` puts the ranks' rows back.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Run:
    """``length`` consecutive rows of the sequence from row ``start``, held at ``local`` in the rank's tensor."""
    start: int
    local: int
    length: int


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call of a ring step: local query rows ``q`` against local key rows ``k`` of the block held;
    ``diag_offset`` is the causal band (key ``j`` visible from row ``i`` iff ``j <= i + diag_offset``),
    None when every pair is visible."""
    q: slice
    k: slice
    diag_offset: Optional[int]


def runs(rank: int, world: int, local_len: int, load_balance: bool) -> tuple[Run, ...]:
    """The runs of rows rank ``rank`` holds (its queries, and the keys of its K/V block)."""
    if not load_balance:
        return (Run(rank * local_len, 0, local_len),)
    half = local_len // 2
    return (Run(rank * half, 0, half), Run((2 * world - 1 - rank) * half, half, half))


def calls(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], causal: bool) -> list[Call]:
    """The kernel calls that cover every visible (query, key) pair of these runs, and no pair
    that no query sees: a pair of runs with no visible pair is skipped, a fully visible one
    needs no band; fully visible pairs sharing their keys (or queries) on adjacent rows are
    one call."""
    if not causal:  # every pair is visible, in whatever order the rows are held
        return [Call(slice(0, sum(r.length for r in q_runs)), slice(0, sum(r.length for r in k_runs)), None)]
    found = []
    for qr in q_runs:
        for kr in k_runs:
            if kr.start > qr.start + qr.length - 1:
                continue  # every key comes after every query
            full = kr.start + kr.length - 1 <= qr.start
            found.append((qr, kr, None if full else qr.start - kr.start))
    merged: list[list] = []
    for qr, kr, diag in found:
        for m in merged:
            mq, mk, mdiag = m
            if diag is None and mdiag is None:
                if mk == (kr.local, kr.length) and mq[0] + mq[1] == qr.local:
                    m[0] = (mq[0], mq[1] + qr.length)
                    break
                if mq == (qr.local, qr.length) and mk[0] + mk[1] == kr.local:
                    m[1] = (mk[0], mk[1] + kr.length)
                    break
        else:
            merged.append([(qr.local, qr.length), (kr.local, kr.length), diag])
    return [Call(slice(q0, q0 + ql), slice(k0, k0 + kl), diag) for (q0, ql), (k0, kl), diag in merged]


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, *, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s rows of the whole sequence ``x`` (along ``dim``, 2 for (B, H, L, D)) in the
    head-tail layout: chunks ``rank`` and ``2 * world_size - 1 - rank`` of ``2 * world_size`` equal
    chunks, concatenated.  The input of ``ring_attention(..., load_balance=True)``."""
    length = x.shape[dim]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard: rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if length % (2 * world_size):
        raise ValueError(f"zigzag_shard: x's length along dim {dim} ({length}) must be a multiple of "
                         f"2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * world_size - 1 - rank]), dim=dim)


def zigzag_unshard(x: torch.Tensor, world_size: int, *, dim: int = 2) -> torch.Tensor:
    """The whole sequence in order from ``x``, the ranks' head-tail rows concatenated in rank order
    along ``dim`` (what ``torch.distributed.all_gather`` and a ``torch.cat`` of its list give)."""
    length = x.shape[dim]
    if world_size < 1 or length % (2 * world_size):
        raise ValueError(f"zigzag_unshard: x's length along dim {dim} ({length}) must be a multiple of "
                         f"2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim=dim)  # rank r's head is chunk 2r, its tail chunk 2r + 1
    order = [2 * r for r in range(world_size)] + [2 * r + 1 for r in reversed(range(world_size))]
    return torch.cat([chunks[i] for i in order], dim=dim)
