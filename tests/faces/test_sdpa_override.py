"""The SDPA override (torch_metal_flash.faces.sdpa_override) against torch's own SDPA.

CPU tensors are routed with ``sdpa_override(cpu=True)`` (our reference path)
or, once the emulator has landed, with ``backend("emulator")``; every routed
call must give torch's result, every call we do not serve must reach torch's
original unchanged, and the counters must say which is which.
"""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as captured_sdpa  # captured before enabling

from torch_metal_flash import backend
from torch_metal_flash.faces.sdpa_override import (disable_sdpa, enable_sdpa, is_sdpa_enabled, reset_sdpa_stats,
                                                   sdpa_override, sdpa_stats)

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(autouse=True)
def _clean():
    reset_sdpa_stats()
    yield
    while is_sdpa_enabled():
        disable_sdpa()


def _qkv(b=2, hq=4, hkv=4, lq=7, lk=9, d=16, dtype=torch.float32, grad=False):
    q = torch.randn(b, hq, lq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, hkv, lk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, hkv, lk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


CASES = {
    "plain": (dict(), {}),
    "causal": (dict(), dict(is_causal=True)),
    "causal_lq_gt_lk": (dict(lq=11, lk=5), dict(is_causal=True)),
    "scale": (dict(), dict(scale=0.3)),
    "gqa": (dict(hq=6, hkv=2), dict(enable_gqa=True, is_causal=True)),
    "mqa_broadcast": (dict(hq=4, hkv=1), {}),
    "bool_mask": (dict(), dict(mask=("bool", (2, 1, 7, 9)))),
    "bool_mask_2d": (dict(), dict(mask=("bool", (7, 9)))),
    "float_mask": (dict(), dict(mask=("float", (2, 4, 7, 9)))),
    "float_mask_keys": (dict(), dict(mask=("float", (1, 9)))),
}


def _make_kwargs(spec, q):
    kw = dict(spec)
    mask = kw.pop("mask", None)
    if mask is not None:
        kind, shape = mask
        if kind == "bool":
            m = torch.rand(shape) > 0.4
            m[..., 0] = True
        else:
            m = torch.randn(shape, dtype=q.dtype)
            m.view(-1)[::5] = float("-inf")
            m[..., 0] = 0.0
        kw["attn_mask"] = m
    return kw


def test_mask_with_causal_is_torchs_own_call():
    """torch rejects a mask with is_causal=True on its MPS and math paths (torch 2.13's CPU flash
    path combined them): the override leaves the call to torch, whose answer it then is."""
    torch.manual_seed(0)
    q, k, v = _qkv()
    kw = _make_kwargs(dict(mask=("bool", (2, 1, 7, 9)), is_causal=True), q)
    try:
        want = F.scaled_dot_product_attention(q, k, v, **kw)
    except RuntimeError as e:
        want = e
    with sdpa_override(cpu=True):
        if isinstance(want, RuntimeError):
            with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
                F.scaled_dot_product_attention(q, k, v, **kw)
        else:
            torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, **kw), want, rtol=0, atol=0)
    assert sdpa_stats()["routed"] == 0 and sdpa_stats()["original"] == 1, sdpa_stats()


