"""The KV-cache op on the host: value checks of the index tensors and the reference path.

Used by ``metal_flash::fwd_kvcache`` when the kernels do not run (reference
backend, or a configuration they do not cover) and by
``flash_attn_with_kvcache``'s debug mode (``TORCH_METAL_FLASH_DEBUG=1``).
Both read the index tensors on the host, which on MPS is a GPU
synchronisation; the kernel path never does (shaders/kvcache_index.h).
Quantized caches (:class:`~torch_metal_flash.problem.quant.QuantizedTensor`) get the new
rows quantized with :func:`~torch_metal_flash.problem.quant.quantize` (the kernels' rule)
and the attended rows dequantized.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..problem.quant import QuantizedTensor, quantize
from ..problem.spec import make_spec
from .attention import forward as attention_forward


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, L, H, D) at integer ``positions`` (B, L).

    ``cos``/``sin`` are (seqlen_ro, rotary_dim / 2); the first ``rotary_dim``
    features are rotated, the rest pass through.  ``interleaved`` pairs
    features (0, 1), (2, 3), ...; otherwise (GPT-NeoX) i and i + rotary_dim / 2.
    Computed in float32 (float64 for float64 ``x``), returned in ``x.dtype``
    as a contiguous tensor whatever the strides of ``x``.
    """
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[-1]
    rd = 2 * half
    c = cos.to(ct)[positions][:, :, None, :]  # (B, L, 1, rd/2)
    s = sin.to(ct)[positions][:, :, None, :]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xr = x[..., :rd].to(ct)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        out[..., 0:rd:2] = x0 * c - x1 * s
        out[..., 1:rd:2] = x0 * s + x1 * c
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:rd] = x0 * s + x1 * c
    out[..., rd:] = x[..., rd:]
    return out


@dataclasses.dataclass
class Geometry:
    """Shapes of one call (host-known, no device reads)."""

    batch: int
    seqlen_q: int
    seqlen_new: int
    paged: bool
    page_size: int  # 0 for a contiguous cache
    capacity: int  # positions per row: L_max, or max_blocks * page_size
    cache_rows: int  # batch_cache or num_blocks
    local: bool  # q rotated per row (causal or windowed)

    @classmethod
    def of(cls, q, k_cache, k, block_table, window_left: int, window_right: int) -> "Geometry":
        paged = block_table is not None
        page = k_cache.shape[1] if paged else 0
        return cls(batch=q.shape[0], seqlen_q=q.shape[1], seqlen_new=0 if k is None else k.shape[1], paged=paged,
                   page_size=page, capacity=block_table.shape[1] * page if paged else k_cache.shape[1],
                   cache_rows=k_cache.shape[0], local=window_left >= 0 or window_right >= 0)


@dataclasses.dataclass
class HostIndices:
    """The index values of a call on the host (int64 CPU tensors), validated."""

    seqlens: torch.Tensor  # (B,) before the append
    leftpad: torch.Tensor  # (B,)
    batch_idx: Optional[torch.Tensor]  # (B,) or None
    block_table: Optional[torch.Tensor]  # (B, max_blocks) or None


def check_seqlens(g: Geometry, seqlens: list[int]) -> None:
    """``cache_seqlens`` values: >= 0, and the append fits the cache."""
    for i, s in enumerate(seqlens):
        if s < 0:
            raise ValueError(f"cache_seqlens: entry {i} is {s}; expected >= 0")
    what = "k_cache capacity" if not g.paged else "capacity of block_table (max_blocks * page_block_size)"
    for i, s in enumerate(seqlens):
        if s + g.seqlen_new > g.capacity:
            if g.seqlen_new:
                raise ValueError(f"k, v: appending {g.seqlen_new} rows at cache_seqlens[{i}] = {s} "
                                 f"overflows the cache ({what} {g.capacity})")
            raise ValueError(f"cache_seqlens: entry {i} is {s}, beyond the {what} {g.capacity}")


def check_rotary_length(g: Geometry, seqlens: list[int], seqlen_ro: int) -> None:
    last_q = g.seqlen_q if g.local else 1
    need = max((s + max(g.seqlen_new, last_q) for s in seqlens), default=0)
    if seqlen_ro < need:
        raise ValueError(f"rotary_cos: has {seqlen_ro} positions (seqlen_ro), the call needs "
                         f"{need} (cache_seqlens + new rows)")


