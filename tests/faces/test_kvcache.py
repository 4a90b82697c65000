"""``flash_attn_with_kvcache`` on the reference path: every argument against an
independent float64 implementation (tests/support/kvcache_oracle.py) with the acceptance
rule of torch_metal_flash/testing/oracle.py, the in-place cache update, and the argument errors."""
from __future__ import annotations

import math

import pytest
import torch

from support.kvcache_cases import check_call, make_case
from torch_metal_flash import backends
from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache
from torch_metal_flash.planner.decode import route_reason
from torch_metal_flash.problem.spec import make_spec

CASES = [
    dict(),
    dict(dtype="f32", Lq=5, causal=True),
    dict(dtype="bf16", Hq=8, Hkv=1, causal=True, lnew=1),  # MQA
    dict(dtype="f16", Hq=4, Hkv=4, lnew=2, Lq=2, causal=True),  # MHA
    dict(dtype="f16", Hq=8, Hkv=1, Lq=5, lnew=5, causal=True, rotary=(16, True)),
    dict(dtype="f32", lnew=3, Lq=3, rotary=(32, False), causal=True),
    dict(dtype="f32", lnew=3, Lq=3, rotary=(8, True)),  # not causal: q rotated at cache_seqlens only
    dict(dtype="f32", lnew=2, Lq=4, rotary=(16, False), window=(6, 0)),  # local: q rotated per row
    dict(dtype="f16", window=(5, 2), Lq=3),
    dict(dtype="f16", window=(4, -1), Lq=1, lnew=1),
    dict(dtype="f32", softcap=3.0, Lq=2, causal=True, scale=0.7),
    dict(dtype="f32", alibi="h", Lq=3, causal=True, lnew=1),
    dict(dtype="bf16", alibi="bh", Lq=2),
    dict(dtype="f32", leftpad=True, Lq=3, causal=True, lnew=2, rotary=(16, True)),
    dict(dtype="f32", leftpad=True, alibi="h", Lq=2, window=(3, 1)),
    dict(dtype="f16", batch_idx=True, lnew=2, Lq=2, causal=True),
    dict(dtype="f16", batch_idx=True, alibi="bh", Lq=1),
    dict(dtype="f16", paged=8, lnew=3, Lq=3, causal=True),
    dict(dtype="bf16", paged=5, lnew=1, Lq=1, rotary=(32, False), causal=True, alibi="h"),
    dict(dtype="f32", paged=4, leftpad=True, Lq=2, window=(7, 0)),
    dict(dtype="f64", Lq=4, causal=True, lnew=4, rotary=(16, True), softcap=2.0),
    dict(dtype="f16", seqlens="int", Lq=2, causal=True, lnew=2),
    dict(dtype="f32", seqlens=None, Lq=3, causal=True),
    dict(dtype="f32", seqlens=None, Lq=3, paged=10),
    dict(dtype="f16", Lq=7, causal=True, D=40, Hq=6, Hkv=3),
    dict(dtype="f32", Lq=50, cap=30, causal=True, seqlens="int", lnew=0),  # more queries than keys
]


@pytest.mark.parametrize("i,case", list(enumerate(CASES)))
def test_matches_oracle(i, case):
    check_call(make_case(seed=100 + i, **case))


def test_lse_not_returned_by_default_and_num_splits_accepted():
    kw = make_case(seed=7, dtype="f32", lnew=1, causal=True)
    with backends.backend("reference"):
        out = flash_attn_with_kvcache(**kw, num_splits=3)
    assert isinstance(out, torch.Tensor) and out.shape == kw["q"].shape


def test_empty_rows_zero_and_inf_lse():
    kw = make_case(seed=8, dtype="f32", B=2, seqlens="ragged", cap=16)
    kw["cache_seqlens"] = torch.tensor([0, 16], dtype=torch.int32)
    with backends.backend("reference"):
        out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == math.inf).all())
    assert torch.isfinite(out[1]).all()


def test_decode_steps_accumulate_like_full_attention():
    """Generating token by token with appends equals causal attention over the whole sequence."""
    g = torch.Generator().manual_seed(9)
    B, L, Hq, Hkv, D = 2, 12, 4, 2, 16
    q, k, v = torch.randn(B, L, Hq, D, generator=g), torch.randn(B, L, Hkv, D, generator=g), \
        torch.randn(B, L, Hkv, D, generator=g)
    kc, vc = torch.zeros(B, L, Hkv, D), torch.zeros(B, L, Hkv, D)
    with backends.backend("reference"):
        outs = [flash_attn_with_kvcache(q[:, t:t + 1], kc, vc, k[:, t:t + 1], v[:, t:t + 1], cache_seqlens=t,
                                        causal=True) for t in range(L)]
        full = flash_attn_with_kvcache(q, torch.zeros_like(kc), torch.zeros_like(vc), k, v, cache_seqlens=0,
                                       causal=True)
    torch.testing.assert_close(torch.cat(outs, 1), full)
    torch.testing.assert_close(kc, k, rtol=0, atol=0)


