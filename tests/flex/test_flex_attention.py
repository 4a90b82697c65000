"""tmf.flex_attention in the emulator (strict: every call on the flex kernels) against torch's
flex_attention on CPU (forward) and the float64 dense definition with autograd (backward)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import and_masks, create_block_mask, or_masks

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch_metal_flash.flex.reference import dense_flex_attention

U32 = 2.0**-24


def causal(b, h, q, kv):
    return q >= kv


def window(n):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < n)
    return mask


def inputs(B, Hq, Hkv, L, S, D, dtype, grad=False, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda H, n, d: torch.randn(B, H, n, d, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return make(Hq, L, D), make(Hkv, S, D), make(Hkv, S, Dv or D)


def budget(got, ref64, plain, name):
    """Error within 2 x the dense float32-accumulated math's (rounded to the dtype) plus a floor."""
    got, ref64, plain = (t.detach().double() for t in (got, ref64, plain))
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite entries differ"
    assert torch.equal(got[~finite], ref64[~finite]), f"{name}: infinities differ"
    if not finite.any():
        return
    err = (got - ref64)[finite].abs().max().item()
    allowed = 2 * (plain - ref64)[finite].abs().max().item() + 64 * U32 * ref64[finite].abs().max().item()
    assert err <= allowed, f"{name}: error {err:.3e} > allowed {allowed:.3e}"


def reference(q, k, v, score_mod, block_mask, scale=None, gqa=False):
    """(float64 result, the dense math in float32 rounded to the dtype) of out and lse."""
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    up = [t.detach().double() for t in (q, k, v)]
    ref = dense_flex_attention(*up, score_mod, mask_mod, scale, gqa)
    plain = dense_flex_attention(*(t.detach() for t in (q, k, v)), score_mod, mask_mod, scale, gqa)
    return ref, plain


# ---------------------------------------------------------------------------
# mods
# ---------------------------------------------------------------------------
def doc_ids(L, cuts, dtype=torch.int64):
    ids = torch.zeros(L, dtype=dtype)
    for c in cuts:
        ids[c:] += 1
    return ids


def make_case(name, L, H):
    """(score_mod, mask_mod) of a named case; captured tensors built for length L and H heads."""
    g = torch.Generator().manual_seed(1)
    if name == "plain":
        return None, None
    if name == "causal":
        return None, causal
    if name == "window":
        return None, window(40)
    if name == "document":
        ids = doc_ids(L, (L // 3, L // 2 + 5))
        return None, lambda b, h, q, kv: ids[q] == ids[kv]
    if name == "document_causal_int32":
        ids = doc_ids(L, (L // 4,), torch.int32)
        return None, and_masks(causal, lambda b, h, q, kv: ids[q] == ids[kv])
    if name == "prefix_lm":
        return None, or_masks(causal, lambda b, h, q, kv: kv < 23)
    if name == "softcap":
        return (lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)), None
    if name == "alibi":
        slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32))
        return (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)), causal
    if name == "relative_bias":
        bias = torch.randn(H, 2 * L - 1, generator=g)
        return (lambda s, b, h, q, kv: s + bias[h, q - kv + L - 1]), None
    if name == "half_bias_where":
        bias = torch.randn(H, L, generator=g).half()
        return (lambda s, b, h, q, kv: torch.where(kv % 7 == 3, -float("inf"), s + bias[h, kv])), None
    if name == "elementwise":
        return (lambda s, b, h, q, kv: torch.maximum(torch.minimum(s, torch.abs(s) * 0.5 + 1.0),
                                                      -torch.sigmoid(s) - torch.log(torch.exp(s * 0.1) + 1.0))), None
    if name == "batch_head":
        return (lambda s, b, h, q, kv: s * (1.0 + 0.25 * b) - 0.125 * h), (lambda b, h, q, kv: (q + kv + h) % 5 != 0)
    raise KeyError(name)


