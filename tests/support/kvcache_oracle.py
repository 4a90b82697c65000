"""An independent implementation of ``flash_attn_with_kvcache`` for the tests.

Written from the flash-attn documentation with explicit loops (per batch row
and head).  In float64 it is the oracle.  The error budget of the rule in
``torch_metal_flash.testing`` comes from :func:`row_problems`: the same cache
update, rotary embedding and per-row key ranges, with q, k, v rounded to the
inputs' dtype, handed over as one attention problem per batch row (this
file's own visibility as a bool mask), whose plain math in that dtype
``torch_metal_flash.testing`` computes identically on every machine.  Apart
from that hand-over it shares no code with ``torch_metal_flash``.

Out-of-range index values follow the kernels' documented rules
(docs/kvcache.md, "Index values"): lengths clamped to [0, capacity], new rows
past the capacity dropped, leftpad clamped to [0, end], rotary positions
clamped to the table, and a cache row or block outside the cache ignored.
For valid values these rules change nothing.
"""
from __future__ import annotations

import math

import torch


def rotate(x, cos, sin, pos, interleaved, stored):
    """x (L, H, D) at positions pos (L,); cos/sin (seqlen_ro, rd/2), all holding values of
    the call's dtypes.  The documented semantics (docs/kvcache.md, as flash-attn's rotary):
    computed in float32 (float64 for float64 rows) and stored in ``stored``, the dtype of
    the rows rotated -- the rotated q and k are that dtype's numbers even in the float64
    oracle.  Returned in x's dtype."""
    ct = torch.float64 if stored == torch.float64 else torch.float32
    half = cos.shape[1]
    out = x.clone()
    for t in range(x.shape[0]):
        p = min(pos[t], cos.shape[0] - 1)
        c, s = cos[p].to(ct), sin[p].to(ct)
        for f in range(half):
            if interleaved:
                a, b = 2 * f, 2 * f + 1
            else:
                a, b = f, f + half
            x0, x1 = x[t, :, a].to(ct), x[t, :, b].to(ct)
            out[t, :, a] = (x0 * c[f] - x1 * s[f]).to(stored).to(x.dtype)
            out[t, :, b] = (x0 * s[f] + x1 * c[f]).to(stored).to(x.dtype)
    return out


