"""The kernels on a real Apple GPU: ``mps`` tensors through the Metal launcher
(``torch_metal_flash._C``) against the float64 oracle on the CPU.

Runs on macOS with MPS only; skipped elsewhere (our CI has no Mac, the emulator
tests cover the same kernels there).  Every call runs in strict mode
(``backend("metal", strict=True)``) so that a silent fallback to the reference
path fails the test instead of passing it.

Acceptance rule (torch_metal_flash/testing/oracle.py, in short): ``max|out - ref64| <= 2 * max|lowp - ref64|
+ atol``, where ``ref64`` is plain PyTorch math in float64 on the CPU and
``lowp`` the same plain math in the inputs' dtype, computed by
``torch_metal_flash.testing.plain_attention`` (the same numbers on every
machine; torch's own low-precision CPU math would depend on the Mac's BLAS).
The oracle here is a deliberately naive implementation (``naive_attention``),
independent of the package.

Full matrix: ``pytest tests/kernels/test_mps.py`` (a few minutes on an M-series Mac);
``-k "not matrix"`` for the quick part.
"""
from __future__ import annotations

import importlib
import itertools
import math
import re
import struct
import textwrap
import zlib

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import Arith, plain_attention

pytestmark = pytest.mark.skipif(
    not torch.backends.mps.is_available(),
    reason="needs macOS with an MPS (Apple-silicon) GPU; the emulator tests cover the kernels elsewhere")

