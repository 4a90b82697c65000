"""Idioms of public Metal code bases (MLX, PyTorch's MPS kernels, llama.cpp) the emulator must
accept and run like the GPU.  Each kernel here is ours, written in the idiom that a third-party
kernel tripped over (bench/results/third_party_kernels.md lists those kernels)."""
from __future__ import annotations

import math

import pytest
import torch

from torch_metal_flash import emulator

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"


def test_apple_compiler_builtins():
    """Apple's compiler builtins called directly (`__metal_exp(x, __METAL_FAST_MATH__)`, the
    `__metal_simd_*` collectives, `__metal_get_*(T())` built-in values): a bfloat math library
    builds its overloads of metal::exp, simd_sum ... on them."""
    src = HEADER + """
kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  float x = float(gid) * 0.25f;
  int e;
  float m = __metal_frexp(x + 1.0f, &e);
  out[gid * 8 + 0] = __metal_exp(x, __METAL_MAYBE_FAST_MATH__);
  out[gid * 8 + 1] = __metal_fmax3(x, 1.5f, -x, __METAL_PRECISE_MATH__);
  out[gid * 8 + 2] = __metal_simd_sum(x);
  out[gid * 8 + 3] = __metal_simd_xor(x);                  // on the bits of a float
  out[gid * 8 + 4] = __metal_simd_shuffle_down(x, ushort(1));
  out[gid * 8 + 5] = float(__metal_get_thread_index_in_simdgroup(ushort()));
  out[gid * 8 + 6] = float(__metal_get_simdgroup_size(ushort()));
  out[gid * 8 + 7] = m * 100.0f + float(e);
}
"""
    out = torch.zeros(32 * 8)
    emulator.compile_shader(src, name="builtins.metal").k(out, grid=32, threadgroup=32)
    out = out.view(32, 8)
    x = torch.arange(32) * 0.25
    bits = x.view(torch.int32)
    xor = bits[0]
    for b in bits[1:]:
        xor = xor ^ b
    frexp = [math.frexp(float(v) + 1) for v in x]
    torch.testing.assert_close(out[:, 0], torch.exp(x))
    assert out[:, 1].tolist() == torch.maximum(x, torch.tensor(1.5)).tolist()
    assert out[:, 2].tolist() == [float(x.sum())] * 32
    assert out[:, 3].view(torch.int32).tolist() == [int(xor)] * 32
    assert out[:31, 4].tolist() == x[1:].tolist()
    assert out[:, 5].tolist() == list(range(32)) and out[:, 6].tolist() == [32.0] * 32
    assert out[:, 7].tolist() == [m * 100 + e for m, e in frexp]


def test_bool_lanes_convert_as_bool_and_keep_explicit_specialisations():
    """A source that forms vec<bool, N> through a template is built with one-byte bool lanes:
    a float converts to such a lane as it converts to bool (0.5 -> true), and an explicit
    specialisation spelling bool in its signature (`template <> bool cast_to<bool, float>(float)`)
    still specialises its template."""
    src = HEADER + """
template <typename T> struct Frag {
  typedef metal::vec<T, 2> type;
  template <typename S> METAL_FUNC static type load(const device S* src) {
    type r;
    for (short j = 0; j < 2; j++) r[j] = static_cast<T>(src[j]);
    return r;
  }
};
template <typename U, typename T> METAL_FUNC U cast_to(T v) { return static_cast<U>(v); }
template <> METAL_FUNC bool cast_to<bool, float>(float v) { return (as_type<uint>(v) & 0x7FFFFFFF) > 0x3F000000; }

template <typename M>
kernel void k(const device float* src [[buffer(0)]], device float* out [[buffer(1)]],
              uint gid [[thread_position_in_grid]]) {
  typename Frag<M>::type m = Frag<M>::template load<float>(src + 2 * gid);
  out[4 * gid + 0] = m[0] ? 1.0f : 0.0f;
  out[4 * gid + 1] = m[1] ? 1.0f : 0.0f;
  out[4 * gid + 2] = cast_to<M, float>(src[2 * gid]) ? 1.0f : 0.0f;  // the specialisation: |x| > 0.5
  out[4 * gid + 3] = cast_to<int>(src[2 * gid + 1]);
}
template [[host_name("k_bool")]] kernel void k<bool>(const device float*, device float*, uint);
"""
    src_ = torch.tensor([0.5, 0.0, -0.25, -0.0, 2.0, 3.0])
    out = torch.zeros(12)
    emulator.compile_shader(src, name="bool_lanes.metal").k_bool(src_, out, grid=3, threadgroup=3)
    assert out.view(3, 4).tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 3]]


