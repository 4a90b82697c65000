"""KV-cache problems for the tests: build one (``make_case``), run it on a backend
(``check_call``) and judge it against the independent float64 oracle (kvcache_oracle.py)
with the acceptance rule of oracle.py."""
from __future__ import annotations

import math

import torch

from torch_metal_flash import backends
from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache
import support.kvcache_oracle as kvcache_oracle
from torch_metal_flash.testing.oracle import assert_matches_oracle


DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}


def make_case(seed=0, dtype="f16", B=3, Lq=1, Hq=4, Hkv=2, D=32, cap=40, lnew=0, seqlens="ragged", paged=None,
              batch_idx=False, leftpad=False, rotary=None, causal=False, window=(-1, -1), softcap=0.0,
              alibi=None, scale=None, Dv=None):
    """Keyword arguments for flash_attn_with_kvcache (tensors drawn from ``seed``); ``Dv``: v's head
    dim when it differs from q's and k's ``D``."""
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    kw["q"] = rnd(B, Lq, Hq, D)
    if seqlens == "ragged":
        sl = torch.randint(0, cap - lnew + 1, (B,), generator=g)
        sl[0] = cap - lnew  # full
        if B > 1:
            sl[1] = 0  # empty before the append
        kw["cache_seqlens"] = sl.to(torch.int32)
    elif seqlens == "int":
        kw["cache_seqlens"] = cap - lnew - 3
    elif seqlens is None:
        assert lnew == 0
    if paged:
        npages = cap // paged
        nblocks = B * npages + 3
        kw["k_cache"] = rnd(nblocks, paged, Hkv, D)
        kw["v_cache"] = rnd(nblocks, paged, Hkv, Dv)
        perm = torch.randperm(nblocks, generator=g)[:B * npages]
        kw["block_table"] = perm.reshape(B, npages).to(torch.int32)
    else:
        bc = B + 2 if batch_idx else B
        kw["k_cache"] = rnd(bc, cap, Hkv, D)
        kw["v_cache"] = rnd(bc, cap, Hkv, Dv)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(bc, generator=g)[:B].to(torch.int32)
    if lnew:
        kw["k"] = rnd(B, lnew, Hkv, D)
        kw["v"] = rnd(B, lnew, Hkv, Dv)
    if leftpad:
        sl = kw["cache_seqlens"]
        sl = torch.full((B,), sl, dtype=torch.int32) if isinstance(sl, int) else sl
        kw["cache_leftpad"] = (torch.rand(B, generator=g) * (sl.double() + 1)).floor().clamp(max=sl).to(torch.int32)
    if rotary is not None:
        rd, interleaved = rotary
        ang = torch.rand(cap + Lq, rd // 2, generator=g) * 2 * math.pi
        kw["rotary_cos"] = torch.cos(ang).to(dt)
        kw["rotary_sin"] = torch.sin(ang).to(dt)
        kw["rotary_interleaved"] = interleaved
    if alibi == "h":
        kw["alibi_slopes"] = torch.rand(Hq, generator=g) * 0.3
    elif alibi == "bh":
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=g) * 0.3
    return kw


def check_against_oracle(kw, out, lse=None):
    """The rule of torch_metal_flash.testing on (out, lse) of a flash_attn_with_kvcache
    call: the oracle in float64, the budget from the plain math of each batch row's
    problem in the inputs' dtype.  Returns the oracle's (out, lse, k_cache, v_cache)."""
    dtype = kw["q"].dtype
    ref = kvcache_oracle.kvcache_attention(**kw, dtype=torch.float64)
    plain_out, plain_lse, mag_out, mag_lse = kvcache_oracle.budget(**kw, dtype=dtype)
    assert_matches_oracle("out", out.cpu(), ref[0], plain_out, mag_out, dtype)
    if lse is not None:
        assert_matches_oracle("lse", lse.cpu(), ref[1], plain_lse, mag_lse, dtype)
    return ref


def rotated_rows_exact(kw) -> bool:
    """Whether appended rows equal the oracle's bit for bit.  Rotated rows do when the rows
    and the rotary table are 16-bit: each product x * cos is then exact in float32, so every
    float32 rotation (the kernel's fused multiply-add too) rounds the same sum, once to float32
    and once to the dtype.  With a float32 row or table the kernel's fma may move the last bit."""
    half = (torch.float16, torch.bfloat16)
    return "rotary_cos" not in kw or (kw["k"].dtype in half and kw["rotary_cos"].dtype in half
                                      and kw["rotary_sin"].dtype in half)


def check_call(kw, backend="reference", **extra):
    """Run ours on ``backend`` (on copies of the caches) and compare with the oracle."""
    dtype = kw["q"].dtype
    mine = dict(kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())
    with backends.backend(backend):
        out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True, **extra)
    ref = check_against_oracle(kw, out, lse)
    assert out.shape == kw["q"].shape[:-1] + kw["v_cache"].shape[-1:] and out.dtype == dtype
    assert lse.shape == (kw["q"].shape[0], kw["q"].shape[2], kw["q"].shape[1]) and lse.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32)
    # The cache was updated in place exactly where the oracle writes.
    tol = dict(rtol=0, atol=0) if rotated_rows_exact(kw) else {}
    torch.testing.assert_close(mine["k_cache"], ref[2].to(dtype), **tol)
    torch.testing.assert_close(mine["v_cache"], ref[3].to(dtype), rtol=0, atol=0)
    return out, lse