MPS = torch.device("mps")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)
SEQ_PAIRS = ((1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (127, 512), (1000, 1000), (257, 129))
# atol of the rule, relative to the reference's magnitude (max(1, max|ref|)).
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def seed_of(*parts) -> int:
    """A deterministic seed per case (Python's hash() of str is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


def strict_metal():
    return tmf.backend("metal", strict=True)


def backward_available() -> bool:
    try:
        importlib.import_module("torch_metal_flash.planner.backward")
    except ImportError:
        return False
    return True


needs_backward = pytest.mark.skipif(not backward_available(), reason="the backward kernels are not written yet")


# ---------------------------------------------------------------------------
# The oracle: naive attention with plain torch ops (autograd-able).
# ---------------------------------------------------------------------------

def naive_attention(q, k, v, *, scale, mask=None, diag_offset=0, window_left=-1, window_right=-1, softcap=0.0,
                    alibi=None, sinks=None):
    """(out, lse) for (B, Hq, L, D) tensors, in q's dtype, on q's device.

    Semantics of :mod:`torch_metal_flash.problem.spec`: softcap, then ALiBi, then a
    float mask is added / a bool mask hides; the band hides keys outside
    ``[i + diag_offset - window_left, i + diag_offset + window_right]``; sinks
    add one logit per head to the denominator; rows with nothing visible give
    out = 0 and lse = +inf.
    """
    dt = q.dtype
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hq != Hkv:  # fine for an oracle: copies are what the kernels avoid
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Lq).view(Lq, 1)
    j = torch.arange(Lk).view(1, Lk)
    if alibi is not None:
        slopes = alibi.to(dt).expand(B, Hq).reshape(B, Hq, 1, 1)
        s = s - slopes * (i + diag_offset - j).abs().to(dt)
    visible = torch.ones(Lq, Lk, dtype=torch.bool)
    if window_left >= 0:
        visible = visible & (j >= i + diag_offset - window_left)
    if window_right >= 0:
        visible = visible & (j <= i + diag_offset + window_right)
    visible = visible.expand(B, Hq, Lq, Lk)
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            s = s + mask.to(dt)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(dt).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    p = torch.exp(s - m)
    den = p.sum(dim=-1, keepdim=True)
    empty = den == 0
    lse = torch.where(empty, torch.full_like(den, float("inf")), m + torch.log(torch.where(empty, 1, den)))
    p = p[..., :Lk] / torch.where(empty, torch.ones_like(den), den)
    return p @ v, lse.squeeze(-1)


def assert_rule(name, got, ref64, lowp):
    """max|got - ref64| <= 2 * max|lowp - ref64| + atol; non-finite entries must match exactly."""
    dtype = lowp.dtype
    got, ref64, lowp = (t.detach().to("cpu", torch.float64) for t in (got, ref64, lowp))
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite entries differ from the reference"
    assert torch.equal(got[~finite], ref64[~finite]), f"{name}: infinities differ from the reference"
    if not finite.any():
        return
    err = (got - ref64)[finite].abs().max().item()
    base = (lowp - ref64)[finite].abs().max().item()
    atol = ATOL.get(dtype, 1e-5) * max(1.0, ref64[finite].abs().max().item())
    assert err <= 2 * base + atol, (f"{name}: max error {err:.3e} > allowed {2 * base + atol:.3e} "
                                    f"(2 x {base:.3e} low-precision math error + atol {atol:.1e})")


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def make_qkv(B, Hq, Hkv, Lq, Lk, D, dtype, seed=0, layout="bhld"):
    """CPU tensors; (B, H, L, D) or flash-attn (B, L, H, D)."""
    if layout == "blhd":
        return (randn(B, Lq, Hq, D, dtype=dtype, seed=seed), randn(B, Lk, Hkv, D, dtype=dtype, seed=seed + 1),
                randn(B, Lk, Hkv, D, dtype=dtype, seed=seed + 2))
    return (randn(B, Hq, Lq, D, dtype=dtype, seed=seed), randn(B, Hkv, Lk, D, dtype=dtype, seed=seed + 1),
            randn(B, Hkv, Lk, D, dtype=dtype, seed=seed + 2))


def plain_spec(q, k, v, *, scale, mask=None, diag_offset=0, window_left=-1, window_right=-1, softcap=0.0,
               alibi=None, sinks=None):
    """The problem of ``naive_attention``'s arguments as an AttentionSpec."""
    alibi = None if alibi is None else alibi.expand(q.shape[0], q.shape[1])
    return make_spec(q, k, v, mask, alibi, sinks, scale=scale, diag_offset=diag_offset, window_left=window_left,
                     window_right=window_right, softcap=softcap)


def oracle(q, k, v, **kw):
    """(ref64, lowp) (out, lse) for CPU inputs in (B, H, L, D): naive_attention in
    float64, and the plain math of the same problem in the inputs' dtype."""
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    ref = naive_attention(q.double(), k.double(), v.double(), **f64)
    low = plain_attention(plain_spec(q, k, v, **kw), q.dtype)
    return ref, (low.out.to(q.dtype), low.lse.to(q.dtype))


def batch_heads(lq, lk):
    return (1, 2) if lq * lk > 200_000 else (2, 2)


# ---------------------------------------------------------------------------
# The forward matrix: dtype x head dim x (Lq, Lk) x causal alignment.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", ["none", "sdpa_top_left", "flash_bottom_right"])
@pytest.mark.parametrize("lq,lk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dt", list(DTYPES))
def test_forward_matrix(dt, d, lq, lk, causal):
    dtype = DTYPES[dt]
    B, H = batch_heads(lq, lk)
    seed = seed_of(dt, d, lq, lk, causal)
    scale = d ** -0.5
    if causal == "flash_bottom_right":
        q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed, layout="blhd")
        with strict_metal():
            out, lse, _ = tmf.flash_attn_func(q.to(MPS), k.to(MPS), v.to(MPS), causal=True, return_attn_probs=True)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        (ref, ref_lse), (low, low_lse) = oracle(qt, kt, vt, scale=scale, window_right=0, diag_offset=lk - lq)
        assert_rule("out", out.transpose(1, 2), ref, low)
        assert_rule("lse", lse, ref_lse, low_lse)
    elif causal == "sdpa_top_left":
        q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed)
        with strict_metal():
            out = tmf.scaled_dot_product_attention(q.to(MPS), k.to(MPS), v.to(MPS), is_causal=True)
        (ref, _), (low, _) = oracle(q, k, v, scale=scale, window_right=0)
        assert_rule("out", out, ref, low)
    else:
        q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed)
        with strict_metal():
            out, lse, _ = torch.ops.metal_flash.fwd(q.to(MPS), k.to(MPS), v.to(MPS), None, None, None, scale, 0, -1,
                                                    -1, 0.0, False)
        (ref, ref_lse), (low, low_lse) = oracle(q, k, v, scale=scale)
        assert_rule("out", out, ref, low)
        assert_rule("lse", lse, ref_lse, low_lse)


# ---------------------------------------------------------------------------
# Features: GQA, windows, softcap, ALiBi, sinks, bool/float masks with
# broadcasting, empty rows, everything at once.
# ---------------------------------------------------------------------------

FEATURE_SEQS = ((1, 239), (113, 203), (257, 129), (128, 217))
FEATURES = ("gqa_4_1", "gqa_6_3", "window", "window_causal", "softcap", "alibi_h", "alibi_bh", "sinks",
            "bool_full", "bool_key_padding", "bool_empty_rows", "float_full", "float_heads", "float_2d", "all")