def _base():
    return make_case(seed=11, dtype="f32", B=2, cap=16, lnew=1, seqlens="ragged")


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda kw: kw.update(q=kw["q"][0]), ValueError, "q: expected a 4-D"),
    (lambda kw: kw.update(q=kw["q"].to(torch.int32)), TypeError, "q: expected dtype"),
    (lambda kw: kw.update(k_cache=kw["k_cache"].half()), ValueError, "expected the same dtype"),
    (lambda kw: kw.update(v_cache=kw["v_cache"][:, :8]), ValueError, "v_cache: expected the shape"),
    (lambda kw: kw.update(k_cache=kw["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     ValueError, "k_cache: expected a contiguous last dimension"),
    (lambda kw: kw.update(k_cache=kw["k_cache"][..., :8], v_cache=kw["v_cache"][..., :8]), ValueError, "head dim"),
    (lambda kw: kw.update(q=torch.randn(2, 1, 3, 32)), ValueError, "multiple of the number of key/value heads"),
    (lambda kw: kw.update(cache_seqlens=torch.tensor([16, 2], dtype=torch.int32)), ValueError,
     r"k, v: appending 1 rows at cache_seqlens\[0\] = 16 overflows the cache"),
    (lambda kw: kw.update(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), ValueError,
     r"cache_seqlens: entry 0 is -1"),
    (lambda kw: kw.update(k=None, v=None, cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)), ValueError,
     r"cache_seqlens: entry 1 is 17, beyond"),
    (lambda kw: kw.update(cache_seqlens=torch.tensor([1.0, 2.0])), TypeError, "cache_seqlens: expected an integer"),
    (lambda kw: kw.update(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     r"cache_seqlens: expected shape \(2,\)"),
    (lambda kw: kw.update(cache_seqlens=None), ValueError, "cache_seqlens: required when new k/v"),
    (lambda kw: kw.update(v=None), ValueError, "k, v: pass both"),
    (lambda kw: kw.update(k=kw["k"][:, :, :1]), ValueError, "k: expected shape"),
    (lambda kw: kw.update(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), IndexError,
     r"cache_batch_idx: entry 1 is 5"),
    (lambda kw: kw.update(cache_leftpad=torch.tensor([0, 99], dtype=torch.int32)), ValueError,
     r"cache_leftpad: entry 1 is 99"),
    (lambda kw: kw.update(rotary_cos=torch.ones(20, 8)), ValueError, "rotary_cos, rotary_sin: pass both"),
    (lambda kw: kw.update(rotary_cos=torch.ones(20, 40), rotary_sin=torch.ones(20, 40)), ValueError,
     "rotary_dim <= head dim"),
    (lambda kw: kw.update(rotary_cos=torch.ones(4, 8), rotary_sin=torch.ones(4, 8)), ValueError,
     "rotary_cos: has 4 positions"),
    (lambda kw: kw.update(k=None, v=None, rotary_cos=torch.ones(20, 8), rotary_sin=torch.ones(20, 8)), ValueError,
     "needs k and v"),
    (lambda kw: kw.update(window_size=(-2, 0)), ValueError, "window_size"),
    (lambda kw: kw.update(softcap=-1.0), ValueError, "softcap"),
    (lambda kw: kw.update(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes: expected shape"),
    (lambda kw: kw.update(num_splits=-1), ValueError, "num_splits"),
    (lambda kw: kw.update(softmax_scale=float("nan")), ValueError, "softmax_scale"),
])
@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_errors(mutate, exc, match, backend, monkeypatch):
    """The reference path checks index values always; the kernel path in debug mode."""
    kw = _base()
    mutate(kw)
    if backend != "reference":
        monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
    with backends.backend(backend), pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kw)


def test_paged_errors():
    kw = make_case(seed=12, dtype="f32", B=2, cap=16, paged=4, lnew=1)
    bt = kw["block_table"].clone()
    bt[1, 0] = 99
    with pytest.raises(IndexError, match=r"block_table: entry \[1, 0\] is 99, outside the pool"):
        flash_attn_with_kvcache(**dict(kw, block_table=bt))
    with pytest.raises(ValueError, match="cache_batch_idx: not supported together with a paged cache"):
        flash_attn_with_kvcache(**dict(kw, cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="block_table: expected 2 rows"):
        flash_attn_with_kvcache(**dict(kw, block_table=bt[:1]))
    # Unused entries past each row's pages may hold anything (e.g. -1).
    bt = kw["block_table"].clone()
    kw["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    bt[:, 2:] = -1
    check_call(dict(kw, block_table=bt))


def test_decode_route_reason():
    q = torch.randn(1, 32, 1, 128)
    k = torch.randn(1, 8, 4096, 128)

    def reason(q, k, mask=None):
        return route_reason(make_spec(q, k, k, mask, scale=0.1))
    assert reason(q, k) is None
    assert reason(q, k, mask=torch.ones(1, dtype=torch.bool)) is None  # the decode kernels read masks
    assert "key length" in reason(q, k[:, :, :10])
    assert "query rows per KV head" in reason(torch.randn(1, 32, 100, 128), k)
