"""A BlockMask as the kernels walk it: per row block, the partial and the full blocks.

The forward and dQ kernels take the key-block lists of each query block, the
dK/dV kernel the query-block lists of each key block.  A threadgroup's rows
must lie in one row block and a step's tile in one listed block, so the block
sizes must be multiples of every kernel tile (:data:`TILE_MULTIPLE`); a
BlockMask whose sizes are not is coarsened to the least common multiple: a
coarse block is full when every block inside it is, empty when every one is,
else partial (mask_mod is evaluated there, so the result is the same, only
less sparse).  Block sizes of at least :data:`MIN_SUB_BLOCK` that divide
:data:`TILE_MULTIPLE` keep their own granularity as sub-blocks: each partial
block of the lists carries a word of 2-bit sub-block states (0 hidden, 1
mask_mod, 2 visible), with which the kernels skip the hidden sub-blocks' loads
and evaluate mask_mod only in partial ones (``shaders/flash_flex.h``).  Lists
are int32 tensors on the query's device, broadcast over batch / heads when the
BlockMask is; nothing is read back to the host.

The BlockMask arrives as torch's flex_attention op takes it
(``BlockMask.as_tuple()``): the lengths, the eight lists, ..., the two block
sizes and the mask_mod.
"""
from __future__ import annotations

import math

import torch

from ..planner.flex import TILE_MULTIPLE

# The smallest block size kept as sub-blocks (16 sub-blocks of 2 bits fill a 32-bit word).
MIN_SUB_BLOCK = 16


def check_block_mask(block_mask, B: int, H: int, Lq: int, Lk: int) -> None:
    """ValueError unless ``block_mask`` was made for this problem (its lengths, B and H 1 or the problem's)."""
    Lq_m, Lk_m = block_mask.seq_lengths
    if (Lq_m, Lk_m) != (Lq, Lk):
        raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN) = {(Lq_m, Lk_m)}, but query and key have "
                         f"lengths {(Lq, Lk)}: create it with the query's and key's lengths")
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    if Bm not in (1, B) or Hm not in (1, H):
        raise ValueError(f"block_mask has (B, H) = {(Bm, Hm)}; expected 1 or the batch {B} and 1 or the query "
                         f"heads {H}")


def _states(num, idx, full_num, full_idx) -> torch.Tensor:
    """(Bm, Hm, rows, blocks) int8: 0 empty, 1 partial, 2 full."""
    n = idx.shape[-1]
    cols = torch.arange(n, device=idx.device)

    def scatter(num, idx, value):
        listed = cols < num.unsqueeze(-1)
        out = torch.zeros(idx.shape[:-1] + (n + 1,), dtype=torch.int8, device=idx.device)
        # unlisted entries go to a spare column (their index may repeat a listed one)
        where = torch.where(listed, idx.long().clamp(0, n - 1), n)
        return out.scatter_(-1, where, listed.to(torch.int8) * value)[..., :n]

    states = scatter(num, idx, 1)
    if full_num is not None:
        states = torch.maximum(states, scatter(full_num, full_idx, 2))
    return states


