"""Paged K/V in the backward: the varlen backward kernels read packed K/V, so the
autograd formula of ``metal_flash.fwd`` gathers a paged cache into a padded packed
layout, runs the one varlen backward on it, and sums dK/dV back into the cache's
blocks.

The padded layout gives every sequence ``slots * page`` rows, ``slots =
ceil(min(max_seqlen_k, max_blocks * page) / page)``: sequence ``b`` owns rows
``[b * slots * page, (b + 1) * slots * page)``, slot ``s`` of it holding block
``block_table[b, s]`` (clamped to the pool, as the kernels clamp), and uses its
first ``lk_b`` keys through ``seqused_k`` -- ``lk_b`` the forward's key count,
computed on the device with the kernels' clamping (shaders/flash_common.h,
``seq_of``), so the backward sees the problem the forward solved.  Every row
belongs to a sequence, so the kernels write every dK/dV row (zeros past ``lk_b``).

Blocks may be shared (a common prefix) or unused.  The sum into the cache is
deterministic without atomics: the slots that hold a key (``s * page < lk_b``)
are sorted by block (stable: by sequence, then slot), a segmented doubling scan
adds each block's contributions in that fixed tree order, and each block gathers
its segment's total (zeros for blocks nothing reads).  Low-precision gradients
are summed in float32 and rounded once; a block one slot reads gets that slot's
gradient bit for bit.  Nothing is read on the host: the sizes come from shapes and
``max_seqlen_k``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..problem.layout import empty_in_layout


class PaddedLayout(NamedTuple):
    """Where each sequence's keys sit in the padded packed layout, and how its slots
    sum back into the block pool."""
    blocks: Tensor  # (num_seqs * slots,) int64: the (clamped) block of each slot
    page: int
    num_blocks: int
    cu_seqlens_k: Tensor  # (num_seqs + 1,) int32: b * slots * page
    seqused_k: Tensor  # (num_seqs,) int32: the forward's key count per sequence
    max_seqlen_k: int  # slots * page


def padded_layout(block_table: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor], max_seqlen_k: int,
                  page: int, num_blocks: int) -> PaddedLayout:
    n, max_blocks = block_table.shape
    slots = -(-min(max_seqlen_k, max_blocks * page) // page) if num_blocks > 0 else 0
    table = block_table[:, :slots].to(torch.int64).clamp(0, max(num_blocks - 1, 0))
    # the kernels' key count: the sequence's length, clamped to its capacity and max_seqlen_k, then seqused_k
    cu = cu_seqlens_k.to(torch.int64)
    lk = (cu[1:] - cu[:-1]).clamp(0, min(max_blocks * page, max_seqlen_k))
    if seqused_k is not None:
        lk = torch.minimum(seqused_k.to(torch.int64).clamp(min=0), lk)
    rows = slots * page
    offsets = torch.arange(n + 1, dtype=torch.int32, device=block_table.device) * rows
    return PaddedLayout(table.reshape(-1), page, num_blocks, offsets, lk.to(torch.int32), rows)


def gather(cache: Tensor, layout: PaddedLayout) -> Tensor:
    """A (num_blocks, Hkv, page, D)-indexed cache as the (1, Hkv, num_seqs * slots * page, D)
    padded packed tensor (one copy)."""
    _, hkv, page, d = cache.shape
    return cache.transpose(0, 1).index_select(1, layout.blocks).reshape(1, hkv, -1, d)


class _Segments(NamedTuple):
    order: Tensor  # (S,) the slots sorted by block (dump key num_blocks last for slots holding no key)
    head: Tensor  # (S,) position of the first slot of each sorted slot's segment
    tail: Tensor  # (num_blocks,) position of each block's last sorted slot
    present: Tensor  # (num_blocks,) bool: some slot holding a key names the block


def _segments(layout: PaddedLayout) -> _Segments:
    blocks, page, nb = layout.blocks, layout.page, layout.num_blocks
    n = layout.seqused_k.shape[0]
    slots = blocks.shape[0] // n if n else 0
    first_key = torch.arange(slots, device=blocks.device) * page
    holds_key = (first_key[None, :] < layout.seqused_k[:, None]).reshape(-1)
    key = torch.where(holds_key, blocks, nb)
    key_sorted, order = torch.sort(key, stable=True)
    head = torch.searchsorted(key_sorted, key_sorted)
    pool = torch.arange(nb, device=blocks.device)
    tail = torch.searchsorted(key_sorted, pool, right=True) - 1
    present = (tail >= 0) & (key_sorted[tail.clamp(min=0)] == pool) if key_sorted.numel() else tail >= 0
    return _Segments(order, head, tail.clamp(min=0), present)


def scatter_sum(grad: Tensor, layout: PaddedLayout, cache: Tensor, segments: Optional[_Segments] = None) -> Tensor:
    """The gradient of ``cache`` (``gather``'s input) from ``grad``, the padded packed
    gradient: each block the sum of the slots that hold its keys, in a fixed order."""
    seg = segments if segments is not None else _segments(layout)
    hkv, page, d = cache.shape[1], cache.shape[2], grad.shape[-1]
    ct = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    x = grad.reshape(hkv, -1, page, d).index_select(1, seg.order).to(ct)
    pos = torch.arange(x.shape[1], device=x.device)
    step = 1
    while step < x.shape[1]:
        # after this step x[:, i] sums the segment's sorted slots (i - 2 * step, i]
        same = (pos - step >= seg.head)[None, :, None, None]
        x = torch.where(same, x + x.index_select(1, (pos - step).clamp(min=0)), x)
        step *= 2
    out = empty_in_layout(cache)
    if layout.num_blocks == 0:
        return out
    total = x.index_select(1, seg.tail) if x.shape[1] else x.new_zeros((hkv, layout.num_blocks, page, d))
    torch.where(seg.present[None, :, None, None], total.to(cache.dtype), torch.zeros((), dtype=cache.dtype,
                                                                                     device=cache.device),
                out=out.transpose(0, 1))
    return out


def scatter_sums(grads: tuple, layout: PaddedLayout, caches: tuple) -> tuple:
    """:func:`scatter_sum` of several gradients (None: not wanted) sharing one sort."""
    if all(g is None for g in grads):
        return grads
    seg = _segments(layout)
    return tuple(None if g is None else scatter_sum(g, layout, c, seg) for g, c in zip(grads, caches))
