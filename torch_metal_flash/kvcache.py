"""``flash_attn_with_kvcache``: attention of a few new query rows against a KV cache.

Same signature and semantics as ``flash_attn.flash_attn_with_kvcache``
(flash-attn 2.x); see :func:`flash_attn_with_kvcache` and ``docs/kvcache.md``.

Two execution paths:

* **kernels** (backend ``metal`` or ``emulator``): the new ``k``/``v`` (after
  rotary) are appended into the cache in place with ordinary tensor ops, then
  the split-K flash-decoding kernels of ``shaders/flash_decode.metal`` run
  through :func:`torch_metal_flash.planner.decode.plan_decode` (each K/V row is
  read once per GQA group; paged caches are read through the block table).
* **reference** (other backends, or a configuration the kernels do not cover,
  with the usual one-time fallback warning): per-row problem mapped onto the
  ``metal_flash.fwd`` op.  Contiguous caches are viewed, never gathered (a
  key-padding/band bool mask carries the ragged lengths); paged caches are
  gathered per batch row on this path only.

Decode-shaped calls of the other faces reach the same kernels through the
planner (``planner.decode.route_reason``).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from . import backends, checks, ops  # noqa: F401  (ops registers torch.ops.metal_flash)
from .plan import Unsupported

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


# ---------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------

def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, L, H, D) at integer ``positions`` (B, L).

    ``cos``/``sin`` are (seqlen_ro, rotary_dim / 2); the first ``rotary_dim``
    features are rotated, the rest pass through.  ``interleaved`` pairs
    features (0, 1), (2, 3), ...; otherwise (GPT-NeoX) i and i + rotary_dim / 2.
    Computed in float32 (float64 for float64 ``x``), returned in ``x.dtype``.
    """
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[-1]
    rd = 2 * half
    c = cos.to(ct)[positions][:, :, None, :]  # (B, L, 1, rd/2)
    s = sin.to(ct)[positions][:, :, None, :]
    xr = x[..., :rd].to(ct)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    if rd == x.shape[-1]:
        return rot.to(x.dtype)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


# ---------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------

