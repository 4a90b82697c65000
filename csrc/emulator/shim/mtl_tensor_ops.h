// Metal 4 tensor ops on cooperative tensors (MetalPerformancePrimitives):
// mpp::tensor_ops::matmul2d run by one simdgroup (metal::execution_simdgroup).
// Kernels reach it through <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
// (include/, which needs MSL 4.0 and names it mpp); docs/emulator.md
// "Tensor ops (Metal 4)".
//
// Which element of which lane holds which entry of an operand depends on the
// GPU family; the launch says which (MtlLaunch::tensor_layout, from the
// family the emulator runs as).  Both layouts split an operand into 16 x 16
// fragments; lane l holds 8 entries of each, in two rows 8 apart.
// * Apple10 (the layout MLX's NAX kernels read and write): the operand AS
//   STORED (left M x K, or K x M with transpose_left; right K x N, or N x K
//   with transpose_right), fragments in row-major order; element
//   e = f * 8 + i is in fragment f at
//     row = ((l >> 2) & 4 | (l >> 1) & 3) + (i >> 2) * 8,
//     col = ((l >> 2) & 2 | l & 1) * 4 + i % 4   (four contiguous columns).
// * Apple8/9 (PyTorch's MppAttention.h, BaseMPPFrag::get_coord): the operand
//   in its LOGICAL orientation (left M x K, right K x N, whatever the
//   transposes); in a fragment the lane holds rows fm, fm + 8 and columns
//   fn + {0, 1, 8, 9}, fm = ((l >> 4) & 1) * 4 + ((l >> 1) & 3),
//   fn = ((l >> 3) & 1) * 4 + (l & 1) * 2; elements run along a 16-row strip:
//   its first row across every fragment (4 per fragment), then its second.
// run() is a rendezvous of the 32 lanes, like simdgroup_multiply_accumulate.
#pragma once
#pragma clang system_header

namespace metal {
// The execution scope of a tensor op: the 32 lanes of one simdgroup.
struct execution_simdgroup {};
}  // namespace metal

namespace __mtl {
namespace mpp {
namespace tensor_ops {

// The descriptor is a class in Metal, used as a template argument of
// matmul2d.  C++ for OpenCL (C++17) has no class-type template parameters:
// matmul2d takes it as a packed integer, which the descriptor converts to
// (m, n, k: 16 bits each; then transposes, relaxed precision, mode).
struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;

  constexpr matmul2d_descriptor(int m_, int n_, int k_, bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
  constexpr operator unsigned long() const {
    return (unsigned long)(m & 0xFFFF) | (unsigned long)(n & 0xFFFF) << 16 | (unsigned long)(k & 0xFFFF) << 32 |
           (unsigned long)transpose_left << 48 | (unsigned long)transpose_right << 49 |
           (unsigned long)relaxed_precision << 50 | (unsigned long)(matmul_mode == mode::multiply_accumulate) << 51;
  }
};

}  // namespace tensor_ops
}  // namespace mpp

template <unsigned long D> struct mm_desc {
  enum : int { m = D & 0xFFFF, n = (D >> 16) & 0xFFFF, k = (D >> 32) & 0xFFFF };
  enum : bool { tl = (D >> 48) & 1, tr = (D >> 49) & 1, acc = (D >> 51) & 1 };
  // the operands as stored: rows, columns
  enum : int { left_rows = tl ? k : m, left_cols = tl ? m : k, right_rows = tr ? n : k, right_cols = tr ? k : n };
};

template <class T> inline constexpr constant bool tensor_elem_ok =
    __is_same(T, half) || __is_same(T, bfloat) || __is_same(T, float);

// Where element e of lane l is in an operand stored as rows x cols; `transposed`: stored transposed to its
// logical orientation (transpose_left / transpose_right).
MTL_INLINE void ct_coord(int layout, uint lane, int e, int rows, int cols, bool transposed, thread int& row,
                         thread int& col) {
  if (layout == MTL_LAYOUT_APPLE10) {
    int f = e / 8, i = e % 8, per_row = cols / 16;
    row = (f / per_row) * 16 + ((((lane >> 2) & 4) | ((lane >> 1) & 3)) + (i >> 2) * 8);
    col = (f % per_row) * 16 + (((((lane >> 2) & 2) | (lane & 1)) * 4) + i % 4);
    return;
  }
  int lcols = transposed ? rows : cols, per_row = lcols / 16;
  int strip = e / (8 * per_row), row8 = e % (8 * per_row) / (4 * per_row), f = e % (4 * per_row) / 4, j = e % 4;
  int r = strip * 16 + (int)(((lane >> 4) & 1) * 4 + ((lane >> 1) & 3)) + row8 * 8;
  int c = f * 16 + (int)(((lane >> 3) & 1) * 4 + (lane & 1) * 2) + ((j & 1) | (j >> 1) << 3);
  row = transposed ? c : r;
  col = transposed ? r : c;
}

extern "C" int __mtl_rt_tensor_layout(void);
extern "C" void __mtl_rt_fail(int code, const char* msg, const char* file, uint32_t line);

// A cooperative tensor: the slice of a Rows x Cols operand one lane holds.
template <class T, int Rows, int Cols>
struct cooperative_tensor {
  static_assert(tensor_elem_ok<T>, "MSL tensor ops: the emulator's matmul2d takes half, bfloat and float elements");
  enum : int { capacity = Rows * Cols / 32 };
  typedef T element_type;
  T __e[capacity];

