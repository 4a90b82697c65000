"""A BlockMask as the kernels walk it: per row block, the partial and the full blocks.

The forward and dQ kernels take the key-block lists of each query block, the
dK/dV kernel the query-block lists of each key block.  A threadgroup's rows
must lie in one row block and a step's tile in one listed block, so the block
sizes must be multiples of every kernel tile; a BlockMask whose sizes are not
is coarsened to the least common multiple: a coarse block is full when every
block inside it is, empty when every one is, else partial (mask_mod is
evaluated there, so the result is the same, only less sparse).  Lists come as
int32 tensors on the query's device, broadcast over batch / heads when the
BlockMask is; nothing is read back to the host.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .params import FlexParams

# Block size of the lists built when no BlockMask is given (every block full).
DEFAULT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Lists:
    """One direction's lists and the FlexParams (packed) that describe them."""

    params: bytes
    num: torch.Tensor       # (batch, heads, rows)
    idx: torch.Tensor       # (batch, heads, rows, cols)
    full_num: torch.Tensor
    full_idx: torch.Tensor


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    q_block: int
    kv_block: int
    by_query: Lists  # key blocks of each query block (forward, dQ)
    by_key: Lists    # query blocks of each key block (dK/dV)


def _pack(row_block: int, col_block: int, num, idx, full_num, full_idx) -> Lists:
    p = FlexParams()
    p.row_block, p.col_block = row_block, col_block
    p.batch, p.heads, p.rows = num.shape
    p.cols = idx.shape[-1]
    p.has_full = int(full_num is not None)
    if full_num is None:
        full_num, full_idx = num, idx  # bound, never read
    as_i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return Lists(p.to_bytes(), as_i32(num), as_i32(idx), as_i32(full_num), as_i32(full_idx))


def check_block_mask(block_mask, B: int, H: int, Lq: int, Lk: int) -> None:
    """ValueError unless ``block_mask`` was made for this problem (torch's rule: its lengths, B and H 1 or the problem's)."""
    Lq_m, Lk_m = block_mask.seq_lengths
    if (Lq_m, Lk_m) != (Lq, Lk):
        raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN) = {(Lq_m, Lk_m)}, but query and key have "
                         f"lengths {(Lq, Lk)}: create it with the query's and key's lengths")
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    if Bm not in (1, B) or Hm not in (1, H):
        raise ValueError(f"block_mask has (B, H) = {(Bm, Hm)}; expected 1 or the batch {B} and 1 or the query "
                         f"heads {H}")


def _states(block_mask) -> torch.Tensor:
    """(Bm, Hm, nQ, nKV) int8: 0 empty, 1 partial, 2 full."""
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    n_kv = idx.shape[-1]
    cols = torch.arange(n_kv, device=idx.device)

    def scatter(num, idx, value):
        valid = (cols < num.unsqueeze(-1)).to(torch.int8) * value
        out = torch.zeros(idx.shape[:-1] + (n_kv + 1,), dtype=torch.int8, device=idx.device)
        # invalid entries go to a spare column (their index may repeat a valid one)
        where = torch.where(cols < num.unsqueeze(-1), idx.long().clamp(0, n_kv - 1), n_kv)
        return out.scatter_(-1, where, valid)[..., :n_kv]

    states = scatter(num, idx, 1)
    if block_mask.full_kv_num_blocks is not None:
        states = torch.maximum(states, scatter(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2))
    return states


def _coarsen(states: torch.Tensor, fq: int, fk: int, n_q: int, n_kv: int) -> torch.Tensor:
    """Merge fq x fk blocks: full iff all full, empty iff all empty (padding blocks are neutral)."""
    if fq == 1 and fk == 1:
        return states
    Bm, Hm = states.shape[:2]
    cq, ck = -(-n_q // fq), -(-n_kv // fk)
    pad = (0, ck * fk - n_kv, 0, cq * fq - n_q)
    tiles = lambda t: t.reshape(Bm, Hm, cq, fq, ck, fk).transpose(3, 4).reshape(Bm, Hm, cq, ck, fq * fk)  # noqa
    any_visible = tiles(torch.nn.functional.pad(states, pad, value=0)).amax(-1) > 0
    all_full = tiles(torch.nn.functional.pad(states, pad, value=2)).amin(-1) == 2
    return torch.where(all_full, 2, torch.where(any_visible, 1, 0)).to(torch.int8)


def _lists(states: torch.Tensor, row_block: int, col_block: int) -> Lists:
    """Lists of the (.., rows, cols) states, visible blocks in increasing order."""
    def ordered(sel):
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num, idx
    num, idx = ordered(states == 1)
    full_num, full_idx = ordered(states == 2)
    return _pack(row_block, col_block, num, idx, full_num, full_idx)


def kernel_blocks(block_mask, B: int, H: int, Lq: int, Lk: int, q_tile: int, kv_tile: int,
                  device: torch.device) -> KernelBlocks:
    """The lists of ``block_mask`` (None: every block visible) for kernels whose query
    tiles divide ``q_tile`` and key tiles divide ``kv_tile``."""
    if block_mask is None:
        q_block = kv_block = math.lcm(DEFAULT_BLOCK, q_tile, kv_tile)
        n_q, n_kv = -(-Lq // q_block), -(-Lk // kv_block)
        states = torch.full((1, 1, max(n_q, 1), max(n_kv, 1)), 2, dtype=torch.int8, device=device)
    else:
        check_block_mask(block_mask, B, H, Lq, Lk)
        bq, bk = block_mask.BLOCK_SIZE
        q_block, kv_block = math.lcm(bq, q_tile), math.lcm(bk, kv_tile)
        m = block_mask
        if (q_block, kv_block) == (bq, bk) and m.q_num_blocks is not None:  # the BlockMask's own lists
            on = lambda t: None if t is None else t.to(device)  # noqa: E731
            return KernelBlocks(q_block, kv_block,
                                _pack(bq, bk, on(m.kv_num_blocks), on(m.kv_indices), on(m.full_kv_num_blocks),
                                      on(m.full_kv_indices)),
                                _pack(bk, bq, on(m.q_num_blocks), on(m.q_indices), on(m.full_q_num_blocks),
                                      on(m.full_q_indices)))
        states = _states(block_mask).to(device)
        states = _coarsen(states, q_block // bq, kv_block // bk, states.shape[2], states.shape[3])
    return KernelBlocks(q_block, kv_block, _lists(states, q_block, kv_block),
                        _lists(states.transpose(-1, -2), kv_block, q_block))