def _coarsen(states: torch.Tensor, fq: int, fk: int) -> torch.Tensor:
    """Merge fq x fk blocks: full iff all full, empty iff all empty (padding blocks are neutral)."""
    if fq == 1 and fk == 1:
        return states
    Bm, Hm, n_q, n_kv = states.shape
    cq, ck = -(-n_q // fq), -(-n_kv // fk)
    pad = (0, ck * fk - n_kv, 0, cq * fq - n_q)
    tiles = lambda t: t.reshape(Bm, Hm, cq, fq, ck, fk).transpose(3, 4).reshape(Bm, Hm, cq, ck, fq * fk)  # noqa
    any_visible = tiles(torch.nn.functional.pad(states, pad, value=0)).amax(-1) > 0
    all_full = tiles(torch.nn.functional.pad(states, pad, value=2)).amin(-1) == 2
    return torch.where(all_full, 2, torch.where(any_visible, 1, 0)).to(torch.int8)


def _grain(block: int) -> tuple[int, int]:
    """(list block size, sub-block size or 0) the kernels walk a BlockMask block size at."""
    if block % TILE_MULTIPLE == 0:
        return block, 0
    if TILE_MULTIPLE % block == 0 and block >= MIN_SUB_BLOCK:
        return TILE_MULTIPLE, block
    return math.lcm(block, TILE_MULTIPLE), 0


def _words(states: torch.Tensor, fq: int, fk: int, rows_sub: bool, cols_sub: bool) -> torch.Tensor:
    """(Bm, Hm, coarse rows, coarse cols) int32: the 2-bit states of each coarse block's fq x fk
    blocks, sub-block (r, c) at bits 2 (r * fk + c); an axis without sub-blocks merges its blocks
    (:func:`_coarsen`), positions past the problem and unused fields read 2 (the kernels bound them)."""
    if not rows_sub:
        states, fq = _coarsen(states, fq, 1), 1
    if not cols_sub:
        states, fk = _coarsen(states, 1, fk), 1
    Bm, Hm, n_q, n_kv = states.shape
    cq, ck = -(-n_q // fq), -(-n_kv // fk)
    padded = torch.nn.functional.pad(states, (0, ck * fk - n_kv, 0, cq * fq - n_q), value=2).long()
    fields = padded.reshape(Bm, Hm, cq, fq, ck, fk).transpose(3, 4).reshape(Bm, Hm, cq, ck, fq * fk)
    shifts = 2 * torch.arange(16, device=states.device)
    fields = torch.nn.functional.pad(fields, (0, 16 - fq * fk), value=2)
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _lists(states: torch.Tensor, words=None) -> list:
    """(num, idx, full_num, full_idx) of (..., rows, blocks) states, blocks in increasing order; with
    ``words``, the partial blocks' state words follow their indices in each row of idx."""
    out = []
    for state in (1, 2):
        sel = states == state
        out.append(sel.sum(-1, dtype=torch.int32))
        idx = torch.argsort(sel.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        if state == 1 and words is not None:
            idx = torch.cat([idx, words.gather(-1, idx.long())], -1)
        out.append(idx)
    return out


def kernel_lists(block_mask: tuple) -> tuple[list, list]:
    """(the 8 list tensors, [query block, key block, has_full, query sub-block, key sub-block]) of a
    BlockMask tuple, its block sizes multiples of :data:`TILE_MULTIPLE` (coarsened when they are not,
    with sub-blocks where :func:`_grain` keeps them)."""
    kv = list(block_mask[2:6])
    qs = list(block_mask[6:10])
    bq, bk = int(block_mask[-3]), int(block_mask[-2])
    (q_block, q_sub), (kv_block, kv_sub) = _grain(bq), _grain(bk)
    if (q_block, kv_block) == (bq, bk) and qs[0] is not None:  # the BlockMask's own lists
        has_full = kv[2] is not None and qs[2] is not None
        if not has_full:
            kv[2:], qs[2:] = kv[:2], qs[:2]  # bound, never read
        lists = [t.to(torch.int32).contiguous() for t in kv + qs]
        return lists, [q_block, kv_block, int(has_full), 0, 0]
    fine = _states(*kv)
    fq, fk = q_block // bq, kv_block // bk
    states = _coarsen(fine, fq, fk)
    if not (q_sub or kv_sub):
        lists = _lists(states) + _lists(states.transpose(-1, -2))
    else:
        lists = (_lists(states, _words(fine, fq, fk, q_sub > 0, kv_sub > 0))
                 + _lists(states.transpose(-1, -2), _words(fine.transpose(-1, -2), fk, fq, kv_sub > 0, q_sub > 0)))
    return [t.contiguous() for t in lists], [q_block, kv_block, 1, q_sub, kv_sub]
