"""Metal 4 tensor ops: matmul2d on cooperative tensors against float64, the
element-to-lane layouts of Apple10 and Apple8/9 (following emulator.settings(family=...)), bounds,
divergence and the language version."""
from __future__ import annotations

import re

import pytest
import torch

from torch_metal_flash import emulator
from emu_helpers import KERNELS, lib
from support.tensor_layouts import LAYOUTS, apple8_layout, apple10_layout, offsets

DTYPES = {"half": torch.float16, "bfloat": torch.bfloat16, "float": torch.float32}
# relative error of one rounding to the destination type (float accumulation is exact enough below it)
ROUNDING = {"half": 2 ** -10, "bfloat": 2 ** -7, "float": 2 ** -20}


def tensor_ops_lib():
    return lib("tensor_ops.metal", language_version="4.0")


@pytest.mark.parametrize("family", ["apple10", "apple8"])
def test_layout_is_a_bijection_onto_16x16_fragments(family):
    layout = LAYOUTS[family]
    for rows, cols in [(16, 16), (16, 32), (32, 16), (32, 32)]:
        for t in (False, True):
            seen = [rc for lane in range(32) for rc in layout(rows, cols, lane, t)]
            assert sorted(seen) == [(r, c) for r in range(rows) for c in range(cols)]


def test_the_two_layouts():
    # Apple10: lane 0 holds rows 0 and 8, columns 0..3 of the first fragment; lane 1 columns 4..7; lane 2 row 1
    assert apple10_layout(16, 16, 0) == [(0, 0), (0, 1), (0, 2), (0, 3), (8, 0), (8, 1), (8, 2), (8, 3)]
    assert apple10_layout(16, 16, 1)[0] == (0, 4) and apple10_layout(16, 16, 2)[0] == (1, 0)
    assert apple10_layout(16, 16, 8)[0] == (0, 8)
    assert apple10_layout(16, 32, 0)[8] == (0, 16)  # the second fragment lies to the right of the first
    assert apple10_layout(32, 16, 0)[8] == (16, 0)  # ... or below it
    # Apple8/9: columns in pairs {0, 1, 8, 9}; lane 1 columns 2, 3, 10, 11; lane 2 row 1; lane 16 row 4
    assert apple8_layout(16, 16, 0) == [(0, 0), (0, 1), (0, 8), (0, 9), (8, 0), (8, 1), (8, 8), (8, 9)]
    assert apple8_layout(16, 16, 1)[0] == (0, 2) and apple8_layout(16, 16, 2)[0] == (1, 0)
    assert apple8_layout(16, 16, 8)[0] == (0, 4) and apple8_layout(16, 16, 16)[0] == (4, 0)
    # a 16-row strip runs its first row across both fragments, then its second (PyTorch's mma slot order)
    assert apple8_layout(16, 32, 0)[4:8] == [(0, 16), (0, 17), (0, 24), (0, 25)]
    assert apple8_layout(16, 32, 0)[8] == (8, 0)
    # stored transposed: the same logical layout (PyTorch's BaseMPPFragK_Apple8 for K in Q @ K^T)
    assert apple8_layout(32, 16, 0, True)[:4] == [(0, 0), (1, 0), (8, 0), (9, 0)]


def kernel_cases():
    text = (KERNELS / "tensor_ops.metal").read_text()
    cases = []
    for line in re.findall(r"^(?:FORMS|MATMUL)\((.*)\)$", text, re.M):
        args = [a.strip() for a in line.split(",")]
        if len(args) == 6:  # FORMS: every transpose and mode
            cases += [args + [tl, tr, acc] for acc in ("false", "true") for tr in ("false", "true")
                      for tl in ("false", "true")]
        elif len(args) == 9 and args[0] != "ta":
            cases.append(args)
    return cases


CASES = kernel_cases()


