"""Registers per thread of each kernel variant, estimated from the fragments it keeps live.

A lane holds 2 floats of an 8x8 ``simdgroup_float8x8`` (64 elements over 32 lanes) and 8
elements of a 16x16 accelerator fragment (``flash::nax::Frag``, ``shaders/flash_nax.h``), two
half or bfloat elements to a 32-bit register.  A kernel's estimate counts, in 32-bit registers
per lane, the fragments live across its inner loop: the operands it holds for the whole loop,
its accumulators, one key (or query) block's scores and the loop's temporaries, as the shader
declares them (the comments below name the arrays).  Addresses, indices and row statistics
come on top (a few dozen scalars, the same for every variant of a kernel), and Apple's compiler
makes the real allocation: the estimate ranks variants by register pressure; it does not
predict spills.  ``docs/tuning.md`` shows the table ``bench/registers.py`` writes.
"""
from __future__ import annotations

from typing import Union

from .backward_tiles import DKVTile, DQTile
from .decode import DecodeTile
from .tiles import ForwardTile, score_slices

SIMD_FRAG = 2  # 32-bit registers per lane of an 8x8 float fragment
NAX_ELEMS = 8  # elements per lane of a 16x16 accelerator fragment


def _nax_frag(dtype: str) -> int:
    """32-bit registers per lane of a 16x16 fragment of ``dtype`` (f32, or f16/bf16 packed two per register)."""
    return NAX_ELEMS if dtype == "f32" else NAX_ELEMS // 2


def _slice_sum(bd: int, ds: int) -> int:
    """The fragment of the next score slice, live while an undivided kernel adds it (a head-dim
    split sums the slices in threadgroup memory)."""
    return int(score_slices(bd) > 1 and ds == 1)


def forward(t: ForwardTile) -> int:
    if t.nax:  # Qf[BD/16] (input type), Of[BD/16] and S[BK/16] (float), K^T / V temporaries Kt[2] or Vf[2]
        nf, nk = t.bd // 16, t.bk // 16
        return (nf + 2) * _nax_frag(t.dtype) + (nf + nk) * _nax_frag("f32")
    # Qf[BD/8/DS] and Of[BD/8/DS] held, S[BK/8] per key block, one K or V fragment loaded at a time
    return (2 * (t.bd // 8 // t.ds) + t.bk // 8 + 1 + _slice_sum(t.bd, t.ds)) * SIMD_FRAG


def decode(t: DecodeTile) -> int:
    # Qf[BD/8], Of[BDV/8], S[BK/8], one K or V fragment at a time (as the forward)
    return (t.bd // 8 + (t.bdv or t.bd) // 8 + t.bk // 8 + 1 + _slice_sum(t.bd, 1)) * SIMD_FRAG


def dq(t: DQTile) -> int:
    if t.nax:  # Qf, dOf[BD/16] (input type), dQf[BD/16], S, dP[BK/16] (float), two K/V temporaries
        nf, nk = t.bd // 16, t.bk // 16
        return (2 * nf + 2) * _nax_frag(t.dtype) + (nf + 2 * nk) * _nax_frag("f32")
    # Qf, dOf, dQf[BD/8/DS] held; S, dP[BK/8] per key block; the block's dQ product and one K fragment
    return (3 * (t.bd // 8 // t.ds) + 2 * (t.bk // 8) + 2 + _slice_sum(t.bd, t.ds)) * SIMD_FRAG


def dkv(t: DKVTile) -> int:
    dk, dv = t.mode != 2, t.mode != 1
    if t.nax:  # Kf (and Vf for dK) in the input type; dKf / dVf, St (and dPt) float; two Q/dO temporaries
        nf, nq = t.bd // 16, t.bq // 16
        held = nf * (1 + dk)
        return (held + 2) * _nax_frag(t.dtype) + (nf * (dk + dv) + nq * (1 + dk)) * _nax_frag("f32")
    nf, nq = t.bd // 8 // t.ds, t.bq // 8
    # K (and V, which dP needs for dK) in registers unless staged in threadgroup memory; the
    # accumulators dKf / dVf; S^T (and dP^T) of one query block; dP^T's second chain, one Q or
    # dO fragment, the block's product (and, staged, the K/V fragment read back; undivided
    # above 256, the score slice being added)
    held = 0 if t.stages_kv else nf * (1 + dk)
    temps = 2 + dk + t.stages_kv + _slice_sum(t.bd, t.ds)
    return (held + nf * (dk + dv) + nq * (1 + dk) + temps) * SIMD_FRAG


Tile = Union[ForwardTile, DecodeTile, DQTile, DKVTile]


def estimate(tile: Tile) -> int:
    """32-bit registers per lane the tile's kernel keeps in fragments (see the module doc)."""
    for kind, fn in ((ForwardTile, forward), (DecodeTile, decode), (DQTile, dq), (DKVTile, dkv)):
        if isinstance(tile, kind):
            return fn(tile)
    raise TypeError(f"no register estimate for {type(tile).__name__}")