def test_conversion_functions_to_vector_types():
    """`operator float4() const` (a packed type converting to a vector) is a conversion function,
    not a vector constructor the pre-pass rewrites."""
    src = HEADER + """
struct Packed {
  float a, b;
  operator float4() const { return float4(a, b, a + b, a - b); }
  operator vec<half, 2>() const { return vec<half, 2>(half(a), half(b)); }
};
kernel void k(device float4* out [[buffer(0)]], device half2* h [[buffer(1)]]) {
  Packed p = {3.0f, 1.0f};
  out[0] = p;
  h[0] = half2(p);
}
"""
    out, h = torch.zeros(4), torch.zeros(2, dtype=torch.float16)
    emulator.compile_shader(src, name="conversion.metal").k(out, h, grid=1, threadgroup=1)
    assert out.tolist() == [3, 1, 4, 2] and h.tolist() == [3, 1]


def test_gated_off_reference_parameters_need_no_buffer():
    """An optional `constant int&` parameter gated by a function constant that is off needs no
    buffer, even where the optimiser loads through the reference (references are
    dereferenceable) ahead of the `if` that guards its use."""
    src = HEADER + """
constant bool has_mask [[function_constant(0)]];
kernel void k(const device float* x [[buffer(0)]], device float* out [[buffer(1)]],
              const device float* mask [[buffer(2), function_constant(has_mask)]],
              const constant int& mask_stride [[buffer(3), function_constant(has_mask)]],
              const constant int& n [[buffer(4)]], uint gid [[thread_position_in_grid]]) {
  float acc = 0;
  for (int i = 0; i < n; i++) {
    float s = x[i];
    if (has_mask) s += mask[gid * mask_stride + i];
    acc += s;
  }
  out[gid] = acc;
}
"""
    x, mask = torch.arange(6.0), torch.ones(2, 6)
    for on in (False, True):
        lib_ = emulator.compile_shader(src, name="gated.metal", function_constants={0: on})
        for checked in (True, False):
            out = torch.zeros(2)
            bufs = {2: mask, 3: 6} if on else {}
            lib_.k(x, out, buffers=bufs | {4: 6}, grid=2, threadgroup=2, checked=checked)
            assert out.tolist() == [15.0 + 6 * on] * 2


def test_pointer_advanced_by_an_integral_constant():
    """`src += str` with a compile-time stride held as a class converting to int (a tiled
    library's integral_constant<int, 1>): C++ for OpenCL offers no built-in candidate for it."""
    src = HEADER + """
template <typename T, T v> struct stride_c {
  METAL_FUNC constexpr operator T() const { return v; }
};
template <typename P, typename S>
METAL_FUNC float sum2(P src, S str) {
  float a = src[0];
  src += str;
  float b = src[0];
  src -= str;
  return a + b * 10.0f + src[0] * 100.0f;
}
kernel void k(const device float* x [[buffer(0)]], device float* out [[buffer(1)]]) {
  out[0] = sum2(x, stride_c<int, 1>{});
  out[1] = sum2(x, stride_c<short, 3>{});
}
"""
    out = torch.zeros(2)
    emulator.compile_shader(src, name="stride.metal").k(torch.arange(1.0, 5.0), out, grid=1, threadgroup=1)
    assert out.tolist() == [121.0, 141.0]


def test_indices_written_as_constant_expressions():
    """Function-constant and buffer indices written as macros that expand to arithmetic
    (`[[function_constant(FC_ROPE + 1)]]`), as large kernel libraries number them."""
    src = HEADER + """
#define FC_SCALE 800
#define BUF_OUT 0x1
constant bool use_scale [[function_constant(FC_SCALE + 0)]];
constant float scale [[function_constant(FC_SCALE + 1)]];
kernel void k(const device float* x [[buffer(BUF_OUT - 1)]], device float* out [[buffer(BUF_OUT)]],
              constant int& n [[buffer((BUF_OUT << 1) | 0u)]], uint gid [[thread_position_in_grid]]) {
  if (int(gid) < n) out[gid] = use_scale ? x[gid] * scale : x[gid];
}
"""
    lib_ = emulator.compile_shader(src, name="fc_index.metal", function_constants={800: True, 801: 3.0})
    out = torch.zeros(4)
    lib_.k(torch.arange(4.0), out, 3, grid=4, threadgroup=4)
    assert out.tolist() == [0, 3, 6, 0]