FORWARD_CASES = ["plain", "causal", "window", "document", "document_causal_int32", "prefix_lm", "softcap", "alibi",
                 "relative_bias", "half_bias_where", "elementwise", "batch_head"]


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_forward_matches_torch_flex(name):
    B, H, L, D = 2, 2, 131, 32
    score_mod, mask_mod = make_case(name, L, H)
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="cpu") if mask_mod is not None else None
    q, k, v = inputs(B, H, H, L, L, D, torch.float32)
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    (ref_out, ref_lse), (plain_out, plain_lse) = reference(q, k, v, score_mod, block_mask)
    budget(out, ref_out, plain_out, "out")
    budget(lse, ref_lse, plain_lse, "lse")
    # and torch's own result, to the same budget (both are float32 computations of one definition)
    budget(t_out, ref_out, plain_out, "torch out")
    torch.testing.assert_close(out, t_out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gqa_odd_lengths(dtype):
    B, Hq, Hkv, L, S, D = 1, 4, 2, 77, 150, 64
    score_mod, _ = make_case("relative_bias", 256, Hq)
    mask = lambda b, h, q, kv: (kv <= q + 70) | (h == 1)  # noqa: E731
    block_mask = create_block_mask(mask, 1, Hq, L, S, device="cpu")
    q, k, v = inputs(B, Hq, Hkv, L, S, D, dtype)
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                      return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    (ref_out, ref_lse), (plain_out, plain_lse) = reference(q, k, v, score_mod, block_mask, gqa=True)
    budget(out, ref_out, plain_out, "out")
    budget(lse, ref_lse, plain_lse, "lse")


def grads_of(fn, q, k, v, extra=(), seed=5):
    out, lse = fn()
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g).to(lse.dtype)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    tensors = [t for t in (q, k, v, *extra)]
    return out, lse, torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("name,gqa,dtype", [
    ("causal", False, torch.float32),
    ("softcap", True, torch.float32),
    ("document_causal_int32", False, torch.float32),
    ("alibi", False, torch.float16),
    ("elementwise", False, torch.bfloat16),
])
def test_backward_matches_float64_autograd(name, gqa, dtype):
    B, Hq, L, D = 1, 4, 97, 32
    Hkv = 2 if gqa else Hq
    score_mod, mask_mod = make_case(name, L, Hq)
    block_mask = create_block_mask(mask_mod, 1, 1, L, L, device="cpu") if mask_mod is not None else None
    q, k, v = inputs(B, Hq, Hkv, L, L, D, dtype, grad=True)
    with tmf.backend("emulator", strict=True):
        _, _, got = grads_of(lambda: tmf.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=gqa,
                                                        return_lse=True), q, k, v)
    mm = block_mask.mask_mod if block_mask is not None else None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, _, ref = grads_of(lambda: dense_flex_attention(q64, k64, v64, score_mod, mm, None, gqa), q64, k64, v64)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    _, _, plain = grads_of(lambda: dense_flex_attention(qf, kf, vf, score_mod, mm, None, gqa), qf, kf, vf)
    for n, a, r, p in zip(("dq", "dk", "dv"), got, ref, plain):
        assert a.dtype == dtype
        budget(a, r, p, n)


