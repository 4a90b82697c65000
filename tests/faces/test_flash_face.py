"""flash_attn_func (and the packed variants) against an independent float64
implementation written here from the flash-attn 2 documentation."""
import math

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import assert_matches_oracle, check_backward, check_forward, plain_attention


def naive_flash_attn(q, k, v, dtype, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None):
    """Materialised attention in ``dtype``; q (B, Lq, H, D), k/v (B, Lk, Hk, D)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, Lq, H, D = q.shape
    Lk, Hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hk, dim=2)
    v = v.repeat_interleave(H // Hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(D)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(Lq).view(-1, 1) + (Lk - Lq)  # bottom-right alignment
    col = torch.arange(Lk).view(1, -1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).view(-1 if alibi_slopes.dim() == 2 else 1, H, 1, 1)
        s = s - slopes * (row - col).abs().to(dtype)
    left, right = window_size
    if causal:
        right = 0
    # flash-attn's mha_fwd: a window side >= seqlen_k is unbounded
    left, right = (-1 if w >= Lk else w for w in (left, right))
    hidden = torch.zeros(Lq, Lk, dtype=torch.bool)
    if left >= 0:
        hidden |= col < row - left
    if right >= 0:
        hidden |= col > row + right
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, torch.where(torch.isneginf(lse), math.inf, lse)


def plain_budget(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
    """(plain attention in q's dtype, magnitudes) of the same problem (torch_metal_flash.testing),
    out as (B, Lq, H, D)."""
    Lq, Lk, D = q.shape[1], k.shape[1], q.shape[3]
    left, right = window_size
    alibi = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[2])
    spec = make_spec(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, alibi,
                     scale=softmax_scale if softmax_scale is not None else D ** -0.5, diag_offset=Lk - Lq,
                     window_left=left, window_right=0 if causal else right, softcap=softcap)
    low, exact = plain_attention(spec, q.dtype), plain_attention(spec, torch.float64)
    return (low.out.transpose(1, 2), low.lse), (exact.magnitude["out"].transpose(1, 2), exact.magnitude["lse"])


CASES = [
    dict(),
    dict(causal=True),
    dict(window_size=(5, 3)),
    dict(window_size=(7, 0)),
    dict(causal=True, window_size=(4, -1)),
    dict(window_size=(-1, 2)),
    dict(softcap=3.0),
    dict(causal=True, softcap=1.5),
    dict(alibi="heads"),
    dict(alibi="batch", causal=True),
    dict(softmax_scale=0.2),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 17), (3, 17), (17, 3), (113, 203), (203, 113), (129, 129)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flash_attn_func(dtype, lq, lk, case):
    kw = dict(CASES[case])
    g = torch.Generator().manual_seed(1000 * case + lq + lk)
    B, H, Hk, D = 2, 4, 2, 24
    q = torch.randn(B, lq, H, D, generator=g).to(dtype)
    k = torch.randn(B, lk, Hk, D, generator=g).to(dtype)
    v = torch.randn(B, lk, Hk, D, generator=g).to(dtype)
    alibi = kw.pop("alibi", None)
    if alibi:
        kw["alibi_slopes"] = torch.rand(H if alibi == "heads" else (B, H), generator=g)
    out, lse, probs = tmf.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert probs is None and out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, H, lq) and lse.dtype == torch.float32
    ref_out, ref_lse = naive_flash_attn(q, k, v, torch.float64, **kw)
    (low_out, low_lse), (mag_out, mag_lse) = plain_budget(q, k, v, **kw)
    assert_matches_oracle("out", out, ref_out, low_out, mag_out, dtype)
    assert_matches_oracle("lse", lse, ref_lse, low_lse, mag_lse, dtype)


def test_rows_outside_the_band_are_zero_with_inf_lse():
    # Lq > Lk with bottom-right causal: the first Lq - Lk rows see nothing.
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse, _ = tmf.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isposinf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_packed_variants():
    torch.manual_seed(0)
    qkv = torch.randn(2, 11, 3, 4, 16)
    expect = tmf.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    torch.testing.assert_close(tmf.flash_attn_qkvpacked_func(qkv, causal=True), expect)
    torch.testing.assert_close(tmf.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True), expect)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 2), softcap=2.0), dict(alibi=True)])
def test_gradients_against_float64(kw):
    kw = dict(kw)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 13, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 13, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4, generator=g)
    dout = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(tmf.flash_attn_func(q, k, v, **kw), (q, k, v), dout)
    ref = torch.autograd.grad(naive_flash_attn(q, k, v, torch.float64, **kw)[0], (q, k, v), dout)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,dv", [(24, 40), (64, 32), (192, 128)])
def test_value_head_dim_differs_forward_and_backward_on_the_kernels(dtype, d, dv):
    """v may have its own head dim (flash-attn 3; DeepSeek prefill is 192/128): out and dv take
    v's, dq and dk q's; all on the kernels, against the float64 oracle."""
    g = torch.Generator().manual_seed(d * 1000 + dv)
    B, Lq, Lk, H, Hk = 2, 21, 34, 4, 2
    q = torch.randn(B, Lq, H, d, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(B, Lk, Hk, d, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(B, Lk, Hk, dv, generator=g).to(dtype).requires_grad_(True)
    dout = torch.randn(B, Lq, H, dv, generator=g).to(dtype)
    with tmf.backend("emulator", strict=True):
        out, lse, _ = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == (B, Lq, H, dv) and [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    spec = make_spec(q.detach().transpose(1, 2), k.detach().transpose(1, 2), v.detach().transpose(1, 2), None, None,
                     scale=d ** -0.5, diag_offset=Lk - Lq, window_left=-1, window_right=0)
    check_forward(spec, out.transpose(1, 2), lse)
    check_backward(spec, dout.transpose(1, 2), None, [t.transpose(1, 2) for t in grads] + [None, None])


def test_value_head_dim_differs_in_the_varlen_face():
    """The varlen face takes v with its own head dim, as the per-sequence calls do."""
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 0, 17, 1], [5, 4, 9, 1]
    q = torch.randn(sum(lens_q), 4, 48, generator=g).half()
    k = torch.randn(sum(lens_k), 2, 48, generator=g).half()
    v = torch.randn(sum(lens_k), 2, 16, generator=g).half()
    cu_q = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 18, 19], dtype=torch.int32)
    with tmf.backend("emulator", strict=True):
        out = tmf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 9, causal=True)
        assert out.shape == (q.shape[0], 4, 16)
        for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            if b > a:
                one = tmf.flash_attn_func(q[None, a:b], k[None, c:e], v[None, c:e], causal=True)
                torch.testing.assert_close(out[a:b], one[0], rtol=0, atol=0)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_varlen_matches_per_sequence_oracle(causal, window):
    g = torch.Generator().manual_seed(11)
    lens_q, lens_k = [3, 0, 17, 1], [5, 4, 9, 1]
    H, Hk, D = 4, 2, 16
    q = torch.randn(sum(lens_q), H, D, generator=g, requires_grad=True)
    k = torch.randn(sum(lens_k), Hk, D, generator=g, requires_grad=True)
    v = torch.randn(sum(lens_k), Hk, D, generator=g, requires_grad=True)
    cu_q = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 18, 19], dtype=torch.int32)
    out, lse, _ = tmf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 9, causal=causal, window_size=window,
                                             return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    expect = torch.cat([naive_flash_attn(q[None, a:b], k[None, c:d], v[None, c:d], torch.float64, causal=causal,
                                         window_size=window)[0][0]
                        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])])
    torch.testing.assert_close(out, expect.float(), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("where", ["reference", "kernels in debug mode"])
def test_varlen_errors(where, monkeypatch):
    """Shapes and dtypes are checked on every call; the index values on the host by the
    reference path and, with TORCH_METAL_FLASH_DEBUG=1, before the kernels run (else the
    kernels read them on the GPU only)."""
    q, k = torch.randn(5, 2, 8), torch.randn(6, 2, 8)
    good_q, good_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    if where == "reference":
        context = tmf.backend("reference")
    else:
        monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
        context = tmf.backend("emulator", strict=True)
    with context:
        with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets from 0 to 5"):
            tmf.flash_attn_varlen_func(q, k, k, torch.tensor([0, 4], dtype=torch.int32), good_k, 5, 6)
        with pytest.raises(ValueError, match="cu_seqlens_k: a sequence is longer than the max_seqlen"):
            tmf.flash_attn_varlen_func(q, k, k, good_q, good_k, 5, 3)
        with pytest.raises(ValueError, match=r"seqused_k: expected values in \[0, sequence length\]"):
            tmf.flash_attn_varlen_func(q, k, k, good_q, good_k, 5, 6, seqused_k=torch.tensor([7], dtype=torch.int32))
        with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32"):
            tmf.flash_attn_varlen_func(q, k, k, good_q.float(), good_k, 5, 6)
        with pytest.raises(ValueError, match="cu_seqlens_k: expected length equal to cu_seqlens_q's 2, got 3"):
            tmf.flash_attn_varlen_func(q, k, k, good_q, torch.tensor([0, 3, 6], dtype=torch.int32), 5, 6)
        with pytest.raises(ValueError, match="max_seqlen_q: expected an int >= 0"):
            tmf.flash_attn_varlen_func(q, k, k, good_q, good_k, torch.tensor(5), 6)


def test_window_wider_than_keys_is_unbounded_like_upstream():
    """A window side >= seqlen_k means "unbounded" in every flash-attn face (upstream clamps
    it to -1 in mha_fwd / mha_varlen_fwd / mha_fwd_kvcache); with seqlen_q > seqlen_k + 1 the literal
    band would hide keys from the first rows.  flash_attn_func, varlen and kvcache must agree."""
    g = torch.Generator().manual_seed(16)
    q = torch.randn(1, 8, 1, 16, generator=g)
    k = torch.randn(1, 4, 1, 16, generator=g)
    v = torch.randn(1, 4, 1, 16, generator=g)
    ours = tmf.flash_attn_func(q, k, v, window_size=(-1, 5))
    unbounded = naive_flash_attn(q, k, v, torch.float64)[0]
    torch.testing.assert_close(ours, unbounded.float(), atol=1e-6, rtol=1e-6)
    cache = tmf.flash_attn_with_kvcache(q, k.clone(), v.clone(), window_size=(-1, 5))
    torch.testing.assert_close(cache, ours, atol=1e-6, rtol=1e-6)
    cu_q, cu_k = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    packed = tmf.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 8, 4, window_size=(-1, 5))
    torch.testing.assert_close(packed, ours[0], atol=1e-6, rtol=1e-6)
    # varlen clamps against the batch's max_seqlen_k, not each sequence's own length
    q2 = torch.randn(9, 1, 16, generator=g)
    k2 = torch.randn(5, 1, 16, generator=g)
    cu_q2, cu_k2 = torch.tensor([0, 8, 9], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32)
    got = tmf.flash_attn_varlen_func(q2, k2, k2, cu_q2, cu_k2, 8, 4, window_size=(-1, 1))
    # sequence 0 (8 queries, 1 key): right window 1 < max_seqlen_k stays, so row i sees key 0 only
    # when 0 <= i + (1 - 8) + 1, i.e. rows 6 and 7 (which then output that key's value)
    assert torch.equal(got[:6], torch.zeros_like(got[:6]))
    torch.testing.assert_close(got[6:8], k2[:1].expand(2, 1, 16), atol=1e-6, rtol=1e-6)
