"""The opt-in ``flash_attn`` shim: code written for the CUDA package runs unmodified.

No real flash_attn exists on these machines; its documented semantics
(bottom-right causal, windows, softcap, GQA, (B, L, H, D) layout) are checked
against explicit float64 math written from the flash_attn docstrings.
"""
import subprocess
import sys
import types

import pytest
import torch

import torch_metal_flash  # noqa: F401
from torch_metal_flash.faces import functional
from torch_metal_flash.faces.flash_attn_shim import (install_flash_attn_shim, is_flash_attn_shim_installed,
                                                     uninstall_flash_attn_shim)


@pytest.fixture
def shim():
    module = install_flash_attn_shim()
    yield module
    uninstall_flash_attn_shim()


def _ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """flash_attn semantics in float64: (B, L, H, D), bottom-right aligned causal/window."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def test_not_installed_on_import():
    code = ("import sys, torch_metal_flash, torch_metal_flash.faces.flash_attn_shim;"
            "assert 'flash_attn' not in sys.modules;"
            "import importlib.util; assert importlib.util.find_spec('flash_attn') is None")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_imports_resolve_to_ours(shim):
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    from flash_attn.flash_attn_interface import flash_attn_func as f2, flash_attn_qkvpacked_func  # noqa: F401
    assert flash_attn is shim and is_flash_attn_shim_installed()
    assert flash_attn_func is functional.flash_attn_func and f2 is flash_attn_func
    assert flash_attn.__version__.startswith("2.")
    import importlib.util
    assert importlib.util.find_spec("flash_attn") is not None


def test_uninstall_and_idempotent():
    install_flash_attn_shim()
    install_flash_attn_shim()
    uninstall_flash_attn_shim()
    assert "flash_attn" not in sys.modules and "flash_attn.flash_attn_interface" not in sys.modules
    with pytest.raises(ImportError):
        import flash_attn  # noqa: F401


def test_refuses_to_replace_another_flash_attn():
    real = types.ModuleType("flash_attn")
    real.__file__ = "/somewhere/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            install_flash_attn_shim()
        install_flash_attn_shim(force=True)
        import flash_attn
        assert flash_attn is not real
        uninstall_flash_attn_shim()
        assert sys.modules["flash_attn"] is real
    finally:
        sys.modules.pop("flash_attn", None)


CASES = {
    "plain": dict(),
    "causal_q_lt_k": dict(causal=True, lq=5, lk=11),
    "causal_q_gt_k": dict(causal=True, lq=11, lk=5),
    "window": dict(window=(3, 2), lq=13, lk=13),
    "window_causal": dict(window=(4, -1), causal=True, lq=9, lk=14),
    "softcap_gqa": dict(softcap=5.0, hq=6, hk=2),
    "scale_mqa": dict(scale=0.2, hq=4, hk=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attn_func_semantics(shim, case):
    from flash_attn import flash_attn_func
    torch.manual_seed(0)
    c = dict(CASES[case])
    b, lq, lk, hq, hk, d = 2, c.pop("lq", 7), c.pop("lk", 9), c.pop("hq", 4), c.pop("hk", 4), 16
    q = torch.randn(b, lq, hq, d)
    k = torch.randn(b, lk, hk, d)
    v = torch.randn(b, lk, hk, d)
    window = c.get("window", (-1, -1))
    out = flash_attn_func(q, k, v, softmax_scale=c.get("scale"), causal=c.get("causal", False), window_size=window,
                          softcap=c.get("softcap", 0.0))
    assert out.shape == (b, lq, hq, d) and out.is_contiguous()
    torch.testing.assert_close(out.double(), _ref(q, k, v, **c), atol=1e-5, rtol=1e-5)


def test_packed_and_backward(shim):
    from flash_attn import flash_attn_kvpacked_func, flash_attn_qkvpacked_func
    torch.manual_seed(1)
    qkv = torch.randn(2, 9, 3, 4, 16, requires_grad=True)
    out, lse, probs = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32 and probs is None
    ref = _ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    qkv64 = qkv.detach().double().requires_grad_()
    (dref,) = torch.autograd.grad(_ref(qkv64[:, :, 0], qkv64[:, :, 1], qkv64[:, :, 2], causal=True), qkv64,
                                  g.double())
    torch.testing.assert_close(dqkv.double(), dref, atol=1e-4, rtol=1e-4)
    q, kv = qkv[:, :, 0].detach(), qkv[:, :, 1:].detach()
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv).double(), _ref(q, kv[:, :, 0], kv[:, :, 1]),
                               atol=1e-5, rtol=1e-5)


def test_the_shims_functions_are_ours(shim):
    """Every function of flash_attn's interface is the face's own function (no wrapper in between)."""
    import flash_attn
    from flash_attn import flash_attn_interface
    from torch_metal_flash.faces import kvcache
    for name in flash_attn_interface.__all__:
        ours = getattr(kvcache if name == "flash_attn_with_kvcache" else functional, name)
        assert getattr(flash_attn, name) is ours and getattr(flash_attn_interface, name) is ours


def test_bad_input_names_the_argument(shim):
    from flash_attn import flash_attn_func
    q = torch.randn(2, 5, 4, 16)
    with pytest.raises(ValueError, match="^q: expected a 4-D"):
        flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="k/v"):
        flash_attn_func(q, q[:, :, :3], q[:, :, :3])


def test_varlen_and_kvcache_forward_to_ours(shim):
    """Once torch_metal_flash implements them, the shim's functions are ours (same results)."""
    import flash_attn
    torch.manual_seed(2)
    if hasattr(functional, "flash_attn_varlen_func"):
        lens = [3, 6]
        q = torch.randn(sum(lens), 4, 16)
        k = torch.randn(sum(lens), 2, 16)
        v = torch.randn(sum(lens), 2, 16)
        cu = torch.tensor([0, 3, 9], dtype=torch.int32)
        out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
        for b in range(2):
            s = slice(int(cu[b]), int(cu[b + 1]))
            want = _ref(q[None, s], k[None, s], v[None, s], causal=True)[0]
            torch.testing.assert_close(out[s].double(), want, atol=1e-5, rtol=1e-5)
    try:
        from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache as ours
    except ImportError:
        ours = getattr(functional, "flash_attn_with_kvcache", None)
    if ours is not None:
        q = torch.randn(2, 1, 4, 16)
        kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
        seqlens = torch.tensor([5, 8], dtype=torch.int32)
        out = flash_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)
        for b in range(2):
            n = int(seqlens[b])
            want = _ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True)[0]
            torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_bert_padding_round_trip_and_gradients(shim):
    """flash_attn.bert_padding: unpad_input / pad_input as flash-attn 2.7+ (five return values),
    gradients scatter back to the kept rows only."""
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    unused = torch.tensor([[0, 0, 0, 1, 0], [0] * 5, [0] * 5])
    rows, idx, cu, max_len, used = unpad_input(x, mask, unused)
    keep = (mask + unused).bool()
    assert torch.equal(rows, x[keep]) and torch.equal(idx, keep.flatten().nonzero().flatten())
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 9, 11]
    assert max_len == 5 and isinstance(max_len, int) and used.tolist() == [3, 5, 2]
    back = pad_input(rows, idx, 3, 5)
    assert torch.equal(back, x * keep[..., None, None])
    (gx,) = torch.autograd.grad((back * torch.arange(4.0, dtype=torch.float64)).sum(), x)
    assert torch.equal(gx, keep[..., None, None] * torch.arange(4.0, dtype=torch.float64).expand_as(x))
    rows2 = torch.randn(11, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda r: pad_input(r, idx, 3, 5), (rows2,))
    torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x.detach().reshape(15, 2, 4).requires_grad_(),))
    with pytest.raises(ValueError, match="attention_mask: expected shape \\(batch, seqlen\\) = \\(3, 5\\)"):
        unpad_input(x, mask[:, :4])
    with pytest.raises(TypeError, match="indices: expected a 1-d int32/int64 tensor"):
        index_first_axis(x, idx.float())