def test_captured_tensor_gradients():
    B, H, L, D = 1, 2, 70, 32
    bias = torch.randn(H, 2 * L - 1, generator=torch.Generator().manual_seed(3), requires_grad=True)
    slopes = torch.tensor([0.1, -0.2], requires_grad=True)

    def score_mod(s, b, h, q, kv):
        return s + bias[h, q - kv + L - 1] + slopes[h] * (q - kv)

    block_mask = create_block_mask(causal, 1, 1, L, L, device="cpu")
    q, k, v = inputs(B, H, H, L, L, D, torch.float32, grad=True)
    with tmf.backend("emulator", strict=True):
        _, _, got = grads_of(lambda: tmf.flex_attention(q, k, v, score_mod, block_mask, return_lse=True), q, k, v,
                             (bias, slopes))
    with tmf.backend("emulator", strict=True):
        _, _, again = grads_of(lambda: tmf.flex_attention(q, k, v, score_mod, block_mask, return_lse=True), q, k, v,
                               (bias, slopes))
    for a, b in zip(got, again):
        assert torch.equal(a, b)  # deterministic
    b64, s64 = bias.detach().double().requires_grad_(), slopes.detach().double().requires_grad_()

    def score64(s, b, h, q, kv):
        return s + b64[h, q - kv + L - 1] + s64[h] * (q - kv)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, _, ref = grads_of(lambda: dense_flex_attention(q64, k64, v64, score64, causal), q64, k64, v64, (b64, s64))
    bf, sf = bias.detach().requires_grad_(), slopes.detach().requires_grad_()

    def score32(s, b, h, q, kv):
        return s + bf[h, q - kv + L - 1] + sf[h] * (q - kv)

    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    _, _, plain = grads_of(lambda: dense_flex_attention(qf, kf, vf, score32, causal), qf, kf, vf, (bf, sf))
    for n, a, r, p in zip(("dq", "dk", "dv", "dbias", "dslopes"), got, ref, plain):
        budget(a, r, p, n)
    assert got[3][:, :L - 1].abs().max() == 0  # q < kv: masked by the causal mask, no gradient


