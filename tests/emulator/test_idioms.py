"""Valid Metal the emulator must accept and run like the GPU (kernels/idioms.metal):
Apple's operand rules for math functions (enums, scalar/vector mixes), the public
type traits and macros, address-space overloads and member functions, copies out
of constant memory, casts between vector types, llama.cpp-style kernels."""
from __future__ import annotations

import struct

import pytest
import torch

from emu_helpers import lib
from torch_metal_flash import emulator


@pytest.mark.parametrize("checked", [True, False])
def test_idioms(checked):
    xh = torch.arange(40, dtype=torch.float16)
    xc = torch.arange(1, 41, dtype=torch.float32)
    xd = torch.tensor([5.0])
    params = struct.pack("<fIH2x4f", 1.5, 7, 1, 1, 2, 3, 4)  # scale, n, layout (ColMajor), w
    acc = torch.tensor([[1.0, 2, 3, 4], [0, 0, 0, 0]])
    cacc = torch.ones(4)
    arr = torch.tensor([10.0, 20, 30, 40])
    out = torch.zeros(11)
    lib("idioms.metal").idioms(xh, xc, xd, params, acc, out, cacc, arr, grid=32, threadgroup=32, checked=checked)
    expect = [666, 703, 780, 6, 5 - 1, 3 + 7 + 100 + 4 + 4, 1010 + 2004, 14, 6, 16 + 2.25 + 4 + 2 + 1.5,
              7 + 8 + 1 + 3 + 2 + 2]
    assert out.tolist() == expect
    assert acc[1].tolist() == [2, 3, 4, 5]
    assert arr.tolist() == [10, 20, 14, 40]


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "rms_norm_f32"), (torch.float16, "rms_norm_f16")])
def test_llama_cpp_style_kernel(dtype, kernel):
    rows, n, eps = 3, 64, 1e-5
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = torch.zeros_like(x)
    nb01 = n * x.element_size()
    args = struct.pack("<i4xQf4x", n, nb01, eps)
    lib("idioms.metal")[kernel](args, x, y, grid=(rows * 64, 1, 1), threadgroup=(64, 1, 1),
                                threadgroup_memory={0: 32 * 4})
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + eps)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_max_total_threads_per_threadgroup():
    lib_ = lib("idioms.metal")
    assert lib_.pipeline_info("scaled_copy_2") == {"max_total_threads_per_threadgroup": 64,
                                                   "thread_execution_width": 32,
                                                   "static_threadgroup_memory_length": 0,
                                                   "max_threadgroup_memory_length": 32768}
    assert lib_.pipeline_info("idioms")["max_total_threads_per_threadgroup"] == 1024
    assert lib_.pipeline_info("idioms")["static_threadgroup_memory_length"] == 176  # float[40] + Accum, 16-byte units
    x, y = torch.arange(128.0), torch.zeros(128)
    lib_.scaled_copy_2(x, y, grid=128, threadgroup=64)
    assert torch.equal(y, 2 * x)
    with pytest.raises(emulator.LaunchError, match="max_total_threads_per_threadgroup"):
        lib_.scaled_copy_2(x, y, grid=128, threadgroup=(32, 4, 1))


VEC_CASTS = {"T(v)": [1, 2, 3, -4], "(T)v": [1, 2, 3, -4], "static_cast<T>(v)": [1, 2, 3, -4],
             "float4(v)": [1, 2, 3, -4], "(float4)v": [1, 2, 3, -4], "static_cast<float4>(v)": [1, 2, 3, -4],
             "(float4)(half4)v": [1, 2, 3, -4], "-(T)v.zyxw.zyxw * 2.0f + T(v.x)": [-1, -3, -5, 9],
             # a cast inside another cast's operand converts too
             "(T)(T(v) * 2.0f)": [2, 4, 6, -8]}


@pytest.mark.parametrize("form", VEC_CASTS)
def test_vector_casts_convert(form):
    # MSL converts a vector per component in every cast syntax; clang's C-style cast would reinterpret the bits
    src = f"""#include <metal_stdlib>
using namespace metal;
template <typename T, typename V>
METAL_FUNC T conv(V v) {{ return {form}; }}
kernel void k(device float4* out [[buffer(0)]], device const int4* in [[buffer(1)]]) {{
  out[0] = conv<float4>(in[0]);
}}
"""
    out = torch.zeros(4)
    emulator.compile_shader(src, name="casts.metal").k(out, torch.tensor([1, 2, 3, -4], dtype=torch.int32), grid=1,
                                                         threadgroup=1)
    assert out.tolist() == VEC_CASTS[form]


def test_unconverted_vector_cast_is_a_named_error():
    src = """#include <metal_stdlib>
using namespace metal;
typedef float4 F4;
kernel void k(device float4* out [[buffer(0)]], device const int4* in [[buffer(1)]]) {
  out[0] = (F4)in[0];
}
"""
    with pytest.raises(emulator.CompileError, match="emulator limitation: this cast between vector types") as ei:
        emulator.compile_shader(src, name="cast.metal")
    assert (ei.value.rule, ei.value.file, ei.value.line) == ("vector-cast", "cast.metal", 5)


@pytest.mark.parametrize("kernel", ["masked_scores_bool", "masked_scores_float"])
def test_bool_fragment_types(kernel):
    """metal::vec<T, N> instantiated with T = bool (a mask tile in a tiled library), one byte
    per lane as on the GPU, in the same file as the float instantiation."""
    n = 7
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.5 if kernel.endswith("bool") else torch.randn(n, generator=g)
    out = torch.zeros(n)
    lib("bool_fragments.metal")[kernel](scores, mask, out, n, grid=4, threadgroup=4)
    expect = torch.where(mask, scores, torch.tensor(-1000.0)) if mask.dtype == torch.bool else scores + mask
    assert torch.equal(out, expect)


def test_vec_still_deduces_its_element_type_and_size():
    """A source without vec<bool, N> keeps vec<T, N> deducible (the bool-lane build is only a retry)."""
    source = """
    #include <metal_stdlib>
    using namespace metal;
    template <typename T, int N> METAL_FUNC T total(metal::vec<T, N> v) {
      T s = 0;
      for (int i = 0; i < N; i++) s += v[i];
      return s;
    }
    [[kernel]] void sums(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
      out[gid] = total(float4(1, 2, 3, float(gid))) + float(total(int2(4, 5)));
    }
    """
    out = torch.zeros(2)
    emulator.compile_shader(source).sums(out, grid=2, threadgroup=2)
    assert out.tolist() == [15.0, 16.0]