@pytest.mark.parametrize("case", sorted(CASES))
def test_routed_matches_torch(case):
    torch.manual_seed(0)
    shape, spec = CASES[case]
    q, k, v = _qkv(**shape)
    kw = _make_kwargs(spec, q)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_override(cpu=True):
        got = F.scaled_dot_product_attention(q, k, v, **kw)
    assert sdpa_stats()["routed"] == 1 and sdpa_stats()["original"] == 0, sdpa_stats()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_low_precision(dtype):
    torch.manual_seed(1)
    q, k, v = _qkv(dtype=dtype, lq=17, lk=17)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)
    with sdpa_override(cpu=True):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == dtype and sdpa_stats()["routed"] == 1
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_every_entry_point_is_covered():
    """F attribute, a reference captured at import, torch._C._nn, 3-D and unbatched inputs, inference mode."""
    torch.manual_seed(2)
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_override(cpu=True):
        outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True),
                captured_sdpa(q, k, v, is_causal=True),
                torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True),
                torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)]
        with torch.inference_mode():
            outs.append(captured_sdpa(q, k, v, is_causal=True))
        with torch.no_grad():
            outs.append(captured_sdpa(q, k, v, is_causal=True))
        out3 = F.scaled_dot_product_attention(q[0], k[0], v[0])
        out2 = F.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0])
    assert sdpa_stats()["routed"] == len(outs) + 2, sdpa_stats()
    for got in outs:
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(out3, F.scaled_dot_product_attention(q[0], k[0], v[0]), **TOL[torch.float32])
    torch.testing.assert_close(out2, F.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0]),
                               **TOL[torch.float32])
    # F's attribute is untouched: we override the operator, not the Python name
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_backward_matches_torch():
    torch.manual_seed(3)
    q, k, v = _qkv(hq=4, hkv=2, grad=True)
    mask = torch.randn(2, 1, 7, 9, requires_grad=True)
    dout = torch.randn(2, 4, 7, 16)

    def grads():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return torch.autograd.grad(out, (q, k, v, mask), dout)

    want = grads()
    with sdpa_override(cpu=True):
        got = grads()
    assert sdpa_stats()["routed"] == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_fully_masked_rows_match_torch():
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    mask[:, :, 3] = False
    fmask = torch.zeros(7, 9).masked_fill(~mask[0, 0], float("-inf"))
    with sdpa_override(cpu=True):
        got_b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got_f = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask)
    torch.testing.assert_close(got_b, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **TOL[torch.float32])
    torch.testing.assert_close(got_f, F.scaled_dot_product_attention(q, k, v, attn_mask=fmask), **TOL[torch.float32])


FALLTHROUGH = {
    "float64": lambda q, k, v: ((q.double(), k.double(), v.double()), {}, "dtype torch.float64"),
    "dropout_above_1": lambda q, k, v: ((q, k, v), dict(dropout_p=1.5), "dropout_p outside [0, 1]"),
    "strided_last_dim": lambda q, k, v: ((q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v), {},
                                         "non-contiguous last dimension"),
    "broadcast_batch": lambda q, k, v: ((q, k[:1], v[:1]), {}, "batch dims differ (broadcast batch)"),
    "empty": lambda q, k, v: ((q[:, :, :0], k, v), {}, "empty tensors"),
    "int_mask": lambda q, k, v: ((q, k, v), dict(attn_mask=torch.ones(7, 9, dtype=torch.int32)),
                                 "attn_mask dtype torch.int32"),
}


@pytest.mark.parametrize("case", sorted(FALLTHROUGH))
def test_fallthrough_reaches_original(case):
    """Calls we do not serve give exactly torch's result (or torch's own error) and are counted."""
    torch.manual_seed(4)
    (q, k, v), kw, reason = FALLTHROUGH[case](*_qkv())

    def run():
        torch.manual_seed(5)
        try:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        except Exception as exc:  # noqa: BLE001 - compare torch's own errors
            return exc

    want = run()
    with sdpa_override(cpu=True):
        got = run()
    stats = sdpa_stats()
    assert stats["routed"] == 0 and stats["original"] == 1 and stats["reasons"] == {reason: 1}, stats
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_cpu_is_not_routed_by_default():
    """Without the emulator selected, CPU calls stay on torch's implementation (our CPU path is only the
    reference math, no better than torch's)."""
    q, k, v = _qkv()
    with sdpa_override():
        with backend("reference"):
            F.scaled_dot_product_attention(q, k, v)
        with sdpa_override(cpu=False):
            F.scaled_dot_product_attention(q, k, v)
    stats = sdpa_stats()
    assert stats["routed"] == 0 and stats["original"] == 2, stats
    assert any("backend 'reference'" in r for r in stats["reasons"])
    assert "CPU routing disabled (enable_sdpa(cpu=False))" in stats["reasons"]


@pytest.mark.parametrize("bad", [
    lambda q, k, v: F.scaled_dot_product_attention(q, k.double(), v),
    lambda q, k, v: F.scaled_dot_product_attention(q, k[..., :8], v),
    lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :3], v[:, :3]),
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
])
def test_invalid_input_gets_torchs_error(bad):
    q, k, v = _qkv()
    with pytest.raises(Exception) as want:
        bad(q, k, v)
    with sdpa_override(cpu=True):
        with pytest.raises(type(want.value)) as got:
            bad(q, k, v)
    assert str(got.value) == str(want.value)
    assert sdpa_stats()["routed"] == 0