def _int_vector(name: str, t, batch: int, device: torch.device) -> torch.Tensor:
    checks.tensor(name, t, ndim=(1,))
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an integer tensor (torch.int32), got dtype {t.dtype}")
    if t.shape[0] != batch:
        raise ValueError(f"{name}: expected shape ({batch},) (one entry per batch row of q), "
                         f"got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t.to(torch.int64)


def _first_bad(cond: torch.Tensor) -> int:
    return int(cond.nonzero()[0, 0].item())


class _Args:
    """Validated, normalised arguments (host-side int64 copies of the small vectors)."""


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
           block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
           num_splits, return_softmax_lse) -> _Args:
    a = _Args()
    checks.tensor("q", q, ndim=(4,))
    checks.float_dtype("q", q)
    checks.last_dim_contiguous("q", q)
    checks.head_dim("q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(name, t, ndim=(4,))
        checks.float_dtype(name, t)
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides "
                             f"{t.stride()}; the cache is updated in place, so it cannot be copied")
    checks.same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), "dtype")
    checks.same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), "device")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    B, Lq, Hq, D = q.shape
    dev = q.device
    a.batch, a.seqlen_q, a.heads, a.head_dim = B, Lq, Hq, D
    a.paged = block_table is not None
    nb, blen, Hkv, Dc = k_cache.shape
    checks.dim_equal("k_cache", Dc, D, "head dim (last dim) equal to q's")
    checks.gqa_heads(Hq, Hkv, "q", "k_cache/v_cache")
    a.kv_heads = Hkv
    if a.paged:
        checks.tensor("block_table", block_table, ndim=(2,))
        if block_table.dtype not in _INT_DTYPES:
            raise TypeError(f"block_table: expected an integer tensor (torch.int32), got dtype {block_table.dtype}")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table: expected {B} rows (batch size of q), got shape {tuple(block_table.shape)}")
        if block_table.device != dev:
            raise ValueError(f"block_table: expected device {dev}, got {block_table.device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported together with a paged cache (block_table); "
                             "reorder the rows of block_table instead")
        if blen < 1:
            raise ValueError(f"k_cache: paged cache with page_block_size {blen}")
        a.page_size = blen
        a.num_blocks = nb
        a.cache_len = block_table.shape[1] * blen
    else:
        a.page_size = 0
        a.cache_len = blen
        a.cache_batch = nb
    a.cache_batch_idx = None
    if cache_batch_idx is not None:
        idx = _int_vector("cache_batch_idx", cache_batch_idx, B, dev)
        bad = (idx < 0) | (idx >= nb)
        if bool(bad.any()):
            i = _first_bad(bad)
            raise IndexError(f"cache_batch_idx: entry {i} is {int(idx[i])}, outside the {nb} rows of k_cache")
        a.cache_batch_idx = idx
    elif not a.paged and nb < B:
        raise ValueError(f"k_cache: has {nb} batch rows but q has {B}; pass cache_batch_idx to pick rows")

    # New keys / values to append.
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    a.seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            checks.tensor(name, t, ndim=(4,))
            checks.float_dtype(name, t)
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {q.dtype} (the cache's), got {t.dtype}")
            if t.device != dev:
                raise ValueError(f"{name}: expected device {dev}, got {t.device}")
            if tuple(t.shape[:1]) != (B,) or tuple(t.shape[2:]) != (Hkv, D):
                raise ValueError(f"{name}: expected shape ({B}, seqlen_new, {Hkv}, {D}), got {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required when new k/v are given (where to append them)")
        a.seqlen_new = k.shape[1]

    # Sequence lengths.
    if cache_seqlens is None:
        seqlens = torch.full((B,), a.cache_len, dtype=torch.int64)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens: expected an int or a ({B},) int32 tensor, got {type(cache_seqlens).__name__}")
    elif isinstance(cache_seqlens, int):
        seqlens = torch.full((B,), cache_seqlens, dtype=torch.int64)
    else:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, B, dev).cpu()
    bad = seqlens < 0
    if bool(bad.any()):
        i = _first_bad(bad)
        raise ValueError(f"cache_seqlens: entry {i} is {int(seqlens[i])}; expected >= 0")
    total = seqlens + a.seqlen_new
    bad = total > a.cache_len
    if bool(bad.any()):
        i = _first_bad(bad)
        what = "k_cache capacity" if not a.paged else "capacity of block_table (max_blocks * page_block_size)"
        if a.seqlen_new:
            raise ValueError(f"k, v: appending {a.seqlen_new} rows at cache_seqlens[{i}] = {int(seqlens[i])} "
                             f"overflows the cache ({what} {a.cache_len})")
        raise ValueError(f"cache_seqlens: entry {i} is {int(seqlens[i])}, beyond the {what} {a.cache_len}")
    a.seqlens = seqlens
    a.total = total
    if cache_leftpad is not None:
        lp = _int_vector("cache_leftpad", cache_leftpad, B, dev).cpu()
        bad = (lp < 0) | (lp > seqlens)
        if bool(bad.any()):
            i = _first_bad(bad)
            raise ValueError(f"cache_leftpad: entry {i} is {int(lp[i])}; expected 0 <= cache_leftpad <= "
                             f"cache_seqlens ({int(seqlens[i])})")
        a.leftpad = lp
    else:
        a.leftpad = torch.zeros(B, dtype=torch.int64)

    if a.paged:
        bt = block_table.to(torch.int64).cpu()
        need = (total + a.page_size - 1) // a.page_size  # pages holding keys of each row
        used = torch.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= a.num_blocks))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise IndexError(f"block_table: entry [{r}, {c}] is {int(bt[r, c])}, outside the pool of "
                             f"{a.num_blocks} blocks of k_cache/v_cache")
        a.block_table_cpu = bt

    # Rotary.
    a.rotary = rotary_cos is not None or rotary_sin is not None
    if a.rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos, rotary_sin: pass both or neither")
        if k is None:
            raise ValueError("rotary_cos: rotary embedding is applied to the new k (and q); it needs k and v")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            checks.tensor(name, t, ndim=(2,))
            checks.float_dtype(name, t)
            if t.device != dev:
                raise ValueError(f"{name}: expected device {dev}, got {t.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_sin: expected the shape of rotary_cos {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        rd = 2 * rotary_cos.shape[1]
        if rd < 2 or rd > D:
            raise ValueError(f"rotary_cos: expected shape (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= "
                             f"head dim {D}, got {tuple(rotary_cos.shape)}")
        a.rotary_dim = rd

    a.left, a.right = checks.window(window_size)
    a.causal = bool(causal)
    if a.causal:
        a.right = 0
    # Window sides at least as long as the cache change nothing (as flash-attn
    # clamps them); this also decides whether q is rotated per row ("local").
    if a.left >= a.cache_len:
        a.left = -1
    if a.right >= a.cache_len:
        a.right = -1
    a.local = a.left >= 0 or a.right >= 0
    if a.rotary:
        last_q = seqlens + (Lq if a.local else 1)
        need_ro = int(torch.maximum(total, last_q).max()) if B else 0
        if rotary_cos.shape[0] < need_ro:
            raise ValueError(f"rotary_cos: has {rotary_cos.shape[0]} positions (seqlen_ro), the call needs "
                             f"{need_ro} (cache_seqlens + new rows)")
    a.softcap = checks.softcap(softcap)
    a.alibi = checks.alibi(alibi_slopes, B, Hq, dev)
    if softmax_scale is None:
        a.scale = D ** -0.5
    else:
        if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
        a.scale = float(softmax_scale)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    a.num_splits = num_splits
    return a


# ---------------------------------------------------------------------------
# Append (in place)
# ---------------------------------------------------------------------------

def _append(a: _Args, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved):
    """Rotate q and the new k, write k/v into the cache at cache_seqlens; returns q."""
    B, Lq = a.batch, a.seqlen_q
    dev = q.device
    if a.rotary:
        base = a.seqlens.to(dev)
        pos_k = base[:, None] + torch.arange(a.seqlen_new, device=dev)[None, :]
        pos_q = base[:, None] + (torch.arange(Lq, device=dev)[None, :] if a.local
                                 else torch.zeros(1, Lq, dtype=torch.int64, device=dev))
        k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, pos_q, rotary_interleaved)
    if a.seqlen_new == 0 or B == 0:
        return q
    Ln = a.seqlen_new
    pos = a.seqlens[:, None] + torch.arange(Ln)[None, :]  # (B, Ln) absolute positions
    if a.paged:
        blk = torch.gather(a.block_table_cpu, 1, pos // a.page_size)
        off = pos % a.page_size
        blk, off = blk.flatten().to(dev), off.flatten().to(dev)
        k_cache[blk, off] = k.flatten(0, 1)
        v_cache[blk, off] = v.flatten(0, 1)
    else:
        rows = a.cache_batch_idx if a.cache_batch_idx is not None else torch.arange(B)
        rows = rows[:, None].expand(B, Ln).flatten().to(dev)
        cols = pos.flatten().to(dev)
        k_cache[rows, cols] = k.flatten(0, 1)
        v_cache[rows, cols] = v.flatten(0, 1)
    return q


# ---------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------

def _reference(a: _Args, q, k_cache, v_cache):
    """(out (B, Lq, Hq, D), lse (B, Hq, Lq)) through the metal_flash.fwd op, per row geometry."""
    B, Lq, Hq, D = q.shape
    dev = q.device
    starts, ends = a.leftpad, a.total
    uniform = bool((starts == starts[0]).all() and (ends == ends[0]).all()) if B else True
    contiguous = not a.paged and a.cache_batch_idx is None
    alibi = a.alibi.expand(B, Hq) if a.alibi is not None else None
    qt = q.transpose(1, 2)  # (B, Hq, Lq, D) view
    if contiguous and (uniform or alibi is None):
        s0 = int(starts.min()) if B else 0
        e0 = int(ends.max()) if B else 0
        kt = k_cache[:B, s0:e0].transpose(1, 2)
        vt = v_cache[:B, s0:e0].transpose(1, 2)
        if uniform:
            lk = e0 - s0
            out, lse = torch.ops.metal_flash.fwd(qt, kt, vt, None, alibi, None, a.scale, lk - Lq, a.left, a.right,
                                                 a.softcap)
        else:
            # Ragged rows: the band of each row relative to its own [start, end), as a bool mask.
            j = torch.arange(s0, e0)[None, None, :]  # absolute positions
            i = torch.arange(Lq)[None, :, None]
            st, en = starts[:, None, None], ends[:, None, None]
            rel = j - st - (i + (en - st) - Lq)
            vis = ((j >= st) & (j < en)).expand(B, Lq, e0 - s0).clone()
            if a.left >= 0:
                vis &= rel >= -a.left
            if a.right >= 0:
                vis &= rel <= a.right
            mask = vis[:, None].to(dev)  # (B, 1, Lq, span)
            out, lse = torch.ops.metal_flash.fwd(qt, kt, vt, mask, None, None, a.scale, 0, -1, -1, a.softcap)
        return out.transpose(1, 2), lse
    # Per batch row: a view of the contiguous cache row, or a gather of the pages.
    outs, lses = [], []
    for b in range(B):
        s, e = int(starts[b]), int(ends[b])
        if a.paged:
            pos = torch.arange(s, e)
            blk = a.block_table_cpu[b][pos // a.page_size].to(dev)
            off = (pos % a.page_size).to(dev)
            kb, vb = k_cache[blk, off][None], v_cache[blk, off][None]
        else:
            row = int(a.cache_batch_idx[b]) if a.cache_batch_idx is not None else b
            kb, vb = k_cache[row:row + 1, s:e], v_cache[row:row + 1, s:e]
        al = alibi[b:b + 1] if alibi is not None else None
        out, lse = torch.ops.metal_flash.fwd(qt[b:b + 1], kb.transpose(1, 2), vb.transpose(1, 2), None, al, None,
                                             a.scale, (e - s) - Lq, a.left, a.right, a.softcap)
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    if B == 0:
        return torch.empty_like(q), torch.empty((0, Hq, Lq), dtype=torch.float32, device=dev)
    return torch.cat(outs), torch.cat(lses)


# ---------------------------------------------------------------------------
# Kernel path
# ---------------------------------------------------------------------------

def _kernels(a: _Args, q, k_cache, v_cache, block_table, cache_batch_idx):
    """Run the decode kernels when the selected backend has them; None = use the reference path."""
    backend = backends.resolve(q.device)
    if backend is None:
        return None
    from .planner.decode import DecodeProblem, plan_decode
    dev = q.device
    B, Lq, Hq, D = q.shape
    out = torch.empty_like(q) if q.is_contiguous() else q.new_empty(q.shape)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    prob = DecodeProblem(
        q=q.transpose(1, 2), k_cache=k_cache, v_cache=v_cache, out=out.transpose(1, 2), lse=lse,
        seqlens_k=a.total.to(torch.int32).to(dev),
        leftpad=a.leftpad.to(torch.int32).to(dev) if bool((a.leftpad != 0).any()) else None,
        batch_idx=None if cache_batch_idx is None else a.cache_batch_idx.to(torch.int32).to(dev),
        block_table=None if block_table is None else block_table.to(torch.int32).contiguous(),
        alibi_slopes=None if a.alibi is None else a.alibi.expand(B, Hq),
        scale=a.scale, window_left=a.left, window_right=a.right, softcap=a.softcap,
        max_seqlen_k=int(a.total.max()) if B else 0, diag_adjust=0)
    plan = plan_decode(prob, num_splits=a.num_splits)
    if isinstance(plan, Unsupported):
        backends.fallback(plan.reason)
        return None
    backend.run(plan)
    backends.record_run(backend.name)
    return out, lse


# ---------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False):
    """Drop-in for ``flash_attn.flash_attn_with_kvcache`` (flash-attn 2 semantics). Inference only.

    If ``k`` and ``v`` are given, they are written into ``k_cache``/``v_cache``
    **in place** at positions ``cache_seqlens[b], cache_seqlens[b] + 1, ...``
    (after rotary embedding of ``k``), then ``q`` attends to the updated cache.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) without
            ``block_table``; (num_blocks, page_block_size, nheads_k, headdim) with
            it (paged cache; any page size).  nheads a multiple of nheads_k (MQA/GQA).
            Same dtype as q (float16, bfloat16, float32; float64 on the reference path).
        k, v: optional (batch, seqlen_new, nheads_k, headdim) new keys/values to append.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2); rotate the first
            rotary_dim features of k at positions cache_seqlens + t, and of q at
            cache_seqlens + i when causal or local (window), else all q rows at
            cache_seqlens.  Requires k and v.
        cache_seqlens: int or (batch,) int32 tensor: the number of keys already in
            each cache row (None: the whole cache).  Keys attended: [cache_leftpad,
            cache_seqlens + seqlen_new).
        cache_batch_idx: optional (batch,) int32: cache row of each batch row
            (default 0..batch-1).  Not with a paged cache.
        cache_leftpad: optional (batch,) int32: where each row's sequence starts in
            the cache (positions before it are ignored; positions for causal,
            window and ALiBi count from it; rotary positions do not).
        block_table: optional (batch, max_blocks_per_seq) int32: pages of each row.
        softmax_scale: default 1 / sqrt(headdim).
        causal: causal mask aligned bottom-right to each row's own key count:
            query i sees keys j <= i + seqlen_k[b] - seqlen_q.
        window_size: (left, right) sliding window, same alignment; -1 = unbounded.
        softcap: > 0 applies softcap * tanh(scores / softcap).
        rotary_interleaved: True pairs features (0,1), (2,3)...; False is GPT-NeoX style.
        alibi_slopes: (nheads,) or (batch, nheads) float32: adds
            -slope * |i + seqlen_k[b] - seqlen_q - j|.
        num_splits: split-K count for the decode kernels (0 = heuristic, 1 = no split).
        return_softmax_lse: also return the float32 (batch, nheads, seqlen_q) log-sum-exp.
    Returns:
        out (batch, seqlen_q, nheads, headdim), and ``softmax_lse`` if asked.
        A row with no visible key gets zeros (lse = +inf).
    """
    a = _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
               num_splits, return_softmax_lse)
    with torch.no_grad():
        q = _append(a, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved)
        res = None
        if a.batch > 0 and a.seqlen_q > 0 and a.heads > 0:
            res = _kernels(a, q, k_cache, v_cache, block_table, cache_batch_idx)
        if res is None:
            res = _reference(a, q, k_cache, v_cache)
    out, lse = res
    return (out, lse) if return_softmax_lse else out