def test_bert_padding_for_concatenated_sequences(shim):
    from flash_attn.bert_padding import unpad_input_for_concatenated_sequences
    x = torch.arange(12.0).reshape(2, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 1, 0, 0, 0]])
    rows, idx, cu, max_len = unpad_input_for_concatenated_sequences(x, lengths)
    assert idx.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11] and rows.flatten().tolist() == [float(i) for i in idx]
    assert cu.tolist() == [0, 2, 5, 8, 10, 11] and max_len == 3


def test_bert_padding_feeds_varlen_like_padded_attention(shim):
    """The training-script pattern: unpad a padded batch, flash_attn_varlen_func on the kernels,
    pad back; equals attention over each sequence's own tokens."""
    from flash_attn import flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input
    import torch_metal_flash as tmf
    g = torch.Generator().manual_seed(4)
    B, L, H, D = 3, 7, 2, 16
    q, k, v = (torch.randn(B, L, H, D, generator=g) for _ in range(3))
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate((7, 3, 5)):
        mask[b, :n] = True
    (qu, idx, cu, max_len, _), (ku, *_), (vu, *_) = (unpad_input(t, mask) for t in (q, k, v))
    with tmf.backend("emulator", strict=True):
        out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len, causal=True), idx, B, L)
    for b, n in enumerate((7, 3, 5)):
        want = _ref(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)[0]
        torch.testing.assert_close(out[b, :n].double(), want, atol=1e-5, rtol=1e-5)
        assert not out[b, n:].any()