@pytest.mark.parametrize("family", ["apple10", "apple9"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "_".join(c))
def test_matmul_against_float64(case, family):
    ta, tb, td, m, n, k, tl, tr, acc = case
    m, n, k = int(m), int(n), int(k)
    tl, tr, acc = tl == "true", tr == "true", acc == "true"
    torch.manual_seed(m * 7 + n * 5 + k + 2 * tl + tr)
    left, right = ((k, m) if tl else (m, k)), ((n, k) if tr else (k, n))
    a = torch.randn(left).to(DTYPES[ta])
    b = torch.randn(right).to(DTYPES[tb])
    d0 = torch.randn(m, n).to(DTYPES[td])
    A = a.double().t() if tl else a.double()
    B = b.double().t() if tr else b.double()
    ref = A @ B + (d0.double() if acc else 0)
    offs = offsets([(*left, tl), (*right, tr), (m, n, False)], family)
    kern = tensor_ops_lib()[f"mm_{ta}_{tb}_{td}_{m}x{n}x{k}_" + "_".join(case[6:])]
    results = []
    for order in ("forward", "reverse"):
        d = d0.clone()
        with emulator.settings(family=family):
            st = kern(a, b, d, offs, grid=32, threadgroup=32, order=order, checked=order == "forward")
        assert (st.tensor_matmuls, st.tensor_matmul_macs, st.simdgroup_matrix_multiplies) == (1, m * n * k, 0)
        results.append(d)
    assert torch.equal(results[0], results[1])
    scale = (A.abs() @ B.abs() + (d0.double().abs() if acc else 0))
    err = (results[0].double() - ref).abs()
    assert (err <= scale * (ROUNDING[td] + k * 2 ** -23) + 1e-30).all(), err.max()


def test_a_kernel_written_for_one_layout_is_wrong_under_the_other():
    torch.manual_seed(1)
    a, b = torch.randn(16, 16), torch.randn(16, 32)
    kern = tensor_ops_lib()["mm_float_float_float_16x32x16_false_false_false"]
    for written, run_as in (("apple10", "apple8"), ("apple8", "apple10")):
        d = torch.zeros(16, 32)
        with emulator.settings(family=run_as):
            kern(a, b, d, offsets([(16, 16, False), (16, 32, False), (16, 32, False)], written), grid=32,
                 threadgroup=32)
        assert (d.double() - a.double() @ b.double()).abs().max() > 1


def test_element_index_past_the_capacity_is_out_of_bounds():
    kern = tensor_ops_lib().element_out_of_range
    out = torch.zeros(32)
    kern(out, 7, grid=32, threadgroup=32)
    assert out.tolist() == [0.0] * 32
    for checked in (True, False):
        with pytest.raises(emulator.OutOfBoundsError, match=r"cooperative tensor element index out of range: "
                                                            r"index 8 >= capacity 8"):
            kern(torch.zeros(32), 8, grid=32, threadgroup=32, checked=checked)


def test_run_by_part_of_a_simdgroup_is_divergence():
    with pytest.raises(emulator.SimdgroupMatrixDivergenceError, match="tensor-op matmul2d .* executed by 16 of 32"):
        tensor_ops_lib().divergent_run(torch.zeros(32), grid=32, threadgroup=32)


def test_tensor_ops_need_metal_4():
    for older in ("3.0", "3.1", "3.2"):
        with pytest.raises(emulator.CompileError) as ei:
            emulator.compile_shader(KERNELS / "tensor_ops.metal", language_version=older)
        assert ei.value.rule == "language-version" and ei.value.line == 7
    # unstated, the version is the one the source needs (Metal's default is the newest)
    assert emulator.compile_shader(KERNELS / "tensor_ops.metal").kernel_names
    with pytest.raises(ValueError, match="language_version must be one of"):
        emulator.compile_shader(KERNELS / "tensor_ops.metal", language_version="5")


@pytest.mark.parametrize("shape", ["16, 24, 16", "0, 16, 16"])
def test_descriptor_dimensions_are_multiples_of_16(shape):
    src = f"""#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
kernel void k(device float* out [[buffer(0)]]) {{
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor({shape});
  mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
  auto ct = op.template get_left_input_cooperative_tensor<float, float, float>();
  out[0] = ct.get_capacity();
}}
"""
    with pytest.raises(emulator.CompileError, match="matmul2d's m, n and k must be positive multiples of 16"):
        emulator.compile_shader(src, name="desc.metal", language_version="4.0")