def _run_feature(feature, dtype, d, lq, lk, seed):
    """Runs one feature case on MPS; returns [(name, got, ref64, lowp)]."""
    scale = d ** -0.5
    B, H = 2, 4
    if feature.startswith("gqa"):
        hq, hkv = (4, 1) if feature == "gqa_4_1" else (6, 3)
        q, k, v = make_qkv(B, hq, hkv, lq, lk, d, dtype, seed)
        with strict_metal():
            out = tmf.scaled_dot_product_attention(q.to(MPS), k.to(MPS), v.to(MPS), enable_gqa=True)
        (ref, _), (low, _) = oracle(q, k, v, scale=scale)
        return [("out", out, ref, low)]
    if feature in ("window", "window_causal", "softcap", "alibi_h", "alibi_bh"):
        q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed, layout="blhd")
        kw, okw = {}, {"diag_offset": lk - lq}
        if feature == "window":
            kw["window_size"] = (17, 5)
            okw.update(window_left=17, window_right=5)
        if feature == "window_causal":
            kw.update(window_size=(40, -1), causal=True)
            okw.update(window_left=40, window_right=0)
        if feature == "softcap":
            kw["softcap"] = 3.0
            okw["softcap"] = 3.0
        if feature.startswith("alibi"):
            shape = (H,) if feature == "alibi_h" else (B, H)
            slopes = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3
            kw["alibi_slopes"] = slopes.to(MPS)
            okw["alibi"] = slopes
        with strict_metal():
            out, lse, _ = tmf.flash_attn_func(q.to(MPS), k.to(MPS), v.to(MPS), return_attn_probs=True, **kw)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        (ref, ref_lse), (low, low_lse) = oracle(qt, kt, vt, scale=scale, **okw)
        return [("out", out.transpose(1, 2), ref, low), ("lse", lse, ref_lse, low_lse)]
    if feature in ("sinks", "all"):
        q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed)
        g = torch.Generator().manual_seed(seed + 7)
        sinks = torch.randn(H, generator=g, dtype=torch.float64).to(dtype)
        args = dict(mask=None, alibi=None, diag_offset=0, window_left=-1, window_right=-1, softcap=0.0)
        if feature == "all":
            args.update(mask=torch.randn(1, H, lq, lk, generator=g, dtype=torch.float64).to(dtype),
                        alibi=torch.rand(B, H, generator=g) * 0.2, diag_offset=lk - lq, window_left=50,
                        window_right=0, softcap=2.5)
        dev = {n: (t.to(MPS) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
        with strict_metal():
            out, lse, _ = torch.ops.metal_flash.fwd(
                q.to(MPS), k.to(MPS), v.to(MPS), None if dev["mask"] is None else dev["mask"].expand(B, H, lq, lk),
                dev["alibi"], sinks.to(MPS), scale, dev["diag_offset"], dev["window_left"], dev["window_right"],
                dev["softcap"], False)
        (ref, ref_lse), (low, low_lse) = oracle(q, k, v, scale=scale, sinks=sinks, **args)
        return [("out", out, ref, low), ("lse", lse, ref_lse, low_lse)]
    # masks through the SDPA face (broadcast shapes, never expanded in memory)
    q, k, v = make_qkv(B, H, H, lq, lk, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 3)
    if feature == "bool_full":
        mask = torch.rand(B, H, lq, lk, generator=g) > 0.3
    elif feature == "bool_key_padding":
        mask = (torch.arange(lk) < max(1, lk - 11)).view(1, 1, 1, lk).expand(B, 1, 1, lk).clone()
        mask[1, 0, 0, : lk // 2] = False
    elif feature == "bool_empty_rows":  # rows with no visible key must give zeros, never NaN
        mask = torch.rand(B, 1, lq, lk, generator=g) > 0.5
        mask[:, :, ::3] = False
    elif feature == "float_full":
        mask = torch.randn(B, H, lq, lk, generator=g, dtype=torch.float64).to(dtype)
    elif feature == "float_heads":
        mask = torch.randn(1, H, 1, lk, generator=g, dtype=torch.float64).to(dtype)
    elif feature == "float_2d":
        mask = torch.randn(lq, lk, generator=g, dtype=torch.float64).to(dtype)
    else:
        raise ValueError(feature)
    with strict_metal():
        out = tmf.scaled_dot_product_attention(q.to(MPS), k.to(MPS), v.to(MPS), attn_mask=mask.to(MPS))
    (ref, _), (low, _) = oracle(q, k, v, scale=scale, mask=mask.expand(B, H, lq, lk))
    results = [("out", out, ref, low)]
    if feature == "bool_empty_rows":
        assert not torch.isnan(out.cpu()).any(), "empty rows produced NaN"
        assert (out.cpu()[:, :, ::3] == 0).all(), "empty rows must be zero"
    return results


@pytest.mark.parametrize("lq,lk", FEATURE_SEQS, ids=[f"{a}x{b}" for a, b in FEATURE_SEQS])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("d", (64, 72, 128))
@pytest.mark.parametrize("dt", list(DTYPES))
def test_forward_features_matrix(dt, d, feature, lq, lk):
    seed = seed_of(dt, d, feature, lq, lk)
    for name, got, ref, low in _run_feature(feature, DTYPES[dt], d, lq, lk, seed):
        assert_rule(f"{feature}/{name}", got, ref, low)


def test_large_logits_do_not_overflow():
    """Scores of +-1e4 (fp32) and +-6e4 * scale (fp16) stay finite."""
    for dtype, amp in ((torch.float32, 100.0), (torch.float16, 15.0)):
        q, k, v = make_qkv(1, 2, 2, 64, 80, 64, torch.float64, seed=5)
        q, k = (q * amp).to(dtype), (k * amp).to(dtype)
        v = v.to(dtype)
        with strict_metal():
            out, lse, _ = torch.ops.metal_flash.fwd(q.to(MPS), k.to(MPS), v.to(MPS), None, None, None, 1.0, 0, -1, -1,
                                                    0.0, False)
        assert torch.isfinite(out.cpu()).all() and torch.isfinite(lse.cpu()).all()
        (ref, ref_lse), (low, low_lse) = oracle(q, k, v, scale=1.0)
        if torch.isfinite(low).all() and torch.isfinite(low_lse).all():
            assert_rule("out", out, ref, low)
            assert_rule("lse", lse, ref_lse, low_lse)
        else:  # the plain low-precision math itself overflowed: compare with the oracle only
            assert (out.cpu().double() - ref).abs().max() <= 1e-2 * max(1.0, ref.abs().max().item())


# ---------------------------------------------------------------------------
# Backward: loss.backward() gradients against the float64 oracle's.
# ---------------------------------------------------------------------------

BWD_SEQS = ((1, 239), (113, 203), (128, 217), (257, 129), (127, 512))
BWD_CASES = ("plain", "sdpa_causal", "flash_causal", "gqa", "window", "softcap", "alibi", "float_mask_grad",
             "bool_mask", "sinks_grad")


def _backward_case(case, dtype, d, lq, lk, seed):
    """Returns (grads on MPS, grads of ref64, grads of lowp), each a dict name -> tensor (B, H, L, D) indexed."""
    scale = d ** -0.5
    B, H, Hkv = 2, 4, (2 if case == "gqa" else 4)
    layout = "blhd" if case in ("flash_causal", "window", "softcap", "alibi") else "bhld"
    q, k, v = make_qkv(B, H, Hkv, lq, lk, d, dtype, seed, layout=layout)
    g = torch.Generator().manual_seed(seed + 11)
    dout = randn(*q.shape[:-1], d, dtype=dtype, seed=seed + 12)
    extra = {}
    okw = {}
    if case == "alibi":
        slopes = torch.rand(H, generator=g) * 0.3
        extra["alibi_slopes"], okw["alibi"] = slopes, slopes
    if case == "float_mask_grad":
        extra["mask"] = randn(1, H, lq, lk, dtype=dtype, seed=seed + 13)
    if case == "bool_mask":
        extra["mask"] = torch.rand(B, 1, lq, lk, generator=g) > 0.3
    if case == "sinks_grad":
        extra["sinks"] = randn(H, dtype=dtype, seed=seed + 14)

    def run(dev, dt, use_kernels):
        leaves = {n: t.to(dev, dt).detach().requires_grad_(True) for n, t in (("q", q), ("k", k), ("v", v))}
        if "mask" in extra and extra["mask"].is_floating_point():
            leaves["mask"] = extra["mask"].to(dev, dt).detach().requires_grad_(True)
        if "sinks" in extra:
            leaves["sinks"] = extra["sinks"].to(dev, dt).detach().requires_grad_(True)
        mask = leaves.get("mask", extra["mask"].to(dev) if "mask" in extra else None)
        qq, kk, vv = leaves["q"], leaves["k"], leaves["v"]
        if use_kernels:
            with strict_metal():
                if case in ("flash_causal", "window", "softcap", "alibi"):
                    kw = dict(causal=case == "flash_causal")
                    if case == "window":
                        kw["window_size"] = (20, 3)
                    if case == "softcap":
                        kw["softcap"] = 3.0
                    if case == "alibi":
                        kw["alibi_slopes"] = extra["alibi_slopes"].to(dev)
                    out = tmf.flash_attn_func(qq, kk, vv, **kw)
                elif case == "sinks_grad":
                    out, _, _ = torch.ops.metal_flash.fwd(qq, kk, vv, None, None, leaves["sinks"], scale, 0, -1, -1,
                                                          0.0, True)
                else:
                    out = tmf.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=case == "sdpa_causal",
                                                           enable_gqa=case == "gqa")
        else:
            out, _ = naive_attention(t(qq), t(kk), t(vv), scale=scale, **naive_kw(mask, leaves.get("sinks")))
            out = t(out)
        (out * dout.to(dev, dt)).sum().backward()
        return {n: leaf.grad for n, leaf in leaves.items()}

    t = (lambda x: x.transpose(1, 2)) if layout == "blhd" else (lambda x: x)

    def naive_kw(mask, sinks):
        kw = dict(okw)
        if layout == "blhd":  # the flash-attn face aligns everything bottom-right (ALiBi distances too)
            kw["diag_offset"] = lk - lq
        if case in ("flash_causal", "sdpa_causal"):
            kw.update(window_right=0)
        if case == "window":
            kw.update(window_left=20, window_right=3)
        if case == "softcap":
            kw["softcap"] = 3.0
        if mask is not None:
            kw["mask"] = mask.expand(B, H, lq, lk)
        if sinks is not None:
            kw["sinks"] = sinks
        return kw

    def plain_grads():
        """The plain math's gradients in ``dtype`` (torch_metal_flash.testing), like run()'s."""
        mask = extra.get("mask")
        spec = plain_spec(t(q), t(k), t(v), scale=scale, **naive_kw(mask, extra.get("sinks")))
        dbias = mask is not None and mask.is_floating_point()
        res = plain_attention(spec, dtype, t(dout), compute_dbias=dbias)
        grads = {"q": t(res.dq), "k": t(res.dk), "v": t(res.dv)}
        if dbias:
            grads["mask"] = Arith(dtype).r(res.dbias.sum_to_size(mask.shape))
        if "sinks" in extra:
            grads["sinks"] = res.dsinks
        return {n: g.to(dtype) for n, g in grads.items()}

    got = run(MPS, dtype, True)
    ref = run("cpu", torch.float64, False)
    return got, ref, plain_grads()


@needs_backward
@pytest.mark.parametrize("lq,lk", BWD_SEQS, ids=[f"{a}x{b}" for a, b in BWD_SEQS])
@pytest.mark.parametrize("case", BWD_CASES)
@pytest.mark.parametrize("d", (32, 64, 72, 128, 256))
@pytest.mark.parametrize("dt", list(DTYPES))
def test_backward_matrix(dt, d, case, lq, lk):
    seed = seed_of(dt, d, case, lq, lk)
    got, ref, low = _backward_case(case, DTYPES[dt], d, lq, lk, seed)
    for name in ref:
        assert_rule(f"{case}/d{name}", got[name], ref[name], low[name])


# ---------------------------------------------------------------------------
# Stream integration: no per-call commit, ordering with other MPS work.
# ---------------------------------------------------------------------------

def test_results_do_not_depend_on_synchronize_placement():
    """The launcher encodes on PyTorch's stream and never commits or waits by
    itself: chains of our kernels, interleaved with PyTorch's own MPS ops and
    with in-place writes to inputs, give bit-identical results whether or not
    torch.mps.synchronize() is called between them."""
    q, k, v = (t.to(MPS) for t in make_qkv(2, 4, 4, 300, 300, 64, torch.float16, seed=21))
    w = randn(64, 64, dtype=torch.float16, seed=22, scale=0.1).to(MPS)

    def chain(sync: bool):
        outs = []
        x = q
        kk = k.clone()
        with strict_metal():
            for step in range(6):
                x = tmf.scaled_dot_product_attention(x @ w, kk, v, is_causal=step % 2 == 0)
                outs.append(x)
                if sync:
                    torch.mps.synchronize()
                kk.mul_(-0.5)  # written after the launch: the kernel must have read the old values
                if sync:
                    torch.mps.synchronize()
        return [o.cpu() for o in outs]

    no_sync = chain(False)
    with_sync = chain(True)
    for a, b in zip(no_sync, with_sync):
        assert torch.equal(a, b)
    # and the unsynchronized chain is right, step by step (first step against the oracle)
    (ref, _), (low, _) = oracle((q @ w).cpu(), k.cpu(), v.cpu(), scale=64 ** -0.5, window_right=0)
    assert_rule("chain[0]", no_sync[0], ref, low)


def test_many_launches_then_one_sync():
    """Hundreds of launches without a sync (the command buffer fills up and
    PyTorch commits on its own) give the same values as one-by-one."""
    q, k, v = (t.to(MPS) for t in make_qkv(1, 2, 2, 64, 96, 64, torch.float32, seed=31))
    with strict_metal():
        outs = [tmf.scaled_dot_product_attention(q * (1 + i / 100), k, v) for i in range(300)]
        last = outs[-1].cpu()
        again = tmf.scaled_dot_product_attention(q * (1 + 299 / 100), k, v)
        torch.mps.synchronize()
    assert torch.equal(last, again.cpu())


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True) on mps.
# ---------------------------------------------------------------------------

def test_torch_compile_fullgraph_forward():
    torch._dynamo.reset()
    q, k, v = (t.to(MPS) for t in make_qkv(2, 4, 2, 77, 130, 64, torch.float16, seed=41))
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def f(q, k, v, qf, kf, vf):
        a = tmf.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = tmf.flash_attn_func(qf, kf, vf, causal=True)
        return a * 2, b + 1

    with strict_metal():
        eager = f(q, k, v, qf, kf, vf)
        compiled = torch.compile(f, fullgraph=True)(q, k, v, qf, kf, vf)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


@needs_backward
def test_torch_compile_fullgraph_backward():
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 4, 4, 65, 91, 64, torch.float32, seed=51)

    def f(q, k, v):
        return tmf.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [t.to(MPS).requires_grad_(True) for t in (q, k, v)]
        with strict_metal():
            fn(*leaves).backward()
        grads.append([t.grad.cpu() for t in leaves])
    for e, c in zip(*grads):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# The launcher itself (torch_metal_flash._C), with probe shaders.
