"""torch_metal_flash.scaled_dot_product_attention against torch's own SDPA and
the float64 oracle (reference backend; the kernel backends run the same tests
through test_forward_kernels / test_mps)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_metal_flash as tmf
from torch_metal_flash.testing import assert_matches_oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS = [(1, 1), (3, 17), (17, 3), (113, 129), (129, 113), (203, 1000), (1000, 203)]


def _sdpa_pair(q, k, v, **kw):
    """Ours, torch's in float64 (oracle) and torch's in the input dtype (budget)."""
    def f64(t):
        return t.double() if t is not None and t.is_floating_point() else t
    ours = tmf.scaled_dot_product_attention(q, k, v, **kw)
    kw64 = dict(kw, attn_mask=f64(kw.get("attn_mask")))
    ref64 = F.scaled_dot_product_attention(f64(q), f64(k), f64(v), **kw64)
    low = F.scaled_dot_product_attention(q, k, v, **kw)
    return ours, ref64, low


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(dtype, lq, lk, causal):
    torch.manual_seed(lq * 7 + lk)
    q = torch.randn(2, 3, lq, 40, dtype=dtype)
    k = torch.randn(2, 3, lk, 40, dtype=dtype)
    v = torch.randn(2, 3, lk, 40, dtype=dtype)
    ours, ref, low = _sdpa_pair(q, k, v, is_causal=causal)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert_matches_oracle("sdpa", ours, ref, low, dtype=dtype)


@pytest.mark.parametrize("mask_shape", [(17, 29), (1, 17, 29), (2, 1, 17, 29), (2, 4, 1, 29), (1, 29)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast(mask_shape, kind):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 17, 16), torch.randn(2, 4, 29, 16), torch.randn(2, 4, 29, 16)
    mask = torch.rand(mask_shape) > 0.3 if kind == "bool" else torch.randn(mask_shape)
    ours, ref, low = _sdpa_pair(q, k, v, attn_mask=mask)
    assert_matches_oracle("masked sdpa", ours, ref, low)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_combines_with_is_causal(kind):
    torch.manual_seed(6)
    q, k, v = torch.randn(2, 3, 13, 16), torch.randn(2, 3, 21, 16), torch.randn(2, 3, 21, 16)
    mask = torch.rand(13, 21) > 0.2 if kind == "bool" else torch.randn(2, 1, 13, 21)
    ours, ref, low = _sdpa_pair(q, k, v, attn_mask=mask, is_causal=True)
    assert_matches_oracle("mask + causal", ours, ref, low)


def test_fully_masked_rows_are_zero_with_finite_grad():
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    out = tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_and_mqa(hkv):
    torch.manual_seed(2)
    q = torch.randn(2, 8, 13, 32)
    k, v = torch.randn(2, hkv, 21, 32), torch.randn(2, hkv, 21, 32)
    ours, ref, low = _sdpa_pair(q, k, v, is_causal=True, enable_gqa=True)
    assert_matches_oracle("gqa sdpa", ours, ref, low)


def test_scale_and_value_dim_and_3d_inputs():
    torch.manual_seed(3)
    q, k, v = torch.randn(4, 9, 24), torch.randn(4, 11, 24), torch.randn(4, 11, 40)
    ours, ref, low = _sdpa_pair(q, k, v, scale=0.37)
    assert ours.shape == (4, 9, 40)
    assert_matches_oracle("3-D sdpa", ours, ref, low)


def test_gradients_match_torch():
    torch.manual_seed(4)
    leaves = [torch.randn(2, 4, 19, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    mask = torch.randn(19, 19, dtype=torch.float64, requires_grad=True)
    grads = []
    for fn in (tmf.scaled_dot_product_attention, F.scaled_dot_product_attention):
        out = fn(*leaves, attn_mask=mask)
        grads.append(torch.autograd.grad(out, [*leaves, mask], torch.randn_like(out, generator=torch.Generator().manual_seed(0))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_flash_attn_layout_needs_no_copy():
    """A (B, L, H, D) tensor seen as (B, H, L, D) comes back in the same layout."""
    q = torch.randn(2, 7, 3, 16).transpose(1, 2)
    out = tmf.scaled_dot_product_attention(q, q, q)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


def test_empty_inputs():
    q = torch.randn(0, 2, 5, 8)
    assert tmf.scaled_dot_product_attention(q, q, q).shape == (0, 2, 5, 8)
    q0, k = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 4, 8)
    assert tmf.scaled_dot_product_attention(q0, k, k).shape == (1, 2, 0, 8)
    q1, k0 = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    out = tmf.scaled_dot_product_attention(q1, k0, k0)
    assert torch.equal(out, torch.zeros(1, 2, 3, 8))


def test_dropout_runs_on_reference_with_warning(monkeypatch):
    from torch_metal_flash import backends
    monkeypatch.setattr(backends, "_warned", set())
    torch.manual_seed(5)
    q = torch.randn(1, 2, 64, 16)
    with tmf.backend("emulator"), pytest.warns(tmf.FallbackWarning, match="dropout"):
        a = tmf.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    b = tmf.scaled_dot_product_attention(q, q, q)
    assert not torch.allclose(a, b), "dropout must not be silently ignored"
    # Inverted dropout keeps the expectation: average many draws.
    mean = torch.stack([tmf.scaled_dot_product_attention(q, q, q, dropout_p=0.5) for _ in range(300)]).mean(0)
    assert (mean - b).abs().mean() < 0.1 * b.abs().mean()


@pytest.mark.parametrize("face", ["sdpa", "flash_attn_func", "varlen"])
def test_dropout_silently_bypasses_strict_mode(face):
    """dropout_p > 0 takes the backend's fallback policy: strict raises, run_counts counts it."""
    q = torch.randn(1, 2, 8, 16)
    calls = {
        "sdpa": lambda: tmf.scaled_dot_product_attention(q, q, q, dropout_p=0.25),
        "flash_attn_func": lambda: tmf.flash_attn_func(q, q, q, dropout_p=0.25),
        "varlen": lambda: tmf.flash_attn_varlen_func(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), torch.tensor([0, 3, 8], dtype=torch.int32),
                                                     torch.tensor([0, 3, 8], dtype=torch.int32), 5, 5,
                                                     dropout_p=0.25),
    }
    with tmf.backend("emulator", strict=True), pytest.raises(tmf.UnsupportedError, match="dropout_p > 0"):
        calls[face]()
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", tmf.FallbackWarning)
        calls[face]()
    counts = tmf.run_counts(reset=True)
    assert counts.get("reference", 0) >= 1 and counts.get("emulator", 0) == 0, counts
