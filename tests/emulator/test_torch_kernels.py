"""PyTorch 2.15's own Metal attention kernels, unmodified from its macOS wheel, launched as torch's host
(aten/.../mps/operations/Attention.mm) binds them: the prefill kernel, the one- and two-pass sdpa_vector
decode (nothing bound at the mask's slots without a mask), and the Metal 4 tensor-op prefill for Apple10 (a10)
and for Apple8/9 (a9), each under its GPU family's cooperative-tensor layout and wrong under the other one.
Checked mode, two schedule orders, against float64.

The wheel is downloaded once by pip (bench/macos_cross_build.py) and only its kernel headers are extracted into
~/.cache/torch_metal_flash/macos-cross; nothing of torch's is stored in this repository."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer_kernels as pk  # noqa: E402
from torch_metal_flash import emulator  # noqa: E402

TORCH = "2.15.0"
ORDERS = ("forward", "reverse")


@pytest.fixture(scope="module")
def inc():
    import macos_cross_build as mcb
    try:
        return pk.pytorch_wheel_include(TORCH)
    except mcb.CrossBuildError as exc:
        pytest.skip(f"torch {TORCH}'s macOS wheel is not available: {exc}")


def qkv(B, H, Hk, ql, kl, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, d, generator=g).to(dtype) for h, n in ((H, ql), (Hk, kl), (Hk, kl))]


def top_left_causal(ql, kl):
    """torch's is_causal: query i sees keys 0..i."""
    return torch.arange(kl)[None] <= torch.arange(ql)[:, None]


def check(run, ref):
    """The kernel right in both orders, and the same bits in both."""
    outs = [run(order) for order in ORDERS]
    for out in outs:
        err, ok = pk.max_error(out, ref)
        assert ok, err
    assert torch.equal(outs[0], outs[1])


def test_the_params_struct_is_read_from_the_header(inc):
    # 2.15: 64-bit strides (128 bytes); 2.13 packed them as int32 (80 bytes)
    assert pk.struct_format(inc, pk.PREFILL_HEADER, "PrefillAttnParams") == "<1i1i1i1i1i1i1f1f3q3q3q3q"
    assert pk.struct_format(inc, pk.PREFILL_HEADER, "PrefillAttnMaskParams") == "<4q"


@pytest.mark.parametrize("mask_kind,causal", [(None, False), (None, True), ("bool", False)])
def test_prefill(inc, mask_kind, causal):
    q, k, v = qkv(1, 4, 2, 37, 45, 64)
    mask = torch.rand(1, 1, 37, 45, generator=torch.Generator().manual_seed(1)) > 0.3 if mask_kind else None
    visible = top_left_causal(37, 45) if causal else mask
    ref = pk.attention_reference(q, k, v, 0.125, mask=visible)
    check(lambda order: pk.run_pytorch_prefill(inc, q, k, v, 0.125, causal=causal, mask=mask, order=order,
                                               checked=True)[0], ref)


@pytest.mark.parametrize("kl,masked", [(300, False), (300, True), (1030, False)], ids=["one-pass", "one-pass-mask",
                                                                                    "two-pass"])
def test_decode(inc, kl, masked):
    q, k, v = qkv(1, 8, 2, 1, kl, 64)
    assert pk.pytorch_decode_two_pass(q, k) == (kl >= 1024)
    mask = torch.rand(1, 8, 1, kl, generator=torch.Generator().manual_seed(2)) > 0.2 if masked else None
    ref = pk.attention_reference(q, k, v, 0.125, mask=mask)
    check(lambda order: pk.run_pytorch_decode(inc, q, k, v, 0.125, mask=mask, order=order, checked=True)[0], ref)


@pytest.mark.parametrize("arch,families", [("a9", ("apple8", "apple9")), ("a10", ("apple10",))])
def test_tensor_op_prefill_under_its_family(inc, arch, families):
    q, k, v = qkv(1, 2, 1, 40, 40, 64)
    ref = pk.attention_reference(q, k, v, 0.125, mask=top_left_causal(40, 40))
    for family in families:
        with emulator.settings(family=family):
            check(lambda order: pk.run_pytorch_prefill(inc, q, k, v, 0.125, causal=True, mpp=arch, order=order,
                                                       checked=True)[0], ref)


@pytest.mark.parametrize("arch,family", [("a9", "apple10"), ("a10", "apple8")])
def test_tensor_op_prefill_is_wrong_under_the_other_family(inc, arch, family):
    q, k, v = qkv(1, 1, 1, 16, 16, 64)
    with emulator.settings(family=family):
        out, _ = pk.run_pytorch_prefill(inc, q, k, v, 0.125, mpp=arch, checked=True)
    err, ok = pk.max_error(out, pk.attention_reference(q, k, v, 0.125))
    assert not ok and err > 0.5