def test_scalars_meet_narrower_vectors_and_literals_are_float():
    """`slope * h4` (a float scalar and a half4) and `0.5 * v` in a template: MSL converts the
    scalar to the vector's element type; an unsuffixed literal is a float (`x * 0.1` rounds
    in float, as on the GPU)."""
    src = HEADER + """
template <typename T> METAL_FUNC T gelu_ish(T x) { return (T)(0.5 * x * (1 + x)); }
kernel void k(device half4* h [[buffer(0)]], device float4* v [[buffer(1)]], device float* s [[buffer(2)]]) {
  float slope = s[0];
  h[0] = slope * h[0] + h[0] * slope;
  v[0] = gelu_ish(v[0]);
  s[1] = gelu_ish(s[1]);
  s[2] = s[2] * 0.1;
}
"""
    h = torch.tensor([1.0, 2, 3, 4], dtype=torch.float16)
    v = torch.tensor([1.0, 2, 3, 4])
    s = torch.tensor([0.5, 3.0, 9.0])
    emulator.compile_shader(src, name="widths.metal").k(h, v, s, grid=1, threadgroup=1)
    assert h.tolist() == [1, 2, 3, 4] and v.tolist() == [1, 3, 6, 10]
    assert s[1].item() == 6.0 and s[2].item() == torch.tensor(9.0) * torch.tensor(0.1)  # float32 product


def test_matrix_types():
    """float4x4 / half4x4 / matrix<T, C, R>: column vectors (m[c][r]), conversions between
    element types by cast (a dequantiser's `reg = (type4x4)(*src)`), matrix-vector and
    matrix-matrix products, transpose, in device and threadgroup memory."""
    src = HEADER + """
typedef matrix<bfloat, 4, 4> bfloat4x4;
template <typename type4x4>
void load(device const float4x4* src, thread type4x4& reg) { reg = (type4x4)(*src); }
kernel void k(device const float4x4* a [[buffer(0)]], device half4x4* h [[buffer(1)]],
              device float4* o [[buffer(2)]], threadgroup half4x4* sh [[threadgroup(0)]]) {
  half4x4 t;
  load(a, t);
  sh[0] = t;
  h[0] = sh[0];
  float4x4 m = a[0];
  float2x4 p = float2x4(m[0], m[1]);
  o[0] = m * float4(1, 0, 0, 0);
  o[1] = float4(0, 1, 0, 0) * m;
  o[2] = (m * float4x4(2.0f))[3];
  o[3] = transpose(m)[0] + p * float2(1, 1);
  bfloat4x4 b = bfloat4x4(m);
  o[4] = float4(b[2]) + float4(h[0][1][2]);
}
"""
    a = torch.arange(16.0)
    h, o = torch.zeros(16, dtype=torch.float16), torch.zeros(5, 4)
    emulator.compile_shader(src, name="matrices.metal").k(a, h, o, grid=1, threadgroup=1,
                                                           threadgroup_memory={0: 32})
    cols = a.view(4, 4)  # m[c] is row c of the buffer
    m = cols.T
    assert h.tolist() == a.tolist()
    assert o.tolist() == [m[:, 0].tolist(), (torch.tensor([0.0, 1, 0, 0]) @ m).tolist(), (2 * m[:, 3]).tolist(),
                          (m.T[:, 0] + cols[0] + cols[1]).tolist(), (cols[2] + 6).tolist()]


def test_functions_as_template_arguments():
    """A function as a non-type template argument (`template <void (*deq)(...)>`, a kernel
    templated on its dequantiser) is resolved at compile time: valid Metal.  A pointer used at
    run time stays an error (kernels/rejected/function_pointer*.metal)."""
    src = HEADER + """
void deq_scale(device const float* src, short i, thread float4& reg) { reg = float4(src[i]) * 2.0f; }
void deq_plain(device const float* src, short i, thread float4& reg) { reg = float4(src[i]); }
template <void (*deq)(device const float*, short, thread float4&)>
kernel void k(device const float* x [[buffer(0)]], device float4* out [[buffer(1)]],
              uint gid [[thread_position_in_grid]]) {
  float4 r;
  deq(x, short(gid), r);
  out[gid] = r;
}
typedef decltype(k<deq_plain>) k_t;
template [[host_name("k_scale")]] kernel k_t k<deq_scale>;
template [[host_name("k_plain")]] kernel k_t k<deq_plain>;
"""
    lib_ = emulator.compile_shader(src, name="fn_args.metal")
    out = torch.zeros(2, 4)
    lib_.k_scale(torch.tensor([1.0, 2.0]), out, grid=2, threadgroup=2)
    assert out.tolist() == [[2.0] * 4, [4.0] * 4]
    lib_.k_plain(torch.tensor([1.0, 2.0]), out, grid=2, threadgroup=2)
    assert out.tolist() == [[1.0] * 4, [2.0] * 4]