# ---------------------------------------------------------------------------

PROBE_HEADER_B = """
#pragma once
struct ProbeParams { float x; int n; };
"""
PROBE_HEADER_A = """
#pragma once
#include "probe_b.h"
inline float twice(float x) { return 2.0f * x; }
"""
PROBE_SOURCE = """
#include <metal_stdlib>
#include "probe_a.h"
#include "probe_b.h"
using namespace metal;

constant bool fc_b [[function_constant(0)]];
constant int fc_i [[function_constant(1)]];
constant float fc_f [[function_constant(2)]];

kernel void probe(device float* out [[buffer(0)]],
                  constant ProbeParams& p [[buffer(1)]],
                  const device float* in [[buffer(2)]],
                  threadgroup float* scratch [[threadgroup(0)]],
                  uint tid [[thread_index_in_threadgroup]],
                  uint tpg [[threads_per_threadgroup]],
                  uint3 tg [[threadgroup_position_in_grid]]) {
  scratch[tid] = float(tid) + in[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tg.x == 0) {
    out[8 + tid] = scratch[tpg - 1 - tid];
    if (tid == 0) {
      out[0] = fc_b ? 1.0f : 0.0f;
      out[1] = float(fc_i);
      out[2] = fc_f;
      out[3] = twice(p.x);
      out[4] = float(p.n);
    }
  }
}
"""


