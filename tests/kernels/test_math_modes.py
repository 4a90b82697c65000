"""Every project kernel in every math mode the Metal launcher can select
(MTLMathMode fast, relaxed, safe; docs/metal_launcher.md) against the float64
oracle, on a reduced grid per mode: the cases that reach the kernels' masking,
empty-row and saturation paths, where a kernel that computed with infinities
would break under fast math.  The rest of the suite runs in the launcher's
one mode (safe).  Builds are shared per mode (one per shader file)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import forward_cases as fc  # noqa: E402
import test_backward_kernels as bwd  # noqa: E402
import test_decode_kernels as dec  # noqa: E402
import test_forward_kernels as fwd  # noqa: E402
import test_quantized_kernels as quant  # noqa: E402
from support import varlen_cases as vc  # noqa: E402
from torch_metal_flash import emulator  # noqa: E402
from support.kvcache_cases import make_case  # noqa: E402
from torch_metal_flash.problem.spec import make_spec  # noqa: E402

MODES = ("fast", "relaxed", "safe")
FORWARD = [
    dict(dtype="f16", d=64, lq=17, lk=65, masking="causal_br", hq=4, hkv=2, feature="all", layout="bhld"),
    dict(dtype="bf16", d=80, lq=29, lk=65, masking="window", hq=2, hkv=2, feature="bias_full", layout="blhd"),
    dict(dtype="f32", d=32, lq=3, lk=17, masking="diag_neg", hq=6, hkv=3, feature="sinks", layout="bhld"),
    dict(dtype="f32", d=128, lq=9, lk=100, masking="none", hq=2, hkv=1, feature="bool_full", layout="bhld"),
]
BACKWARD = [
    dict(dtype="f16", d=64, lq=17, lk=17, masking="causal_tl", hq=4, hkv=2, feature="all", layout="bhld",
         dlse=True),
    dict(dtype="f32", d=32, lq=23, lk=41, masking="window_sym", hq=2, hkv=1, feature="bias_full", layout="blhd",
         dbias=True),
]
DECODE = [dec.CASES[0], dec.CASES[3], dec.CASES[6]]  # splits + GQA 4; softcap; ALiBi (b, h), window, leftpad
# Varlen (ragged, with empty sequences) and dropout (the Philox mask, its S_dmask pass), forward and
# backward; paged K/V with seqused_k (forward).
VARLEN = [
    dict(dtype="f16", h=4, hkv=2, d=32, lens_q=[5, 0, 1, 17], lens_k=[7, 3, 0, 17], window=(3, 0), alibi="bh",
         softcap=4.0, dropout=0.3),
    dict(dtype="f32", h=2, hkv=1, d=16, lens_q=[5, 0, 1, 17], lens_k=[7, 3, 0, 17], page=5, sinks=True,
         seqused=[6, 3, 0, 9]),
]


@pytest.mark.parametrize("mode", MODES)
def test_forward(mode):
    with emulator.settings(math_mode=mode):
        for c in FORWARD:
            fc.run_and_check(c, orders=("forward",))
        fwd.test_float_mask_min_and_inf_rows()  # finfo.min rows average, -inf rows see nothing
        fwd.test_fully_masked_rows_zero_and_inf_lse("f16")


@pytest.mark.parametrize("mode", MODES)
def test_backward(mode):
    with emulator.settings(math_mode=mode):
        for c in BACKWARD:
            bwd.run_and_check(c, orders=("forward",))
        bwd.test_fully_masked_rows_zero_grads("f32")
        bwd.test_rows_of_finfo_min_scores_pass_no_gradient()


@pytest.mark.parametrize("mode", MODES)
def test_varlen_and_dropout(mode):
    with emulator.settings(math_mode=mode):
        for c in VARLEN:
            x = vc.build(c)
            vc.check(x, vc.run(x))


@pytest.mark.parametrize("mode", MODES)
def test_decode(mode):
    with emulator.settings(math_mode=mode):
        for i, case in enumerate(DECODE):
            dec.run_orders(make_case(seed=700 + i, **case["kw"]), ("forward",), num_splits=case.get("splits", 0))
        dec.test_empty_and_full_rows()


@pytest.mark.parametrize("mode", MODES)
def test_decode_masks_sinks_quantized(mode):
    """The decode kernels' other paths: the append kernel quantizing rows, quantized and
    mixed-precision K/V, float masks with finfo.min and -inf rows, sinks."""
    with emulator.settings(math_mode=mode):
        quant.test_kvcache_face(0, quant.KV_CASES[0])  # affine 4-bit, append, splits
        quant.test_kvcache_face(2, quant.KV_CASES[2])  # int8 under float32 q, window, leftpad
        quant.test_op_with_sinks_and_window(quant.A4G32, "f32")
        g = torch.Generator().manual_seed(90)
        q = torch.randn(1, 4, 2, 64, generator=g).half()
        k, v = (torch.randn(1, 2, 300, 64, generator=g).half() for _ in range(2))
        mask = torch.zeros(1, 4, 2, 300)
        mask[..., 250:] = torch.finfo(torch.float32).min  # key padding
        mask[:, 1, 0] = torch.finfo(torch.float32).min  # a row of finfo.min: averages every key
        mask[:, 2, 1] = float("-inf")  # a row that sees nothing
        call = lambda: tuple(torch.ops.metal_flash.fwd(q, k, v, mask, None, None, 0.125, 0, -1, -1, 0.0,  # noqa: E731
                                                       False)[:2])
        quant._check_face(call, make_spec(q, k, v, mask, scale=0.125), ("forward", "reverse"))
