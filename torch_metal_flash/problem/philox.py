"""Dropout's random numbers: Philox 4x32-10 on the host, bit for bit the kernels' generator.

The kernels (``shaders/flash_common.h``, ``flash::Dropout``) decide whether the
attention probability of query row ``i`` and key ``j`` of batch entry ``b``
(the sequence, for varlen) and query head ``h`` survives dropout from word
``j % 4`` of::

    philox4x32_10(counter = (j // 4, i, b * Hq + h, offset % 2**32),
                  key     = (seed % 2**32, (seed >> 32) ^ (offset >> 32)))

dropping it when the word is below ``threshold(p)`` (= round(p * 2**32)).  The
forward and the backward regenerate the same mask from ``rng_state = (seed,
offset)``; nothing is stored.  This module computes the same mask with int64
tensor arithmetic (the reference path and the tests use it) and draws the
``rng_state`` of a call (:func:`new_rng_state`).

Where the seed comes from: torch's CUDA fused attention reserves
``batch * heads * 32`` Philox counters at the (seed, offset) of the CUDA
generator and advances its offset; the CPU generator has no offset (an
mt19937 state: ``Generator.get_offset`` raises), and torch's MPS/CPU SDPA with
dropout runs the math path, whose ``native_dropout`` draws from the device's
default generator like any random op.  :func:`new_rng_state` draws
``(seed, offset)`` with one random op (``torch.randint``) on the query's device:
it consumes the device's default generator like torch's own dropout does
there, so ``torch.manual_seed`` reproduces a run and two calls in a row get
different masks; on MPS it is a GPU op (no host synchronisation), and under
``torch.compile`` it is part of the graph, drawn at run time.  It draws four
31-bit words (torch's MPS ``random_`` runs in int32: a full 64-bit range is
not drawn faithfully there) and joins them into a 62-bit seed and offset on
the device.
"""
from __future__ import annotations

from typing import Optional

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox 4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key bumps (Weyl sequence)
_MASK32 = 0xFFFFFFFF
# Elements per block of the host mask (bounds the int64 temporaries).
_BLOCK_ELEMENTS = 1 << 20


def threshold(p: float) -> int:
    """The 32-bit word below which an element is dropped (round(p * 2^32), at most 2^32 - 1)."""
    return min(int(round(float(p) * 2.0 ** 32)), _MASK32)


def keep_scale(p: float) -> float:
    """What kept probabilities are multiplied by: 1 / (1 - p), 0 for p = 1 (everything dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - float(p))


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of m * x, m and x < 2^32, in int64 (x split in 16-bit halves)."""
    t = m * (x & 0xFFFF)  # < 2^48
    u = m * (x >> 16)  # < 2^48
    low = t + ((u & 0xFFFF) << 16)  # < 2^49
    return (u >> 16) + (low >> 32), low & _MASK32


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Philox 4x32-10 of the counter words (int64 tensors holding uint32 values,
    broadcast together) under the key (k0, k1); four int64 tensors of uint32 words."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3)))
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_offset(rng_state: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) of an rng_state as unsigned 64-bit Python ints (reads the tensor on the host)."""
    seed, offset = (int(x) for x in rng_state.detach().cpu().tolist())
    return seed & 0xFFFFFFFFFFFFFFFF, offset & 0xFFFFFFFFFFFFFFFF


def keep_mask(rng_state: torch.Tensor, p: float, bh: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              device: Optional[torch.device] = None) -> torch.Tensor:
    """Whether each element survives dropout: a bool tensor of the broadcast shape of
    ``bh`` (batch entry * Hq + head), ``rows`` (i) and ``cols`` (j), e.g. (B, H, 1, 1),
    (1, 1, L, 1) and (1, 1, 1, S)."""
    seed, offset = seed_offset(rng_state)
    k0, k1 = seed & _MASK32, (seed >> 32) ^ (offset >> 32)
    thr = threshold(p)
    bh, rows, cols = (t.to(device=device or cols.device, dtype=torch.int64) for t in (bh, rows, cols))
    shape = torch.broadcast_shapes(bh.shape, rows.shape, cols.shape)
    out = torch.empty(shape, dtype=torch.bool, device=cols.device)
    if out.numel() == 0:
        return out
    bh, rows, cols = torch.broadcast_tensors(bh, rows, cols)
    flat = [t.reshape(-1, shape[-1]) if len(shape) else t.reshape(1, 1) for t in (bh, rows, cols)]
    out_flat = out.view(-1, shape[-1]) if len(shape) else out.view(1, 1)
    step = max(1, _BLOCK_ELEMENTS // max(1, out_flat.shape[1]))
    for r0 in range(0, out_flat.shape[0], step):
        b_, i_, j_ = (t[r0:r0 + step] for t in flat)
        words = philox4x32_10(j_ >> 2, i_, b_, offset & _MASK32, k0, k1)
        word = torch.stack(words, dim=-1).gather(-1, (j_ & 3).unsqueeze(-1)).squeeze(-1)
        out_flat[r0:r0 + step] = word >= thr
    return out


def new_rng_state(device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(seed, offset) for one dropout call, int64 (2,) on ``device``, drawn from
    ``generator`` (default: the device's default generator; see the module doc)."""
    words = torch.randint(0, 2 ** 31 - 1, (2, 2), dtype=torch.int32, device=device, generator=generator)
    words = words.to(torch.int64)
    return words[:, 0] + words[:, 1] * 2 ** 31