def test_dequantiser_style_kernel():
    """Idioms of a quantised mat-vec library: vectors brace-initialised with fewer elements than
    lanes (`float4 a = {0.f}, b = {1.f};`, the rest zero), a dequantiser passed as a template
    argument whose `thread T&` parameter deduces T, `#pragma unroll(MACRO(...))`, a filled
    simdgroup matrix with one size (`make_filled_simdgroup_matrix<float, 8>(0.f)`), and a
    conditional mixing a vector and a wider scalar (`p ? h4 * s : 0.0f`)."""
    src = HEADER + """
#define MIN(x, y) ((x) < (y) ? (x) : (y))
template <typename type4>
void deq_half(device const half4* src, short il, thread type4& reg) { reg = (type4)(src[il]); }
template <typename T4, void (&deq)(device const half4*, short, thread T4&)>
kernel void k(device const half4* x [[buffer(0)]], device float4* out [[buffer(1)]],
              device const half4* m [[buffer(2)]], constant float& s [[buffer(3)]],
              ushort lane [[thread_index_in_simdgroup]]) {
  float4 a = {0.f}, b = {1.f, 2.f};
  T4 r;
  #pragma unroll (MIN(4, 2))
  for (short i = 0; i < 2; i++) {
    deq(x, i, r);
    a += r;
  }
  simdgroup_float8x8 z = make_filled_simdgroup_matrix<float, 8>(3.f);
  device const half4* pm = s > 0 ? m : nullptr;
  half4 h = pm ? pm[0] * s : 0.0f;
  if (lane != 0) return;
  out[0] = a;
  out[1] = b + z.thread_elements()[0];
  out[2] = float4(h);
}
template [[host_name("k_f32")]] kernel void k<float4, deq_half>(
    device const half4*, device float4*, device const half4*, constant float&, ushort);
"""
    x = torch.arange(8.0).half()
    out = torch.zeros(3, 4)
    lib_ = emulator.compile_shader(src, name="dequant.metal")
    lib_.k_f32(x, out, torch.ones(4).half(), 2.0, grid=32, threadgroup=32)
    assert out.tolist() == [[4, 6, 8, 10], [4, 5, 3, 3], [2, 2, 2, 2]]


def test_helpers_in_their_own_namespace():
    """A helper library in its own namespace without `using namespace metal`: as_type<T>(x) is a
    language operator found anywhere, and T(x, y) with T = float2 (a complex product written for
    any T) constructs the vector."""
    src = """#include <metal_stdlib>
namespace mylib {
template <typename T> inline T cmul(T x, T y) { return T(x.x * y.x - x.y * y.y, x.x * y.y + x.y * y.x); }
inline uint bits(float v) { return as_type<uint>(v); }
}  // namespace mylib
kernel void k(device float2* z [[buffer(0)]], device uint* b [[buffer(1)]]) {
  z[0] = mylib::cmul(z[0], z[1]);
  b[0] = mylib::bits(1.0f);
}
"""
    z, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(1, dtype=torch.int32)
    emulator.compile_shader(src, name="namespaced.metal").k(z, b, grid=1, threadgroup=1)
    assert z[:2].tolist() == [1 * 3 - 2 * 4, 1 * 4 + 2 * 3] and b.item() == 0x3F800000


def test_uniform_values():
    """metal::uniform<T> / make_uniform (a value the same in every thread, as a tiled mat-vec
    marks its loop bounds) behaves as the T it holds, also in constexpr."""
    src = HEADER + """
kernel void k(device int* out [[buffer(0)]], constant int& n [[buffer(1)]]) {
  constexpr const uniform<int> stride = make_uniform(8);
  const uniform<int> size = make_uniform(n);
  const uniform<int> iters = size / stride;
  const uniform<float> half_n = make_uniform(float(n)) * make_uniform(0.5f);
  out[0] = iters;
  out[1] = size - stride * iters;
  out[2] = int(half_n);
}
"""
    out = torch.zeros(3, dtype=torch.int32)
    emulator.compile_shader(src, name="uniform.metal").k(out, 37, grid=1, threadgroup=1)
    assert out.tolist() == [4, 5, 18]