@pytest.fixture
def probe_dir(tmp_path):
    from torch_metal_flash import _C
    from torch_metal_flash._paths import shaders_dir

    (tmp_path / "probe_a.h").write_text(PROBE_HEADER_A)
    (tmp_path / "probe_b.h").write_text(PROBE_HEADER_B)
    (tmp_path / "probe.metal").write_text(PROBE_SOURCE)
    (tmp_path / "broken.metal").write_text(textwrap.dedent("""
        #include <metal_stdlib>
        using namespace metal;
        kernel void broken(device float* o [[buffer(0)]]) { o[0] = no_such_symbol_here; }
    """))
    (tmp_path / "probe_nax.metal").write_text(textwrap.dedent("""
        #include <metal_stdlib>
        using namespace metal;
        kernel void probe_nax(device float* o [[buffer(0)]]) { o[0] = 1.0f; }
    """))
    _C.set_shader_dir(str(tmp_path))
    try:
        yield _C
    finally:
        _C.set_shader_dir(str(shaders_dir()))  # the real kernels again (caches are rebuilt)


def _run(source, kernel, buffers, constants=(), threadgroups=(1, 1, 1), threadgroup=(1, 1, 1), tg_memory=None):
    """Encode one launch as it is, through the core's Metal encoder (what MetalBackend.run does)."""
    from torch_metal_flash import core
    from torch_metal_flash.planner.plan import Launch, Plan
    core.run_plan("metal", Plan((Launch(source, kernel, threadgroups, threadgroup, dict(buffers), dict(constants),
                                        dict(tg_memory or {})),)))