def test_empty_rows_out_zero_lse_minus_inf_and_no_gradient():
    B, H, L, D = 1, 1, 50, 32
    mask = lambda b, h, q, kv: (q % 3 != 0) & (kv <= q)  # noqa: E731
    block_mask = create_block_mask(mask, 1, 1, L, L, device="cpu")
    q, k, v = inputs(B, H, H, L, L, D, torch.float32, grad=True)
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        out.sum().backward()
    empty = torch.arange(L) % 3 == 0
    assert torch.equal(out[0, 0, empty], torch.zeros(int(empty.sum()), D))
    assert torch.all(lse[0, 0, empty] == -math.inf) and torch.isfinite(lse[0, 0, ~empty]).all()
    assert torch.equal(q.grad[0, 0, empty], torch.zeros(int(empty.sum()), D))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_blocks_outside_the_mask_are_never_loaded():
    L, D = 512, 32
    q, k, v = inputs(1, 1, 1, L, L, D, torch.float16, grad=True)
    block_mask = create_block_mask(window(64), 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    density = 1.0 - block_mask.sparsity() / 100.0

    def streamed(stats, kernel, buffers):
        """Bytes a kernel streams through its inner loop (K/V for forward and dQ, Q/dO for dK/dV)."""
        return sum(s.bytes_read.get(i, 0) for s in stats if kernel in s.kernel for i in buffers)

    def run(bm):
        with emulator.recording() as fwd:
            out = tmf.flex_attention(q, k, v, block_mask=bm)
        with emulator.recording() as bwd:
            out.float().sum().backward()
        return (streamed(fwd, "flash_fwd", (1, 2)), streamed(bwd, "_dq_", (1, 2)),
                streamed(bwd, "_dkv_", (0, 3)))

    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        sparse = run(block_mask)
        dense = run(None)
    for s, d in zip(sparse, dense):
        assert s <= 1.2 * density * d, (s, d, density)


@pytest.mark.parametrize("block_size", [16, (32, 48), 256])
def test_block_sizes_the_kernels_cannot_use_are_remapped(block_size):
    B, H, L, D = 1, 2, 140, 32
    ids = doc_ids(L, (30, 90))
    mask = and_masks(causal, lambda b, h, q, kv: ids[q] == ids[kv])
    block_mask = create_block_mask(mask, 1, H, L, L, device="cpu", BLOCK_SIZE=block_size)
    q, k, v = inputs(B, H, H, L, L, D, torch.float32, grad=True)
    with tmf.backend("emulator", strict=True):
        out = tmf.flex_attention(q, k, v, block_mask=block_mask)
    (ref_out, _), (plain_out, _) = reference(q, k, v, None, block_mask)
    budget(out, ref_out, plain_out, "out")


def test_bitwise_equal_under_two_schedule_orders():
    L, D = 90, 32
    score_mod, mask_mod = make_case("alibi", L, 2)
    block_mask = create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
    results = []
    for order in ("forward", "reverse"):
        q, k, v = inputs(1, 2, 2, L, L, D, torch.float32, grad=True)
        with tmf.backend("emulator", strict=True), emulator.settings(order=order):
            out = tmf.flex_attention(q, k, v, score_mod, block_mask)
            out.square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_flex_override_routes_torch_flex_attention():
    L, D = 64, 32
    q, k, v = inputs(1, 2, 2, L, L, D, torch.float32)
    block_mask = create_block_mask(causal, 1, 1, L, L, device="cpu")
    expected = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
    with tmf.backend("emulator", strict=True), tmf.flex_override():
        assert tmf.is_flex_enabled()
        with emulator.recording() as launches:
            out = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
    assert not tmf.is_flex_enabled()
    assert any(s.kernel.startswith("flash_fwd") for s in launches)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_unsupported_mod_strict_raises_else_falls_back_once():
    L, D = 40, 32
    q, k, v = inputs(1, 1, 1, L, L, D, torch.float32)

    def data_dependent(s, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # Python control flow on a tensor value
            return s
        return s * 2

    with tmf.backend("emulator", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="score_mod.*data-dependent"):
            tmf.flex_attention(q, k, v, score_mod=data_dependent)
    sorted_bias = torch.randn(L)
    sort_mod = lambda s, b, h, q_idx, kv_idx: s + torch.sort(sorted_bias)[0][kv_idx]  # noqa: E731
    with tmf.backend("emulator", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="score_mod.*sort"):
            tmf.flex_attention(q, k, v, score_mod=sort_mod)
    with tmf.backend("emulator", strict=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tmf.flex_attention(q, k, v, score_mod=sort_mod)
    assert any(issubclass(w.category, tmf.FallbackWarning) and "sort" in str(w.message) for w in caught)
    torch.testing.assert_close(out, torch_flex.flex_attention(q, k, v, score_mod=sort_mod), atol=2e-5, rtol=1e-4)


def test_float64_falls_back_to_the_dense_definition():
    q, k, v = inputs(1, 1, 1, 33, 33, 16, torch.float64, grad=True)
    with tmf.backend("emulator", strict=False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tmf.FallbackWarning)
            out, lse = tmf.flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, 33, 33, device="cpu"),
                                          return_lse=True)
    ref, ref_lse = dense_flex_attention(q, k, v, None, causal)
    assert torch.equal(out, ref) and out.dtype == torch.float64
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: tmf.flex_attention(q[0], k, v), "query must be 4-D"),
    (lambda q, k, v: tmf.flex_attention(q, k.half(), v), "one dtype"),
    (lambda q, k, v: tmf.flex_attention(q, k[:, :1], v[:, :1]), "enable_gqa"),
    (lambda q, k, v: tmf.flex_attention(q, k[:, :1], v[:, :1].repeat(1, 3, 1, 1), enable_gqa=True), "agree"),
    (lambda q, k, v: tmf.flex_attention(q, k[..., :16], v), "head dim"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, score_mod=3), "score_mod must be callable"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, block_mask=torch.ones(2, 2)), "block_mask must be"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, 64, 64, device="cpu")),
     "block_mask was created for"),
])
def test_bad_input_names_the_argument(call, match):
    q, k, v = inputs(1, 2, 2, 48, 48, 32, torch.float32)
    with tmf.backend("emulator", strict=True):
        with pytest.raises((ValueError, TypeError), match=match):
            call(q, k, v)