def _rows(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
          cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
          window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, dtype=torch.float64,
          append=True, rotary_dtypes=None):
    """``(rows, new k_cache, new v_cache)`` in ``dtype``, the caches updated (copies); ``rows`` has,
    per batch row b, ``(b, qb (Lq, Hq, D), keys (Lk, Hkv, D), vals, vis (Lq, Lk) bool, slopes (Hq,) or None)``.
    ``append=False``: the caches already hold the new rows (as a quantized cache stores
    them); ``k``/``v`` only give their count (and rotary of q its positions).
    ``rotary_dtypes``: the dtypes (q, k) the rotated rows are stored in, when the tensors
    passed are not in the call's dtypes (already cast); default q's and k's own."""
    if rotary_cos is not None and rotary_dtypes is None:
        rotary_dtypes = (q.dtype, q.dtype if k is None else k.dtype)
    cast = (lambda t: None if t is None else t.detach().cpu().to(dtype))
    q, kc, vc, k, v = cast(q), cast(k_cache), cast(v_cache), cast(k), cast(v)
    cos, sin = cast(rotary_cos), cast(rotary_sin)
    B, Lq, Hq, D = q.shape
    Hkv = kc.shape[2]
    paged = block_table is not None
    if paged:
        page = kc.shape[1]
        cap = block_table.shape[1] * page
    else:
        cap = kc.shape[1]
    if cache_seqlens is None:
        seqlens = [cap] * B
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * B
    else:
        seqlens = [int(x) for x in cache_seqlens]
    lp = [0] * B if cache_leftpad is None else [int(x) for x in cache_leftpad]
    rows = list(range(B)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    lnew = 0 if k is None else k.shape[1]
    left, right = window_size
    if causal:
        right = 0
    local = causal or left >= 0 or right >= 0

    def slot(b, p):  # (cache tensor index, row index) of logical position p of batch row b; None: ignored
        ci = int(block_table[b, p // page]) if paged else rows[b]
        if not 0 <= ci < kc.shape[0]:
            return None
        return ci, (p % page if paged else p)

    out = []
    for b in range(B):
        s0 = min(max(seqlens[b], 0), cap)
        end = min(s0 + lnew, cap)
        qb = q[b]
        if k is not None:
            kb = k[b]
            if cos is not None:
                kb = rotate(kb, cos, sin, [s0 + t for t in range(lnew)], rotary_interleaved, rotary_dtypes[1])
                qpos = [s0 + i for i in range(Lq)] if local else [s0] * Lq
                qb = rotate(qb, cos, sin, qpos, rotary_interleaved, rotary_dtypes[0])
            for t in range(end - s0 if append else 0):
                sl = slot(b, s0 + t)
                if sl is not None:
                    kc[sl] = kb[t]
                    vc[sl] = v[b, t]
        start = min(max(lp[b], 0), end)
        if end - start <= 0 or (not paged and slot(b, 0) is None):
            start = end  # no keys
        Lk = end - start
        present = torch.tensor([slot(b, p) is not None for p in range(start, end)], dtype=torch.bool)
        Dv = vc.shape[-1]  # v's head dim may differ from q's and k's
        keys = torch.stack([kc[slot(b, p)] if slot(b, p) else kc.new_zeros(Hkv, D) for p in range(start, end)]) \
            if Lk else kc.new_empty(0, Hkv, D)  # (Lk, Hkv, D)
        vals = torch.stack([vc[slot(b, p)] if slot(b, p) else vc.new_zeros(Hkv, Dv) for p in range(start, end)]) \
            if Lk else vc.new_empty(0, Hkv, Dv)
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        vis = present[None, :].expand(Lq, Lk).clone()
        if left >= 0:
            vis &= j >= i + Lk - Lq - left
        if right >= 0:
            vis &= j <= i + Lk - Lq + right
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        out.append((b, qb, keys, vals, vis, slopes))
    return out, kc, vc


def _scale(q, softmax_scale=None, **_):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def kvcache_attention(q, k_cache, v_cache, dtype=torch.float64, **kw):
    """Returns (out (B, Lq, Hq, Dv), lse (B, Hq, Lq), new k_cache, new v_cache), all in ``dtype``."""
    B, Lq, Hq, D = q.shape
    scale, softcap = _scale(q, **kw), kw.get("softcap", 0.0)
    out = torch.zeros(B, Lq, Hq, v_cache.shape[-1], dtype=dtype)
    lse = torch.full((B, Hq, Lq), math.inf, dtype=dtype)
    rows, kc, vc = _rows(q, k_cache, v_cache, dtype=dtype, **kw)
    for b, qb, keys, vals, vis, slopes in rows:
        Lk = keys.shape[0]
        if Lk == 0:
            continue
        G = Hq // keys.shape[1]
        for h in range(Hq):
            g = h // G
            s = (qb[:, h] @ keys[:, g].T) * scale  # (Lq, Lk)
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            i = torch.arange(Lq)[:, None]
            j = torch.arange(Lk)[None, :]
            if slopes is not None:
                s = s - float(slopes[h]) * (i + Lk - Lq - j).abs().to(dtype)
            s = s.masked_fill(~vis, -math.inf)
            m = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - m[:, None])
            p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))
            out[b, :, h] = p @ vals[:, g]
            lse[b, h] = torch.where(vis.any(-1), m, torch.full_like(m, math.inf))
    return out, lse, kc, vc


def row_problems(q, k_cache, v_cache, dtype, **kw):
    """One AttentionSpec per batch row (q (1, Hq, Lq, D), k/v (1, Hkv, Lk, D), the
    visibility as a bool mask, ALiBi relative to the row's bottom-right corner),
    with every input rotated / stored in ``dtype``: the problems whose plain
    math in ``dtype`` sets the error budget."""
    from torch_metal_flash.problem.spec import make_spec

    specs = []
    for b, qb, keys, vals, vis, slopes in _rows(q, k_cache, v_cache, dtype=dtype, **kw)[0]:
        Lq, Lk = qb.shape[0], keys.shape[0]
        specs.append(make_spec(qb.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
                               vis, None if slopes is None else slopes.to(torch.float64)[None],
                               scale=_scale(q, **kw), diag_offset=Lk - Lq, softcap=kw.get("softcap", 0.0)))
    return specs


def budget(q, k_cache, v_cache, dtype, **kw):
    """(plain out, plain lse, magnitude of out, magnitude of lse) of the rule of
    ``torch_metal_flash.testing`` for a call: each batch row's problem (:func:`row_problems`)
    as plain math in ``dtype`` (for float64: testing.Arith's plain float64), its magnitudes
    from the same problem in float64."""
    from torch_metal_flash.testing.oracle import plain_attention

    rows = [(plain_attention(low, dtype, exact=False), plain_attention(exact, torch.float64).magnitude)
            for low, exact in zip(row_problems(q, k_cache, v_cache, dtype, **kw),
                                  row_problems(q, k_cache, v_cache, torch.float64, **kw))]
    return (torch.cat([r.out for r, _ in rows]).transpose(1, 2), torch.cat([r.lse for r, _ in rows]),
            torch.cat([m["out"] for _, m in rows]).transpose(1, 2), torch.cat([m["lse"] for _, m in rows]))