def test_enable_disable_nesting_and_errors():
    q, k, v = _qkv()
    assert not is_sdpa_enabled()
    disable_sdpa()  # no-op when not enabled
    enable_sdpa(cpu=True)
    enable_sdpa(cpu=False)
    F.scaled_dot_product_attention(q, k, v)  # innermost: cpu=False
    disable_sdpa()
    assert is_sdpa_enabled()
    F.scaled_dot_product_attention(q, k, v)  # cpu=True again
    disable_sdpa()
    assert not is_sdpa_enabled()
    F.scaled_dot_product_attention(q, k, v)  # not counted at all
    stats = sdpa_stats()
    assert (stats["routed"], stats["original"]) == (1, 1), stats
    with pytest.raises(TypeError, match="cpu"):
        enable_sdpa(cpu="yes")
    assert not is_sdpa_enabled()


def test_debug_log(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.DEBUG, logger="torch_metal_flash.sdpa"):
        with sdpa_override(cpu=True):
            F.scaled_dot_product_attention(q, k, v)
            F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    text = caplog.text
    assert "-> torch_metal_flash" in text and "torch original (dtype torch.float64)" in text


# --- nn modules that reach SDPA through torch.nn.functional ------------------------------------------------


def test_multihead_attention_python_path_is_routed():
    torch.manual_seed(6)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 7, 32)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    want, _ = mha(x, x, x, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
    with sdpa_override(cpu=True):
        got, _ = mha(x, x, x, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
        assert sdpa_stats()["routed"] == 1
        mha(x, x, x)  # need_weights=True computes the weights itself: no SDPA call at all
        assert sdpa_stats()["routed"] == 1 and sdpa_stats()["original"] == 0
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_transformer_layers_are_routed():
    torch.manual_seed(7)
    enc = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    dec = torch.nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 9, 32), torch.randn(2, 5, 32)
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    want = dec(tgt, enc(src), tgt_mask=tgt_mask, tgt_is_causal=True)
    with sdpa_override(cpu=True):
        got = dec(tgt, enc(src), tgt_mask=tgt_mask, tgt_is_causal=True)
    assert sdpa_stats()["routed"] == 3  # encoder self, decoder self, decoder cross
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_native_fast_path_is_not_covered():
    """Documented gap: torch's fused C++ encoder fast path (CPU/CUDA only, eval + no grad) never calls the
    SDPA operator; on MPS tensors torch never takes it."""
    enc = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    x = torch.randn(2, 9, 32)
    with sdpa_override(cpu=True), torch.no_grad():
        enc(x)
        assert sdpa_stats()["routed"] == 0
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            enc(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert sdpa_stats()["routed"] == 1


# --- backends that route on their own ----------------------------------------------------------------------


def test_emulator_selection_routes_cpu():
    torch.manual_seed(8)
    q, k, v = _qkv(lq=17, lk=17, d=64)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch_metal_flash import backends
    before = backends.run_counts().get("emulator", 0)
    with sdpa_override(), backend("emulator"):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with backend("reference"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)  # not routed: torch's own
    stats = sdpa_stats()
    assert stats["routed"] == 1 and stats["original"] == 1, stats
    assert backends.run_counts().get("emulator", 0) == before + 1
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("grad", [False, True])
def test_emulator_declined_call_reaches_original_without_warning(grad):
    """A call the kernels do not cover (head dim above the largest tile) goes to torch's original,
    counted with the planner's reason, with no fallback warning and no run of our reference path,
    whether the op declines it (inference) or the planner is asked first (a call that needs grad)."""
    import warnings
    from torch_metal_flash import backends
    torch.manual_seed(9)
    q, k, v = _qkv(lq=5, lk=6, d=600)
    q.requires_grad_(grad)
    want = F.scaled_dot_product_attention(q, k, v)
    before = backends.run_counts()
    with sdpa_override(), backend("emulator"), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = F.scaled_dot_product_attention(q, k, v)
    stats = sdpa_stats()
    assert stats["routed"] == 0 and stats["original"] == 1, stats
    (reason,) = stats["reasons"]
    assert "head dim" in reason, reason
    assert backends.run_counts() == before
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an MPS device")
def test_mps_is_routed():  # pragma: no cover - macOS only
    torch.manual_seed(9)
    q, k, v = (t.to("mps") for t in _qkv(lq=33, lk=33, d=64))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_override():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    stats = sdpa_stats()
    assert stats["routed"] == 1, stats
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[torch.float32])