  static constexpr int get_capacity() { return capacity; }
  MTL_INLINE thread T& operator[](int i) {
    if ((unsigned)i >= (unsigned)capacity) fail_index(i);
    return ((thread T*)__e)[i];
  }
  MTL_INLINE const thread T& operator[](int i) const {
    if ((unsigned)i >= (unsigned)capacity) fail_index(i);
    return ((const thread T*)__e)[i];
  }
  // An index past the lane's elements: an OutOfBoundsError, as on memory (both builds check it).
  static void fail_index(int i) MTL_IMPL({
    char msg[128] = "cooperative tensor element index out of range: index ";
    int n = 0;
    while (msg[n]) n++;
    n = put_int(msg, n, i);
    char mid[] = " >= capacity ";
    for (int j = 0; mid[j]; j++) msg[n++] = mid[j];
    n = put_int(msg, n, capacity);
    msg[n] = 0;
    __mtl_rt_fail(4 /* MTL_E_OUT_OF_BOUNDS */, msg, nullptr, 0);
  })
  static int put_int(thread char* s, int n, int v) {
    if (v < 0) { s[n++] = '-'; v = -v; }
    char d[12];
    int k = 0;
    do { d[k++] = char('0' + v % 10); v /= 10; } while (v && k < 11);
    while (k) s[n++] = d[--k];
    return n;
  }
};

template <class T, int Rows, int Cols>
MTL_INLINE void gather_ct(int layout, bool transposed, MtlCollRec* const* L, const void* MtlCollRec::*field,
                          thread float* m) {
  for (uint l = 0; l < 32; l++) {
    const thread T* e = (const thread T*)(L[l]->*field);
    for (int i = 0; i < Rows * Cols / 32; i++) {
      int r, c;
      ct_coord(layout, l, i, Rows, Cols, transposed, r, c);
      m[r * Cols + c] = (float)e[i];
    }
  }
}

// D = A * B (+ D), accumulated in float with fused multiply-adds along k in
// order (as op_mma), rounded to D's type.
template <unsigned long Desc, class TA, class TB, class TD>
MTL_RUNTIME_SIDE void op_matmul2d(MtlCollRec* const* L, uint32_t) {
  typedef mm_desc<Desc> G;
  int layout = __mtl_rt_tensor_layout();
  float a[G::m * G::k], b[G::k * G::n], d[G::m * G::n];
  gather_ct<TA, G::left_rows, G::left_cols>(layout, G::tl, L, &MtlCollRec::in, a);
  gather_ct<TB, G::right_rows, G::right_cols>(layout, G::tr, L, &MtlCollRec::in2, b);
  if (G::acc) gather_ct<TD, G::m, G::n>(layout, false, L, &MtlCollRec::in3, d);
  for (uint l = 0; l < 32; l++) {
    thread TD* out = (thread TD*)L[l]->out;
    for (int e = 0; e < G::m * G::n / 32; e++) {
      int r, c;
      ct_coord(layout, l, e, G::m, G::n, false, r, c);
      float s = G::acc ? d[r * G::n + c] : 0.0f;
      for (int k = 0; k < G::k; k++) {
        float x = G::tl ? a[k * G::m + r] : a[r * G::k + k];
        float y = G::tr ? b[c * G::k + k] : b[k * G::n + c];
        s = __builtin_fmaf(x, y, s);
      }
      out[e] = (TD)s;
    }
  }
}

namespace mpp {
namespace tensor_ops {

template <unsigned long Desc, class Scope>
struct matmul2d {
  typedef __mtl::mm_desc<Desc> G;
  static_assert(__is_same(Scope, metal::execution_simdgroup),
                "MSL tensor ops: the emulator runs matmul2d on one simdgroup (metal::execution_simdgroup)");
  static_assert(G::m > 0 && G::n > 0 && G::k > 0 && G::m % 16 == 0 && G::n % 16 == 0 && G::k % 16 == 0,
                "MSL tensor ops: matmul2d's m, n and k must be positive multiples of 16 on a simdgroup");
  static_assert(G::m * G::k <= 16384 && G::k * G::n <= 16384 && G::m * G::n <= 16384,
                "MSL tensor ops: the emulator's matmul2d operands hold at most 16384 elements");