def host_indices(g: Geometry, cache_seqlens: Optional[torch.Tensor], seqlen: int,
                 cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                 block_table: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor]) -> HostIndices:
    """Reads the index tensors on the host and raises a clear error for any value
    the kernels would clamp or ignore (one GPU synchronisation on MPS)."""
    B = g.batch
    bidx = None
    if cache_batch_idx is not None:
        bidx = cache_batch_idx.to("cpu", torch.int64)
        for i, x in enumerate(bidx.tolist()):
            if not 0 <= x < g.cache_rows:
                raise IndexError(f"cache_batch_idx: entry {i} is {x}, outside the {g.cache_rows} rows of k_cache")
    seqlens = cache_seqlens.to("cpu", torch.int64) if cache_seqlens is not None else torch.full((B,), seqlen)
    sl = seqlens.tolist()
    check_seqlens(g, sl)
    leftpad = torch.zeros(B, dtype=torch.int64)
    if cache_leftpad is not None:
        leftpad = cache_leftpad.to("cpu", torch.int64)
        for i, (x, s) in enumerate(zip(leftpad.tolist(), sl)):
            if not 0 <= x <= s:
                raise ValueError(f"cache_leftpad: entry {i} is {x}; expected 0 <= cache_leftpad <= "
                                 f"cache_seqlens ({s})")
    bt = None
    if block_table is not None:
        bt = block_table.to("cpu", torch.int64)
        for r, s in enumerate(sl):
            used = -(-(s + g.seqlen_new) // g.page_size)  # pages holding keys of row r
            for c, x in enumerate(bt[r, :used].tolist()):
                if not 0 <= x < g.cache_rows:
                    raise IndexError(f"block_table: entry [{r}, {c}] is {x}, outside the pool of "
                                     f"{g.cache_rows} blocks of k_cache/v_cache")
    if rotary_cos is not None:
        check_rotary_length(g, sl, rotary_cos.shape[0])
    return HostIndices(seqlens=seqlens, leftpad=leftpad, batch_idx=bidx, block_table=bt)


# ---------------------------------------------------------------------------
# The reference path of metal_flash::fwd_kvcache
# ---------------------------------------------------------------------------

def forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, seqlen: int, scale: float, window_left: int, window_right: int,
            softcap: float, rotary_interleaved: bool):
    """The op on the reference path: validate the indices, append (in place), attend.
    Returns (out (B, Lq, Hq, D), lse (B, Hq, Lq))."""
    g = Geometry.of(q, k_cache, k, block_table, window_left, window_right)
    ix = host_indices(g, cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_cos)
    q = _append(g, ix, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved)
    alibi = alibi_slopes.expand(q.shape[0], q.shape[2]) if alibi_slopes is not None else None
    return _attend(g, ix, q, k_cache, v_cache, alibi, scale, window_left, window_right, softcap)


def _append(g: Geometry, ix: HostIndices, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, interleaved):
    """Rotate q and the new k, write k/v into the cache at cache_seqlens; returns q."""
    B, Lq, Ln = g.batch, g.seqlen_q, g.seqlen_new
    dev = q.device
    if rotary_cos is not None:
        base = ix.seqlens.to(dev)
        pos_k = base[:, None] + torch.arange(Ln, device=dev)[None, :]
        pos_q = base[:, None] + (torch.arange(Lq, device=dev)[None, :] if g.local
                                 else torch.zeros(1, Lq, dtype=torch.int64, device=dev))
        k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, pos_q, interleaved)
    if Ln == 0 or B == 0:
        return q
    pos = ix.seqlens[:, None] + torch.arange(Ln)[None, :]  # (B, Ln) absolute positions
    if g.paged:
        blk = torch.gather(ix.block_table, 1, pos // g.page_size)
        rows, cols = blk.flatten().to(dev), (pos % g.page_size).flatten().to(dev)
    else:
        crow = ix.batch_idx if ix.batch_idx is not None else torch.arange(B)
        rows, cols = crow[:, None].expand(B, Ln).flatten().to(dev), pos.flatten().to(dev)
    k_cache[rows, cols] = _stored(k.flatten(0, 1), k_cache)
    v_cache[rows, cols] = _stored(v.flatten(0, 1), v_cache)
    return q


def _stored(rows: torch.Tensor, cache):
    """``rows`` as ``cache`` stores them (quantized for a QuantizedTensor cache)."""
    if isinstance(cache, QuantizedTensor):
        return quantize(rows, **cache.format())
    return rows


def _plain(t):
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _attention(q, k, v, alibi, scale, diag_offset, left, right, softcap):
    """(out, lse) of (B, H, L, D) views, by the reference path's own attention (:mod:`.attention`):
    plain PyTorch, the band as :meth:`AttentionSpec.visible` defines it."""
    return attention_forward(make_spec(q, k, v, None, alibi, None, scale=scale, diag_offset=diag_offset,
                                       window_left=left, window_right=right, softcap=softcap))


def _attend(g: Geometry, ix: HostIndices, q, k_cache, v_cache, alibi, scale, left, right, softcap):
    """(out, lse) per row geometry: contiguous caches of one span for every row are viewed
    whole, other rows (ragged spans, paged caches, cache_batch_idx) one at a time."""
    B, Lq, Hq, D = q.shape
    dev = q.device
    starts, ends = ix.leftpad, ix.seqlens + g.seqlen_new
    if B == 0:
        return torch.empty_like(q), torch.empty((0, Hq, Lq), dtype=torch.float32, device=dev)
    uniform = bool((starts == starts[0]).all() and (ends == ends[0]).all())
    qt = q.transpose(1, 2)  # (B, Hq, Lq, D) view
    if uniform and not g.paged and ix.batch_idx is None:
        s0, e0 = int(starts[0]), int(ends[0])
        kt = _plain(k_cache[:B, s0:e0]).transpose(1, 2)
        vt = _plain(v_cache[:B, s0:e0]).transpose(1, 2)
        out, lse = _attention(qt, kt, vt, alibi, scale, (e0 - s0) - Lq, left, right, softcap)
        return out.transpose(1, 2), lse
    # Per batch row: a view of the contiguous cache row, or a gather of the pages.
    outs, lses = [], []
    for b in range(B):
        s, e = int(starts[b]), int(ends[b])
        if g.paged:
            pos = torch.arange(s, e)
            blk = ix.block_table[b][pos // g.page_size].to(dev)
            off = (pos % g.page_size).to(dev)
            kb, vb = _plain(k_cache[blk, off])[None], _plain(v_cache[blk, off])[None]
        else:
            row = int(ix.batch_idx[b]) if ix.batch_idx is not None else b
            kb, vb = _plain(k_cache[row:row + 1, s:e]), _plain(v_cache[row:row + 1, s:e])
        al = alibi[b:b + 1] if alibi is not None else None
        out, lse = _attention(qt[b:b + 1], kb.transpose(1, 2), vb.transpose(1, 2), al, scale, (e - s) - Lq, left,
                              right, softcap)
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
