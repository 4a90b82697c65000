"""``tmf.quantize`` / ``QuantizedTensor`` / ``tmf.quantized_zeros`` on the host: the storage
format (MLX packing, symmetric int8), the documented rounding and its error bound,
views on the leading dims, and the argument errors.  No kernels here (see
tests/kernels/test_quantized_kernels.py)."""
from __future__ import annotations

import zlib

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash.problem.quant import QuantizedTensor, flat_format, from_flat

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}
FORMATS = [dict(bits=4, group_size=32), dict(bits=4, group_size=64), dict(bits=4, group_size=128),
           dict(bits=8, group_size=32), dict(bits=8, group_size=64), dict(bits=8, group_size=128),
           dict(bits=8, group_size=32, mode="symmetric"), dict(bits=8, group_size=64, mode="symmetric"),
           dict(bits=8, group_size=128, mode="symmetric")]


def _groups(t: torch.Tensor, gs: int, D: int) -> torch.Tensor:
    return t.float().repeat_interleave(gs, -1)[..., :D]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound_and_components(fmt, dtype):
    """|x - x_hat| <= scale / 2 + the roundings: quantize() rounds fl32(fl32(x - bias) / scale) to
    an integer, each float32 step off by half an ulp, so q may be one off where (x - bias) / scale
    lies within an ulp of a half (|x - bias| * 2^-23); dequantize() computes x_hat =
    fl_T(fl32(fl32(scale * q) + bias)): half a float32 ulp of scale * q, plus half an ulp of x_hat
    in float32 and in T.  For head dims with whole and partial last groups, constant groups, zero
    groups and wide ranges, with inputs seeded by the case (the same on every run)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), *fmt.values())).encode()))
    for D in (64, 80, 96, 128, 256):
        x = torch.randn(3, 5, D, generator=g) * torch.rand(3, 5, 1, generator=g) * 8
        x[0, 0] = 1.5  # constant row: scale 0 (affine)
        x[0, 1] = 0.0
        x[1, 0, :32] = torch.linspace(-1000, 30, 32)
        x = x.to(dtype)
        qt = tmf.quantize(x, **fmt)
        mode = fmt.get("mode", "affine")
        gs, bits, groups = fmt["group_size"], fmt["bits"], -(-D // fmt["group_size"])
        assert (qt.bits, qt.group_size, qt.mode, qt.dtype, qt.shape) == (bits, gs, mode, dtype, x.shape)
        if mode == "affine":
            assert qt.data.dtype == torch.int32 and qt.data.shape == (3, 5, D * bits // 32)
            assert qt.scales.dtype == qt.biases.dtype == dtype and qt.scales.shape == (3, 5, groups)
        else:
            assert qt.data.dtype == torch.int8 and qt.data.shape == (3, 5, D) and qt.biases is None
            assert qt.scales.dtype == torch.float16 and qt.scales.shape == (3, 5, groups)
            assert int(qt.data.abs().max()) <= 127
        xh = qt.dequantize()
        assert xh.dtype == dtype and xh.shape == x.shape
        err = (x.float() - xh.float()).abs()
        scaled = (xh.float() - _groups(qt.biases, gs, D)) if mode == "affine" else xh.float()  # ~ scale * q
        scale = _groups(qt.scales, gs, D)
        bound = scale / 2 * (1 + 2 ** -20) + (scaled.abs() + scale) * (2 ** -23 + 2 ** -24) + \
            xh.float().abs() * (ULP[dtype] / 2 + (2 ** -24 if dtype != torch.float32 else 0))
        assert bool((err <= bound).all()), float((err - bound).max())
        assert torch.equal(xh[0, 1], x[0, 1])  # zeros stay zeros
        if mode == "affine":
            assert torch.equal(xh[0, 0], x[0, 0])  # a constant group is its bias


def test_rounding_rule_exactly():
    """The documented rule, step by step, on one group."""
    x = torch.tensor([[-1.0, 0.3, 2.0, 0.7] * 8], dtype=torch.float16)  # one group of 32
    qt = tmf.quantize(x, bits=4, group_size=32)
    assert float(qt.biases[0, 0]) == -1.0  # bias = min, exact
    scale = float(qt.scales[0, 0])
    assert scale >= 3.0 / 15 and torch.tensor(3.0 / 15).half().float() <= scale  # (max - min) / 15, rounded up
    q = ((qt.data[0, :, None] >> torch.arange(0, 32, 4)) & 15).flatten()
    want = torch.round((x.float()[0] + 1.0) / scale)  # rint((x - bias) / scale), half to even
    assert torch.equal(q, want.long())
    s = tmf.quantize(torch.tensor([[127 * 0.01] + [0.005] * 31]), bits=8, group_size=32, mode="symmetric")
    assert float(s.scales[0, 0]) >= 0.01 and float(s.data[0, 0]) == 127  # max|x| / 127 rounded up: no clamping
    assert int(s.data[0, 1]) in (0, 1)


def test_mlx_packing_layout():
    """Element j of a row is in bits (j % (32 / bits)) * bits of word j // (32 / bits), little endian."""
    vals = torch.arange(16, dtype=torch.float32).repeat(4)[None]  # 0..15 repeated, one group of 64
    qt = tmf.quantize(vals, bits=4, group_size=64)
    assert float(qt.scales[0, 0]) == 1.0 and float(qt.biases[0, 0]) == 0.0
    assert qt.data.view(torch.uint32)[0, 0].item() == 0x76543210
    assert qt.data.view(torch.uint32)[0, 1].item() == 0xFEDCBA98
    qt8 = tmf.quantize(torch.tensor([[1.0, 2.0, 3.0, 255.0] + [0.0] * 28]), bits=8, group_size=32)
    assert qt8.data.view(torch.uint32)[0, 0].item() == 0xFF030201
    # MLX hands out uint32 words: accepted as they are
    again = QuantizedTensor(qt.data.view(torch.uint32), qt.scales, qt.biases, bits=4, group_size=64)
    assert torch.equal(again.dequantize(), vals)