  template <class A, class B, class C>
  MTL_INLINE static __mtl::cooperative_tensor<A, G::left_rows, G::left_cols> get_left_input_cooperative_tensor() {
    return {};
  }
  template <class A, class B, class C>
  MTL_INLINE static __mtl::cooperative_tensor<B, G::right_rows, G::right_cols> get_right_input_cooperative_tensor() {
    return {};
  }
  template <class LeftCT, class RightCT, class C>
  MTL_INLINE static __mtl::cooperative_tensor<C, G::m, G::n> get_destination_cooperative_tensor() {
    return {};
  }

  template <class TA, class TB, class TD>
  MTL_INLINE void run(const thread __mtl::cooperative_tensor<TA, G::left_rows, G::left_cols>& a,
                      const thread __mtl::cooperative_tensor<TB, G::right_rows, G::right_cols>& b,
                      thread __mtl::cooperative_tensor<TD, G::m, G::n>& d, __mtl::Site s = {}) const
      MTL_IMPL({
        MtlCollRec r;
        r.fn = &__mtl::op_matmul2d<Desc, TA, TB, TD>;
        r.in = &a.__e;
        r.in2 = &b.__e;
        r.in3 = &d.__e;
        r.out = &d.__e;
        r.arg = (uint64_t)G::m * G::n * G::k;  // multiply-adds, counted by the runtime
        r.file = (const char*)(uintptr_t)s.file;
        r.line = s.line;
        r.col = s.col;
        r.kind = MTL_C_TENSOR_MATMUL;
        __mtl_rt_collective(&r);
      })
};

}  // namespace tensor_ops
}  // namespace mpp
}  // namespace __mtl

namespace metal {
// <metal_logging> (MSL 3.2): shader logging.  The emulator drops the messages.
struct os_log {
  constexpr os_log(const constant char*, const constant char*) constant {}
  constexpr os_log(const constant char*, const constant char*) {}
#define MTL_OS_LOG(AS)                                                              \
  template <class... A> MTL_INLINE void log(const constant char*, A...) const AS {}       \
  template <class... A> MTL_INLINE void log_debug(const constant char*, A...) const AS {} \
  template <class... A> MTL_INLINE void log_info(const constant char*, A...) const AS {}  \
  template <class... A> MTL_INLINE void log_error(const constant char*, A...) const AS {} \
  template <class... A> MTL_INLINE void log_fault(const constant char*, A...) const AS {}
  MTL_EACH_ADDRESS_SPACE(MTL_OS_LOG)
#undef MTL_OS_LOG
};
}  // namespace metal