def _probe_launch(_C, base, threads=32, constants=((0, True), (1, -7), (2, 2.5)), tg_mem=None, extra_bytes=None):
    out = base[5:]  # bound at storage_offset * element_size = 20 bytes
    inp = torch.full((3,), 100.0, device=MPS)[1:]
    params = extra_bytes if extra_bytes is not None else struct.pack("fi", 1.25, 42)
    _run("probe.metal", "probe", {0: out, 1: params, 2: inp}, constants, (2, 1, 1), (threads, 1, 1),
         {0: tg_mem if tg_mem is not None else threads * 4})
    return out


def test_launcher_probe_kernel(probe_dir):
    _C = probe_dir
    base = torch.zeros(5 + 8 + 32, device=MPS)
    out = _probe_launch(_C, base).cpu()
    assert base[:5].cpu().eq(0).all(), "wrote before the tensor's storage offset"
    # function constants: bool -> MTLDataTypeBool, int -> MTLDataTypeInt, float -> MTLDataTypeFloat
    assert out[:5].tolist() == [1.0, -7.0, 2.5, 2.5, 42.0]
    # threadgroup memory and the input read at its storage offset
    assert out[8:8 + 32].tolist() == [100.0 + 31 - t for t in range(32)]
    # another specialization of the same kernel is a different pipeline
    out2 = _probe_launch(_C, torch.zeros_like(base), constants=((0, False), (1, 3), (2, -1.0))).cpu()
    assert out2[:3].tolist() == [0.0, 3.0, -1.0]
    info = _C.pipeline_info("probe.metal", "probe", [(0, True), (1, -7), (2, 2.5)])
    assert info["thread_execution_width"] == 32
    assert info["max_total_threads_per_threadgroup"] >= 32
    assert _C.LANGUAGE_VERSION == "3.1"
    assert "relaxed" in _C.math_mode() or "safe" in _C.math_mode() or "fast" in _C.math_mode()