def test_views_on_leading_dims_and_assignment():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 3, 64, generator=g).half()
    qt = tmf.quantize(x, bits=4, group_size=32)
    deq = qt.dequantize()
    for view, ref in ((qt[:, 2:5], deq[:, 2:5]), (qt.transpose(1, 2), deq.transpose(1, 2)), (qt[1], deq[1]),
                      (qt[..., 1, :], deq[..., 1, :]), (qt[:, None], deq[:, None]), (qt.unsqueeze(0), deq[None]),
                      (qt.reshape(12, 3, 64), deq.reshape(12, 3, 64)), (qt.flatten(0, 1), deq.flatten(0, 1)),
                      (qt.permute(2, 0, 1, 3), deq.permute(2, 0, 1, 3)), (qt.select(2, 0), deq[:, :, 0]),
                      (qt.narrow(1, 1, 2), deq[:, 1:3]), (qt.index_select(0, torch.tensor([1, 0])), deq[[1, 0]]),
                      (qt[torch.tensor([1, 1])], deq[[1, 1]]), (qt.contiguous(), deq)):
        assert view.shape == ref.shape and torch.equal(view.dequantize(), ref)
    assert qt[:, 2:5].data.data_ptr() == qt.data[:, 2:5].data_ptr()  # a view, not a copy
    cache = tmf.quantized_zeros((2, 6, 3, 64), bits=4, group_size=32, dtype=torch.float16)
    cache[:, 1:3] = qt[:, :2]
    assert torch.equal(cache.dequantize()[:, 1:3], deq[:, :2]) and not cache.dequantize()[:, 3:].any()
    assert cache.nbytes == 2 * 6 * 3 * (8 * 4 + 2 * 2 * 2)
    for bad in (lambda: qt[:, :, :, 1:], lambda: qt[..., 0], lambda: qt.transpose(0, 3), lambda: qt.permute(3, 0, 1, 2),
                lambda: qt.reshape(2, 6, 192), lambda: qt.unsqueeze(4)):
        with pytest.raises((IndexError, ValueError), match="head dim|last dim|leading"):
            bad()
    with pytest.raises(TypeError, match="same format"):
        cache[:, 0:1] = tmf.quantize(x[:, :1], bits=8, group_size=32)


def test_quantized_zeros_and_flat_round_trip():
    for fmt in FORMATS:
        z = tmf.quantized_zeros((2, 5, 2, 96), dtype=torch.bfloat16, **fmt)
        assert z.shape == (2, 5, 2, 96) and z.dtype == torch.bfloat16 and not z.dequantize().any()
        back = from_flat(z.data, z.scales, z.biases, *flat_format(z))
        assert back.same_format(z) and back.shape == z.shape


@pytest.mark.parametrize("call,exc,match", [
    (lambda: tmf.quantize(torch.randn(4, 64), bits=3), ValueError, "bits: expected 4 or 8"),
    (lambda: tmf.quantize(torch.randn(4, 64), bits=4, mode="symmetric"), ValueError, "bits: expected 8"),
    (lambda: tmf.quantize(torch.randn(4, 64), group_size=16), ValueError, "group_size"),
    (lambda: tmf.quantize(torch.randn(4, 64), mode="fp8"), ValueError, "mode"),
    (lambda: tmf.quantize(torch.randn(4, 12), bits=4), ValueError, "multiple of 8"),
    (lambda: tmf.quantize(torch.randn(4, 64).double()), TypeError, "float16, bfloat16 or float32"),
    (lambda: tmf.quantize(torch.zeros(4, 64, dtype=torch.int32)), TypeError, "dtype"),
    (lambda: tmf.quantized_zeros((4, 64), dtype=torch.float64), TypeError, "dtype"),
    (lambda: QuantizedTensor(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 2), None, bits=4, group_size=32),
     TypeError, "biases"),
    (lambda: QuantizedTensor(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 3), torch.zeros(2, 3), bits=4,
                             group_size=32), ValueError, r"scales: expected shape \(2, 2\)"),
    (lambda: QuantizedTensor(torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, 2), None, bits=8, group_size=32,
                             mode="symmetric"), TypeError, "float16"),
])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
