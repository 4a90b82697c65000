"""The MSL subset kernels use: types, constructors, swizzles, math, half rounding,
built-ins with their declared types, atomics, threadgroup memory parameters, binding rules."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from emu_helpers import lib
from torch_metal_flash import emulator


class Params(ctypes.Structure):
    _fields_ = [("n", ctypes.c_uint32), ("alpha", ctypes.c_float), ("_pad", ctypes.c_uint32 * 2),
                ("ivec", ctypes.c_int32 * 4), ("p3", ctypes.c_float * 3), ("tail", ctypes.c_float)]


@pytest.mark.parametrize("checked", [True, False])
def test_vectors_math_bits(checked):
    out = np.zeros(20, np.float32)
    h = np.array([1, 2, 3, 4], np.float16)
    bits = np.zeros(6, np.uint32)
    p = Params(n=7, alpha=0.5, ivec=(0, 0, 0, 9), p3=(0, 2.25, 0), tail=100.0)
    # safe math: the kernel tests isinf / isnan, which fast math may fold away (as on the GPU)
    lib("language.metal", math_mode="safe").vectors(out, h, bits, p, grid=32, threadgroup=32, checked=checked)
    expect = {0: 46, 1: 5, 2: 16, 3: 5, 4: 2, 5: 1010, 6: 10, 7: 15, 8: 7.75, 9: 1, 10: 21,
              11: 7 + 0.5 + 9 + 2.25 + 100, 12: 6, 13: -2, 14: 2.5, 15: 1, 16: 1, 17: np.float32(math.pi), 18: 1,
              19: 1}
    for k, v in expect.items():
        assert out[k] == pytest.approx(v, rel=1e-6), k
    assert bits.tolist() == [0x3F800000, 33108, 126, 0xBC, 0xC0003C00, 9097]


def test_half_rounds_after_every_operation():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(256).astype(np.float16)
    b = rng.standard_normal(256).astype(np.float16)
    out = np.zeros(256, np.float16)
    lib("language.metal").half_math(a, b, out, grid=256, threadgroup=64)
    f = np.float16
    t = (a * b).astype(f)
    t = (t + a).astype(f)
    t = (t * f(0.1)).astype(f)
    t = (t - b).astype(f)
    ref = (t / (b + f(3)).astype(f)).astype(f)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("grid,tg", [((10, 3, 1), (4, 2, 1)), ((64, 1, 1), (64, 1, 1)), ((5, 2, 2), (8, 8, 1))])
def test_builtins_non_uniform_threadgroups(grid, tg):
    n = grid[0] * grid[1] * grid[2]
    out = np.zeros((n, 16), np.uint32)
    lib("language.metal").builtins(out, grid=grid, threadgroup=tg)
    ntg = [(g + t - 1) // t for g, t in zip(grid, tg)]
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                o = out[z * grid[1] * grid[0] + y * grid[0] + x]
                tgx, tgy = x // tg[0], y // tg[1]
                tx, ty = x % tg[0], y % tg[1]
                size = [min(tg[0], grid[0] - tgx * tg[0]), min(tg[1], grid[1] - tgy * tg[1])]
                tidx = (z % tg[2]) * size[0] * size[1] + ty * size[0] + tx
                nthreads = size[0] * size[1] * min(tg[2], grid[2] - (z // tg[2]) * tg[2])
                assert list(o[:3]) == [x, y, z]
                assert list(o[3:7]) == [tx, ty, tgx, tgy]
                assert list(o[7:10]) == [size[0], size[1], ntg[0]]
                assert list(o[10:16]) == [tidx, tidx // 32, tidx % 32, (nthreads + 31) // 32, 64, ntg[1]]


@pytest.mark.parametrize("checked", [True, False])
def test_atomics(checked):
    n, tg = 1000, 128
    x = torch.rand(n)
    counter = torch.zeros(1, dtype=torch.int32)
    fsum = torch.zeros(1)
    imax = torch.full((1,), -(2 ** 31), dtype=torch.int32)
    per_tg = torch.zeros(8, dtype=torch.int32)
    st = lib("language.metal").atomics(counter, fsum, imax, per_tg, x, grid=n, threadgroup=tg, checked=checked)
    assert counter.item() == n
    assert fsum.item() == pytest.approx(x.double().sum().item(), rel=1e-4)
    assert imax.item() == int((x * 1000).max().item())
    assert per_tg.tolist() == [128] * 7 + [n - 7 * 128]
    assert st.atomics == 4 * n + 8 + 8  # 4 per thread, a store and a load per threadgroup


def test_threadgroup_parameters_and_stats():
    x = torch.randn(256)
    y = torch.zeros(256)
    st = lib("language.metal").tg_param(x, y, grid=256, threadgroup=64, threadgroup_memory={0: 64 * 4, 1: 16})
    torch.testing.assert_close(y, x.view(4, 64).flip(1).reshape(-1) + 7)
    assert st.threadgroup_memory == 64 * 4 + 16
    assert st.barriers == 4
    assert st.threadgroup_bytes_written == 256 * 4 + 4 * 4
    with pytest.raises(emulator.LaunchError, match=r"threadgroup_memory=\{1: nbytes\}"):
        lib("language.metal").tg_param(x, y, grid=256, threadgroup=64, threadgroup_memory={0: 256})


def test_binding_rules():
    k = lib("language.metal").half_math
    a = torch.randn(300).half()
    b = torch.randn(300).half()
    big = torch.zeros(400, dtype=torch.half)
    view = big[50:350]  # storage offset: the kernel sees element 50 as index 0
    k(a, b, view, grid=300, threadgroup=32)
    assert big[:50].eq(0).all() and big[350:].eq(0).all() and not view.eq(0).all()
    out2 = np.zeros(300, np.float16)
    k(buffers={0: a.numpy(), 1: b, 2: out2}, grid=300, threadgroup=32)
    np.testing.assert_array_equal(out2, view.numpy())
    with pytest.raises(emulator.LaunchError, match="not bound"):
        k(a, b, grid=300, threadgroup=32)
    with pytest.raises(emulator.LaunchError, match="1..1024"):
        k(a, b, out2, grid=300, threadgroup=2048)
    with pytest.raises(AttributeError, match="no kernel named"):
        lib("language.metal").nope


def test_scalar_arguments_take_the_declared_type():
    src = """
    #include <metal_stdlib>
    using namespace metal;
    kernel void k(device float* out [[buffer(0)]], constant half& h [[buffer(1)]], constant int& i [[buffer(2)]],
                  constant bool& b [[buffer(3)]], constant ulong& u [[buffer(4)]], constant bfloat& bf [[buffer(5)]],
                  uint gid [[thread_position_in_grid]]) {
      out[0] = float(h); out[1] = float(i); out[2] = b ? 1.0f : 0.0f; out[3] = float(u >> 32); out[4] = float(bf);
    }
    """
    lib_ = emulator.compile_shader(src, name="scalars.metal")
    out = torch.zeros(5)
    lib_.k(out, 0.1, -3, True, 5 << 32, 2.5, grid=1, threadgroup=1)
    assert out.tolist() == [pytest.approx(float(np.float16(0.1))), -3, 1, 5, 2.5]


def test_full_signature_instantiations_and_implicit_buffer_indices():
    # MLX's older style: the instantiation repeats the signature; parameters without
    # an attribute get the next free buffer index.
    src = r"""
    #include <metal_stdlib>
    using namespace metal;
    template <typename T, int N>
    [[kernel]] void scale_add(const device T* x [[buffer(0)]], device T* y [[buffer(1)]],
                              const constant float& alpha, const constant int& n,
                              uint i [[thread_position_in_grid]]) {
      if (int(i) < n) y[i] = static_cast<T>(float(x[i]) * alpha + float(N));
      float4 v = static_cast<float4>(half4(1.0h));
      if (i == 0 && v.w != 1.0f) y[0] = T(-1);
    }
    #define inst(tname, type, n)                                                     \
      template [[host_name("scale_add_" #tname "_" #n)]] [[kernel]] void             \
      scale_add<type, n>(const device type* x [[buffer(0)]], device type* y [[buffer(1)]], \
                         const constant float& alpha, const constant int& n_,         \
                         uint i [[thread_position_in_grid]]);
    inst(float32, float, 1)
    inst(float16, half, 2)
    """
    lib_ = emulator.compile_shader(src, name="full_signature.metal")
    assert lib_.kernel_names == ["scale_add_float32_1", "scale_add_float16_2"]
    x = torch.arange(10, dtype=torch.float16)
    y = torch.zeros(10, dtype=torch.float16)
    lib_.scale_add_float16_2(x, y, 0.5, 9, grid=10, threadgroup=4)
    assert y.tolist() == [v * 0.5 + 2 for v in range(9)] + [0.0]


def test_bool_vectors_from_comparisons():
    src = """
    #include <metal_stdlib>
    using namespace metal;
    kernel void k(device float* y [[buffer(0)]]) {
      float4 a = float4(1, 2, 3, 4), b = float4(2.5f);
      bool4 m = a > b;
      bool2 m2 = bool2(true, false);
      y[0] = float(all(m2)) + (any(m) ? 10.0f : 0.0f) + float(m[3]) + 100.0f * float(m[0]);
      y[1] = select(float4(0), float4(1), m).z + float(all(bool4(a > float4(0))));
    }
    """
    y = torch.zeros(2)
    emulator.compile_shader(src, name="bools.metal").k(y, grid=1, threadgroup=1)
    assert y.tolist() == [11.0, 2.0]