def test_launcher_errors(probe_dir):
    _C = probe_dir
    base = torch.zeros(64, device=MPS)
    with pytest.raises(RuntimeError, match="no_such_symbol_here"):  # the compiler log reaches Python
        _run("broken.metal", "broken", {0: base})
    with pytest.raises(RuntimeError, match="not_a_kernel"):
        _run("probe.metal", "not_a_kernel", {0: base})
    with pytest.raises(RuntimeError, match="threads per threadgroup"):
        _probe_launch(_C, base, threads=4096, tg_mem=16)
    with pytest.raises(RuntimeError, match="threadgroup memory"):
        _probe_launch(_C, base, tg_mem=1 << 20)
    with pytest.raises(RuntimeError, match="bool, int or float"):
        _probe_launch(_C, base, constants=((0, True), (1, "seven"), (2, 2.5)))
    with pytest.raises(RuntimeError, match="32-bit"):
        _probe_launch(_C, base, constants=((0, True), (1, 2**40), (2, 2.5)))
    with pytest.raises(RuntimeError, match="setBytes"):
        _probe_launch(_C, base, extra_bytes=bytes(5000))
    with pytest.raises(RuntimeError, match="MPS tensor"):
        _run("probe.metal", "probe", {0: torch.zeros(8)}, [(0, True), (1, 1), (2, 1.0)])
    with pytest.raises(RuntimeError, match="missing.metal"):
        _run("missing.metal", "k", {0: base})
    # still usable after the errors
    assert _probe_launch(_C, torch.zeros(64, device=MPS)).cpu()[1].item() == -7.0


def test_nax_sources_compile_as_msl4_only_where_the_path_is_active(probe_dir):
    """``*_nax.metal``: MSL 4.0 where neural_accelerators() is "", else an error naming the reason."""
    _C = probe_dir
    why = _C.neural_accelerators()
    assert isinstance(why, str) and _C.NAX_LANGUAGE_VERSION == "4.0"
    if why:
        with pytest.raises(RuntimeError, match=r"shaders/probe_nax\.metal is a neural-accelerator kernel .*"
                                               + re.escape(why)):
            _C.library_info("probe_nax.metal")
    else:
        assert "(MSL 4.0," in _C.library_info("probe_nax.metal")["origin"]
    assert "(MSL 3.1," in _C.library_info("probe.metal")["origin"]


def test_gpu_family_and_backend_selection():
    from torch_metal_flash import _C
    from torch_metal_flash.backends import resolve

    from torch_metal_flash.backends.metal import planning_family

    assert re.fullmatch(r"apple\d+|mac2|unknown", _C.gpu_family())
    with strict_metal():
        backend = resolve(MPS)
    assert backend is not None and backend.name == "metal"
    assert backend.hardware_family == _C.gpu_family()
    assert backend.neural_accelerators_reason == _C.neural_accelerators()
    assert backend.family == planning_family(backend.hardware_family, backend.neural_accelerators_reason)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("features", ["plain", "softcap_alibi_mask"])
def test_backward_rebuilds_p_exactly(dtype, features):
    """One visible key per row, large scores: P = 1 exactly, so dv = dO and
    out = v bit for bit -- the backward kernels recompute the forward's scores
    bit for bit on Apple's compiler and GPU too (same operations, same order;
    the emulator checks this on the CPU)."""
    B, H, L, D = 1, 2, 40, 64
    q, k, v = make_qkv(B, H, H, L, L, D, torch.float64, seed=21)
    q, k, v = (q * 4).to(dtype), (k * 4).to(dtype), v.to(dtype)
    dout = randn(B, H, L, D, dtype=dtype, seed=22)
    mask = randn(1, H, L, L, dtype=dtype, seed=23) if features != "plain" else None
    alibi = torch.rand(H, generator=torch.Generator().manual_seed(24)) * 0.2 if features != "plain" else None
    leaves = [t.to(MPS).requires_grad_() for t in (q, k, v)]
    with strict_metal():  # window (0, 0): each query row sees its diagonal key only
        out, _, _ = torch.ops.metal_flash.fwd(*leaves, None if mask is None else mask.to(MPS),
                                              None if alibi is None else alibi.to(MPS), None, 1.0, 0, 0, 0,
                                              3.0 if features != "plain" else 0.0, True)
        dv = torch.autograd.grad(out, leaves[2], dout.to(MPS))[0]
    assert torch.equal(out.cpu(), v) and torch.equal(dv.cpu(), dout)