@pytest.mark.parametrize("decl", ["typedef float (*op_t)(float);", "using op_t = float (*)(float);"])
def test_function_pointer_types_named_by_typedef(decl):
    """A function-pointer template parameter whose type is named by a typedef / alias works;
    the same type used for a pointer at run time is still rejected."""
    head = HEADER + decl + "\nfloat twice(float x) { return 2 * x; }\n"
    good = head + """template <op_t op> kernel void k(device float* o [[buffer(0)]]) { o[0] = op(o[0]); }
template [[host_name("k_twice")]] kernel void k<twice>(device float*);
"""
    out = torch.ones(1)
    emulator.compile_shader(good, name="op_types.metal").k_twice(out, grid=1, threadgroup=1)
    assert out.item() == 2.0
    bad = head + "kernel void k(device float* o [[buffer(0)]]) { op_t f = twice; o[0] = f(o[0]); }\n"
    with pytest.raises(emulator.CompileError) as ei:
        emulator.compile_shader(bad, name="op_types_bad.metal")
    assert (ei.value.rule, ei.value.line) == ("function-pointers", 5)


def test_void_buffer_parameters():
    """`device const void* src` (a byte buffer the kernel casts itself) binds like any buffer."""
    src = HEADER + """
kernel void k(device const void* src [[buffer(0)]], device void* dst [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  ((device float*)dst)[i] = ((device const float*)src)[i] * 2.0f;
}
"""
    x, y = torch.arange(4.0), torch.zeros(4)
    emulator.compile_shader(src, name="void_buffers.metal").k(x, y, grid=4, threadgroup=4)
    assert y.tolist() == [0, 2, 4, 6]


def test_const_constant_array_as_non_const_pointer_is_a_named_limitation():
    """`constexpr constant float table[4]` passed as `constant float*`: Metal allows it (constant
    memory is read-only), C++ for OpenCL does not; the error names the limitation and the
    spelling that works."""
    src = HEADER + """constexpr constant float table[4] = {1, 2, 3, 4};
static inline float pick(constant PTR t, int i) { return t[i]; }
kernel void k(device float* o [[buffer(0)]]) { o[0] = pick(table, 2); }
"""
    with pytest.raises(emulator.CompileError, match="emulator limitation: a const object in constant memory") as ei:
        emulator.compile_shader(src.replace("PTR", "float*"), name="table.metal")
    assert (ei.value.rule, ei.value.line) == ("constant-const", 5)
    out = torch.zeros(1)
    emulator.compile_shader(src.replace("PTR", "const float*"), name="table.metal").k(out, grid=1, threadgroup=1)
    assert out.item() == 3.0


def test_nax_tile_idioms():
    """MLX's NAX tiles: a vector whose lane count is a template argument initialised as `v{0}` (the
    rest zero), `thread T*` parameters deducing T from a cast to a thread pointer (T = float, not
    an address-space-qualified float), and <metal_logging>'s os_log (MSL 3.2) at program scope."""
    src = """#include <metal_stdlib>
#include <metal_logging>
using namespace metal;
constant os_log logger("test", "nax");
template <typename T, int N> struct Tile {
  vec<T, 4> frag;
  template <typename U> static void reduce(const thread vec<U, 4>& in, thread U* acc) {
    for (int i = 0; i < 4; i++) acc[i / 2] += in[i];
  }
  void row_sums(thread vec<T, N>& sums) const thread {
    vec<T, N> start{T(0.5)};  // lanes past the first are zero
    sums += start - vec<T, N>(T(0.5), T(0));
    auto p = (thread T*)(&sums);
    reduce(frag, &p[0]);
  }
};
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  Tile<float, 2> t;
  t.frag = float4(1, 2, 3, 4) * float(i + 1);
  vec<float, 2> sums{0};
  vec<float, 3> partial{5};
  t.row_sums(sums);
  logger.log_debug("row sums %f", sums.x);
  out[i * 4 + 0] = sums.x;
  out[i * 4 + 1] = sums.y;
  out[i * 4 + 2] = partial.x;
  out[i * 4 + 3] = partial.y + partial.z;
}
"""
    out = torch.full((8,), -1.0)
    emulator.compile_shader(src, name="nax_tiles.metal", language_version="3.2").k(out, grid=2, threadgroup=2)
    assert out.tolist() == [3.0, 7.0, 5.0, 0.0, 6.0, 14.0, 5.0, 0.0]