# ---------------------------------------------------------------------------
# Varlen and dropout on the Metal kernels
# ---------------------------------------------------------------------------

@needs_backward
def test_varlen_dropout_on_metal_equals_the_reference_with_the_same_rng_state():
    """Packed sequences (lengths 0 and 1 among them) with dropout: the Metal kernels and the
    CPU reference path given the same (seed, offset) apply the same Philox mask, forward and
    backward; the rng draw of the faces is a GPU op that torch.manual_seed reproduces."""
    from torch_metal_flash.problem import philox
    lens = [5, 0, 1, 130, 77]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q, k, v = (randn(1, h, sum(lens), 64, dtype=torch.float32, seed=61 + i) for i, h in enumerate((4, 2, 2)))
    dout = randn(1, 4, sum(lens), 64, dtype=torch.float32, seed=64)
    rng = torch.tensor([0x1234_5678_9ABC, 7], dtype=torch.int64)

    def run(device, backend):
        leaves = [t.to(device, copy=True).requires_grad_(True) for t in (q, k, v)]
        with tmf.backend(backend, strict=True):
            out, lse, _ = torch.ops.metal_flash.fwd(*leaves, None, None, None, 0.125, 0, -1, 0, 0.0, True, 0.25,
                                                    rng.to(device), cu.to(device), cu.to(device), None, None, 130,
                                                    130)
            out.backward(dout.to(device))
        return [t.detach().cpu() for t in (out, lse, *(x.grad for x in leaves))]

    for got, want in zip(run(MPS, "metal"), run("cpu", "reference")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    torch.manual_seed(3)
    a, b = philox.new_rng_state(MPS), philox.new_rng_state(MPS)
    torch.manual_seed(3)
    assert torch.equal(philox.new_rng_state(MPS).cpu(), a.cpu()) and not torch.equal(a.cpu(), b.cpu())
    assert a.device.type == "mps" and a.dtype == torch.int64 and ((a >= 0) & (a < 2 ** 62)).all().item()


@needs_backward
def test_paged_varlen_backward_on_metal_equals_the_packed_call():
    """Paged K/V with gradients on the GPU (the gather, the sort and the segmented scan of
    torch_metal_flash.ops.paged as MPS ops): out, dq and each cache row's dK/dV equal the packed
    call over the same keys bit for bit; a block two sequences share gets the sum of their
    gradients; two runs are bitwise equal."""
    page, lens_q, lens_k = 16, [7, 1, 40], [37, 16, 50]
    table = torch.tensor([[0, 1, 2, 0], [0, 0, 0, 0], [3, 4, 5, 6]], dtype=torch.int32)  # block 0 shared
    k_cache, v_cache = (randn(9, page, 2, 64, dtype=torch.float16, seed=70 + i) for i in range(2))  # 7, 8 unused
    q = randn(sum(lens_q), 4, 64, dtype=torch.float16, seed=72)
    dout = randn(sum(lens_q), 4, 64, dtype=torch.float16, seed=73)
    rows = [table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page for b, n in enumerate(lens_k)]
    k, v = (t.flatten(0, 1)[torch.cat(rows)] for t in (k_cache, v_cache))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=MPS) for n in (lens_q, lens_k))

    def run(kk, vv, block_table):
        leaves = [t.to(MPS, copy=True).requires_grad_(True) for t in (q, kk, vv)]
        with strict_metal():
            out = tmf.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                             block_table=None if block_table is None else block_table.to(MPS))
            grads = torch.autograd.grad(out, leaves, dout.to(MPS))
        return [t.detach().cpu() for t in (out, *grads)]

    paged, again, packed = run(k_cache, v_cache, table), run(k_cache, v_cache, table), run(k, v, None)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(paged, again))
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    index = torch.cat(rows)
    for got, want in ((paged[2], packed[2]), (paged[3], packed[3])):
        summed = torch.zeros(9 * page, 2, 64, dtype=torch.float32).index_add_(0, index, want.float())
        assert torch.equal(got.flatten(0, 1), summed.half())  # one or two terms: the same float32 sum
