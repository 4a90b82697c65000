// The Metal Shading Language as compute kernels use it: the emulator's
// replacement for Apple's metal_stdlib, included first into every kernel
// translation unit (after the text pre-pass).  No host headers.
//
// Kernels are compiled as C++ for OpenCL 2021, where device / threadgroup /
// constant / thread map one-to-one onto clang's __global / __local /
// __constant / __private address spaces (IR address space 0 on the CPU), in
// two passes:
//   rules  (__MTL_RULES__, syntax only) without program-scope globals,
//          double or function pointers, so the compiler itself enforces
//          Metal's address-space rules and restrictions; then once more
//          without a generic address space (__MTL_RULES_THIS__), where
//          `this` and `thread` are __private as in Metal (rules.py takes only
//          those conversions from that pass).  Bodies that call into the
//          runtime exist only in the build (MTL_IMPL).
//   build  the code that runs: a generic address space (objects in any space
//          can be copied and passed on, as Metal allows), function pointers
//          for the runtime glue.  C++ for OpenCL cannot copy a class object
//          out of __constant memory (its implicit copy members take generic
//          references); the rules pass finds each such copy and wraps its
//          source in __mtl::copy (rules.wrap_copies).
#pragma once
#pragma clang system_header

#define __METAL_EMULATOR__ 1
#define MTL_INLINE inline __attribute__((always_inline))

#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define device __global
#define threadgroup __local
// `thread` is the generic address space where there is one: a member
// function's `this`, and the references and pointers it returns, stay
// generic; the rules pass without a generic address space makes it __private
// to check conversions of device / threadgroup / constant data to it.
#ifdef __MTL_RULES_THIS__
#define thread __private
#else
#define thread
#endif
#define constant __constant
// `thread` in a parameter's pointer type (the pre-pass spells it so): explicitly
// generic, so that a template parameter deduces without an address space (`thread T* p` from a
// `thread float*` gives T = float, as in Metal).
#ifdef __MTL_RULES_THIS__
#define __mtl_thread_param __private
#else
#define __mtl_thread_param __generic
#endif
// Member functions of shim types exist for `this` in every address space:
// unqualified (generic; __private without a generic address space) and
// qualified for the spaces a generic `this` does not cover.
#if defined(__MTL_RULES_THIS__)
#define MTL_EACH_WRITABLE_ADDRESS_SPACE(M) M() M(__global) M(__local)
#else
#define MTL_EACH_WRITABLE_ADDRESS_SPACE(M) M()
#endif
#define MTL_EACH_ADDRESS_SPACE(M) MTL_EACH_WRITABLE_ADDRESS_SPACE(M) M(__constant)
#define threadgroup_imageblock __local
#define ray_data __private
#define object_data __global
// Identifiers OpenCL reserves that are ordinary names in MSL.
#define local __mtl_id_local
#define global __mtl_id_global
#define read_only __mtl_id_read_only
#define write_only __mtl_id_write_only
#define read_write __mtl_id_read_write
#define pipe __mtl_id_pipe
#define generic __mtl_id_generic
#define sampler_t __mtl_id_sampler_t
#define event_t __mtl_id_event_t
#define queue_t __mtl_id_queue_t
#define ndrange_t __mtl_id_ndrange_t
#define clk_event_t __mtl_id_clk_event_t
#define reserve_id_t __mtl_id_reserve_id_t
#define vec_step __mtl_id_vec_step
#define image1d_t __mtl_id_image1d_t
#define image1d_array_t __mtl_id_image1d_array_t
#define image1d_buffer_t __mtl_id_image1d_buffer_t
#define image2d_t __mtl_id_image2d_t
#define image2d_array_t __mtl_id_image2d_array_t
#define image2d_depth_t __mtl_id_image2d_depth_t
#define image2d_array_depth_t __mtl_id_image2d_array_depth_t
#define image2d_msaa_t __mtl_id_image2d_msaa_t
#define image2d_array_msaa_t __mtl_id_image2d_array_msaa_t
#define image2d_msaa_depth_t __mtl_id_image2d_msaa_depth_t
#define image2d_array_msaa_depth_t __mtl_id_image2d_array_msaa_depth_t
#define image3d_t __mtl_id_image3d_t
// ... and OpenCL's atomic types, which MSL names differently (metal::atomic_int is atomic<int>).
#define atomic_int __mtl_atomic_int
#define atomic_uint __mtl_atomic_uint
#define atomic_long __mtl_atomic_long
#define atomic_ulong __mtl_atomic_ulong
#define atomic_float __mtl_atomic_float
#define atomic_double __mtl_atomic_double
#define atomic_half __mtl_atomic_half
#define atomic_flag __mtl_atomic_flag
#define atomic_intptr_t __mtl_atomic_intptr_t
#define atomic_uintptr_t __mtl_atomic_uintptr_t
#define atomic_size_t __mtl_atomic_size_t
#define atomic_ptrdiff_t __mtl_atomic_ptrdiff_t

// Function pointers parse everywhere (a function as a template argument is valid Metal);
// one used at run time is found in the IR (emulator/analysis.py) and rejected.
#pragma OPENCL EXTENSION __cl_clang_function_pointers : enable
#ifdef __MTL_RULES__
#define MTL_IMPL(...) ;
#else
#define MTL_IMPL(...) __VA_ARGS__
#endif

#define __MTL_SHIM__ 1
#include "../mtl_abi.h"

// Collective completions run in the scheduler on lane-private data: no access callbacks.
#define MTL_RUNTIME_SIDE __attribute__((noinline, no_sanitize("coverage")))

extern "C" {
void __mtl_rt_collective(MtlCollRec* r);
void* __mtl_rt_tg_alloc(const void* key, uint64_t size, uint64_t align, const char* file, uint32_t line);
int __mtl_rt_atomic(void* addr, int op, int type, const void* val, void* cmp, void* out);
uint32_t __mtl_rt_lane(void);
}

#include "mtl_types.h"

namespace __mtl {

struct Site {
  const __constant char* file = __builtin_FILE();
  unsigned line = __builtin_LINE();
  unsigned col = __builtin_COLUMN();
};

// Any pointer as the runtime's plain void* (address spaces are one memory here).
template <class P>
MTL_INLINE void* raw(P* p) {
  return (void*)(uintptr_t)p;
}

template <class T, class A>
MTL_INLINE T conv(A a) {
  if constexpr (__is_same(T, bool)) return a != A(0);
  else if constexpr (__is_same(T, __mtl_bool_lane)) return T(a != A(0));  // a bool lane
  else return static_cast<T>(a);
}

template <class T, class V, class A>
MTL_INLINE void put(thread V& r, thread int& i, A a) {
  if constexpr (vn<A> == 1) {
    r[i++] = conv<T>(a);
  } else {
    for (int k = 0; k < vn<A>; k++) r[i++] = conv<T>(a[k]);
  }
}

// MSL vector constructors: float4(x) splats, float4(h4) converts,
// float4(f2, z, w) concatenates (the pre-pass rewrites them to this).
template <class T, int N, class... A>
MTL_INLINE vec_of<T, N> make_vec(A... a) {
  typedef vec_of<T, N> V;
  typedef elem_t<V> E;
  if constexpr (sizeof...(A) == 0) {
    return V(E(0));
  } else if constexpr (sizeof...(A) == 1 && (__is_class(A) && ...)) {
    return V(a...);  // the class's conversion function
  } else if constexpr (sizeof...(A) == 1 && ((vn<A> == 1) && ...)) {
    return V(conv<T>(a...));
  } else {
    static_assert((vn<A> + ...) == N, "vector constructor: the components do not add up to the vector size");
    V r;
    int i = 0;
    (put<T>(r, i, a), ...);
    return r;
  }
}

// `float4 v = {x};`: the initialisers fill the first lanes, the rest are zero (the pre-pass
// rewrites brace initialisers with fewer elements than lanes to this).
template <class T, int N, class... A>
MTL_INLINE vec_of<T, N> brace_vec(A... a) {
  static_assert((vn<A> + ... + 0) <= N, "vector initialiser: more elements than the vector has lanes");
  vec_of<T, N> r = vec_of<T, N>(T(0));
  int i = 0;
  (put<T>(r, i, a), ...);
  return r;
}

// A copy of a class object out of constant memory, which Metal allows and
// C++ for OpenCL cannot express (rules.wrap_copies puts the source of each
// such copy in here); anything else passes through.
template <class T> inline constexpr constant bool in_constant_ = false;
template <class T> inline constexpr constant bool in_constant_<__constant T> = true;
template <class T>
MTL_INLINE decltype(auto) copy(T&& x) {
  typedef metal::remove_reference_t<T> U;
  if constexpr (in_constant_<U>) return __builtin_bit_cast(plain_t<U>, x);
  else return static_cast<T&&>(x);
}

// C-style and functional casts to a template type parameter, (T)x and T(x)
// (the pre-pass rewrites them to this): MSL converts a vector per component,
// where clang would reinterpret its bits.
template <class E> inline constexpr constant bool is_class_arg = __is_class(plain_t<metal::remove_reference_t<E>>);
template <class T, class E, enable_if_t<!is_class_arg<E>, int> = 0>
MTL_INLINE T cast(E e) {  // by value: binds vector elements (v.x) too
  if constexpr (vn<T> > 1 && vn<E> > 1 && !__is_same(elem_t<T>, elem_t<E>)) return make_vec<elem_t<T>, vn<T>>(e);
  else if constexpr (__is_same(T, __mtl_bool_lane)) return conv<T>(e);  // a bool lane converts as bool does
  else return (T)e;
}
template <class T, class E, enable_if_t<is_class_arg<E>, int> = 0>
MTL_INLINE T cast(E&& e) {
  return (T)static_cast<E&&>(e);
}

// A scalar operand wider than the elements of the vector it meets (`slope * h4`, float and
// half4; `0.5 * v` in a template): MSL converts the scalar to the element type, C++ for
// OpenCL rejects it, so the rules pass wraps such a scalar (found by clang's diagnostic) in
// lane(...).  With a scalar (another instantiation of the template) nothing changes.
template <class S> struct Lane {
  S v;
  // `c ? v4 : lane(0.0f)`: the conditional operator converts the scalar to the vector type
  template <class V, enable_if_t<(vn<V> > 1), int> = 0> MTL_INLINE operator V() const { return V(elem_t<V>(v)); }
};
template <class S> MTL_INLINE Lane<S> lane(S s) { return {s}; }
#define MTL_LANE_OP(op)                                                                     \
  template <class S, class V> MTL_INLINE auto operator op(Lane<S> a, V b) {                \
    if constexpr (vn<V> > 1) return elem_t<V>(a.v) op b; else return a.v op b;             \
  }                                                                                         \
  template <class S, class V> MTL_INLINE auto operator op(V b, Lane<S> a) {                \
    if constexpr (vn<V> > 1) return b op elem_t<V>(a.v); else return b op a.v;             \
  }
MTL_LANE_OP(+) MTL_LANE_OP(-) MTL_LANE_OP(*) MTL_LANE_OP(/) MTL_LANE_OP(%)
MTL_LANE_OP(==) MTL_LANE_OP(!=) MTL_LANE_OP(<) MTL_LANE_OP(>) MTL_LANE_OP(<=) MTL_LANE_OP(>=)
#undef MTL_LANE_OP

// T(x, y) with T a template type parameter: a vector constructor when T is a vector (clang
// would take it as a scalar initialiser), the class's constructor otherwise.
template <class T, class... A>
MTL_INLINE T construct(A&&... a) {
  if constexpr (vn<T> > 1) return make_vec<elem_t<T>, vn<T>>(a...);
  else return T(static_cast<A&&>(a)...);
}

// threadgroup variables declared in a function body: one object per
// threadgroup.  key = {sizeof, alignof}, a function-local static (one per
// template instantiation); the pre-pass emits the declaration.
template <class T>
MTL_INLINE threadgroup T& tg_var(const constant unsigned long* key, Site s = {})
    MTL_IMPL({
      return *(threadgroup T*)(uintptr_t)__mtl_rt_tg_alloc(raw(key), key[0], key[1], (const char*)(uintptr_t)s.file, s.line);
    })

// Completes a collective for the active lanes (a free function: C++ for
// OpenCL gives static member functions an address-space qualifier).
template <class Op, class T>
MTL_RUNTIME_SIDE void complete(MtlCollRec* const* L, uint32_t m) {
  Op::template run<T>(L, m);
}

// A simd collective: Op::template run<T> completes it for the lanes that wait
// at the same call site (Op = void: a barrier).
template <class Op, class T>
MTL_INLINE T collective(T x, uint64_t arg, const thread Site& s, int kind = MTL_C_SIMD,
                        const thread void* in2 = nullptr)
    MTL_IMPL({
      T out;
      MtlCollRec r;
      if constexpr (__is_same(Op, void)) r.fn = nullptr;  // a barrier: nothing to compute
      else r.fn = &complete<Op, T>;
      r.in = &x;
      r.out = &out;
      r.arg = arg;
      r.in2 = in2;
      r.in3 = nullptr;
      r.file = (const char*)(uintptr_t)s.file;
      r.line = s.line;
      r.col = s.col;
      r.kind = kind;
      __mtl_rt_collective(&r);
      return out;
    })

template <class T> MTL_INLINE const thread T& in(MtlCollRec* const* L, int l) { return *(const thread T*)L[l]->in; }
template <class T> MTL_INLINE thread T& out(MtlCollRec* const* L, int l) { return *(thread T*)L[l]->out; }
template <class T> MTL_INLINE T vmax(T a, T b) {
  if constexpr (vn<T> == 1) return a > b ? a : b;
  else { T r; for (int k = 0; k < vn<T>; k++) r[k] = a[k] > b[k] ? a[k] : b[k]; return r; }
}
template <class T> MTL_INLINE T vmin(T a, T b) {
  if constexpr (vn<T> == 1) return a < b ? a : b;
  else { T r; for (int k = 0; k < vn<T>; k++) r[k] = a[k] < b[k] ? a[k] : b[k]; return r; }
}

// Reductions combine lanes as a butterfly tree, like the hardware.
template <int Op>
struct Reduce {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    T v[32];
    bool has[32];
    for (int l = 0; l < 32; l++) { has[l] = (m >> l) & 1; if (has[l]) v[l] = in<T>(L, l); }
    for (int w = 1; w < 32; w *= 2)
      for (int l = 0; l < 32; l += 2 * w) {
        if (!has[l + w]) continue;
        if (!has[l]) { v[l] = v[l + w]; has[l] = true; continue; }
        if constexpr (Op == 0) v[l] = v[l] + v[l + w];
        else if constexpr (Op == 1) v[l] = v[l] * v[l + w];
        else if constexpr (Op == 2) v[l] = vmax(v[l], v[l + w]);
        else if constexpr (Op == 3) v[l] = vmin(v[l], v[l + w]);
        else if constexpr (Op == 4) v[l] = v[l] & v[l + w];
        else if constexpr (Op == 5) v[l] = v[l] | v[l + w];
        else v[l] = v[l] ^ v[l + w];
      }
    for (int l = 0; l < 32; l++)
      if ((m >> l) & 1) out<T>(L, l) = v[0];
  }
};

template <int Op, bool Inclusive>
struct Prefix {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    T acc = T(Op == 0 ? 0 : 1);
    for (int l = 0; l < 32; l++) {
      if (!((m >> l) & 1)) continue;
      T x = in<T>(L, l);
      if (!Inclusive) out<T>(L, l) = acc;
      acc = Op == 0 ? acc + x : acc * x;
      if (Inclusive) out<T>(L, l) = acc;
    }
  }
};

// Shuffles: Mode 0 absolute lane, 1 xor, 2 up, 3 down, 4 rotate up, 5 rotate down,
// 6 first active lane.  Width 32 = simdgroup, 4 = quadgroup.
template <int Mode, int Width>
struct Shuffle {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    int first = __builtin_ctz(m);
    T vals[32];
    for (int l = 0; l < 32; l++)
      if ((m >> l) & 1) vals[l] = in<T>(L, l);
    for (int l = 0; l < 32; l++) {
      if (!((m >> l) & 1)) continue;
      int base = l / Width * Width, q = l % Width;
      long a = (long)L[l]->arg, src;
      if (Mode == 0) src = base + (a % Width);
      else if (Mode == 1) src = base + ((q ^ a) & (Width - 1));
      else if (Mode == 2) src = q - a >= 0 ? l - a : l;
      else if (Mode == 3) src = q + a < Width ? l + a : l;
      else if (Mode == 4) src = base + ((q - a) % Width + Width) % Width;
      else if (Mode == 5) src = base + (q + a) % Width;
      else src = first;
      out<T>(L, l) = (src >= 0 && src < 32 && ((m >> src) & 1)) ? vals[src] : vals[l];
    }
  }
};

// simd_shuffle_and_fill_{up,down}: lanes past the edge of each group of
// `modulo` lanes read the filling value instead (arg = delta | modulo << 16).
template <bool Down>
struct Fill {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    T vals[32], fill[32];
    for (int l = 0; l < 32; l++)
      if ((m >> l) & 1) { vals[l] = in<T>(L, l); fill[l] = *(const thread T*)L[l]->in2; }
    for (int l = 0; l < 32; l++) {
      if (!((m >> l) & 1)) continue;
      int delta = (int)(L[l]->arg & 0xFFFF), mod = (int)(L[l]->arg >> 16);
      if (mod <= 0 || mod > 32) mod = 32;
      int base = l / mod * mod, q = l % mod;
      int src = Down ? q + delta : q - delta;
      bool inside = Down ? src < mod : src >= 0;
      int s = inside ? base + src : base + (Down ? src - mod : src + mod);
      const thread T* from = inside ? vals : fill;
      out<T>(L, l) = (s >= 0 && s < 32 && ((m >> s) & 1)) ? from[s] : vals[l];
    }
  }
};

// Quad reductions over each group of four lanes.
template <int Op>
struct QuadReduce {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    for (int q = 0; q < 32; q += 4) {
      bool any = false;
      T acc{};
      for (int l = q; l < q + 4; l++) {
        if (!((m >> l) & 1)) continue;
        T x = in<T>(L, l);
        if (!any) { acc = x; any = true; continue; }
        acc = Op == 0 ? acc + x : Op == 2 ? vmax(acc, x) : Op == 3 ? vmin(acc, x) : acc * x;
      }
      for (int l = q; l < q + 4; l++)
        if ((m >> l) & 1) out<T>(L, l) = acc;
    }
  }
};

// Votes: Op 0 ballot, 1 all, 2 any, 3 is_first, 4 active mask
template <int Op>
struct Vote {
  template <class T>
  MTL_RUNTIME_SIDE static void run(MtlCollRec* const* L, uint32_t m) {
    uint64_t ballot = 0;
    for (int l = 0; l < 32; l++)
      if (((m >> l) & 1) && in<T>(L, l) != 0) ballot |= 1ul << l;
    int first = __builtin_ctz(m);
    for (int l = 0; l < 32; l++) {
      if (!((m >> l) & 1)) continue;
      uint64_t r;
      if (Op == 0) r = ballot;
      else if (Op == 1) r = ballot == (uint64_t)m;
      else if (Op == 2) r = ballot != 0;
      else if (Op == 3) r = l == first;
      else r = m;
      out<T>(L, l) = r;
    }
  }
};

template <class T> constexpr int type_code() {
  using U = plain_t<T>;
  if constexpr (__is_same(U, bool)) return MTL_T_BOOL;
  else if constexpr (__is_same(U, float)) return MTL_T_FLOAT;
  else if constexpr (__is_same(U, half)) return MTL_T_HALF;
  else if constexpr (__is_same(U, bfloat)) return MTL_T_BFLOAT;
  else if constexpr (__is_floating_point(U)) return MTL_T_DOUBLE;
  else if constexpr (__is_integral(U)) return __is_signed(U) ? MTL_T_SINT : MTL_T_UINT;
  else return MTL_T_OTHER;
}

}  // namespace __mtl

// ---------------------------------------------------------------- what the pre-pass emits
// threadgroup T name[dims]; in a function body -> one object per threadgroup
#define MTL_THREADGROUP_VAR(key, name, ...)                                                            \
  static constexpr constant unsigned long key[2] = {sizeof(__VA_ARGS__), alignof(__VA_ARGS__)};    \
  auto& name = __mtl::tg_var<__VA_ARGS__>(key)
// Function constants are set when the pipeline is created: in the rules pass
// they have no initializer (so they are not constant expressions, as in
// Metal), in the build they are globals the launch sets.
#ifdef __MTL_RULES__
#define MTL_FUNCTION_CONSTANT(T, name) extern constant T name; extern constant bool __mtl_fcdef_##name
#define MTL_DERIVED_CONSTANT(T, name, ...) \
  extern constant T name;                  \
  inline T __mtl_derived_##name() { return T(__VA_ARGS__); }
#else
#define MTL_FUNCTION_CONSTANT(T, name) static T name = T(); static bool __mtl_fcdef_##name = false
#define MTL_DERIVED_CONSTANT(T, name, ...) static T name = T()
#endif

#include "mtl_sync.h"
#include "mtl_math.h"
#include "mtl_matrix.h"
#include "mtl_simdgroup_matrix.h"
#include "mtl_tensor_ops.h"
#include "mtl_builtins.h"
#include "mtl_kernel.h"

// `p += c` with a pointer p and a class c converting to an integer (a tile stride held as
// integral_constant<int, 1>): C++ and Metal take the built-in `T*& += ptrdiff_t`, which
// clang's C++ for OpenCL never offers (its candidate's reference drops the pointer
// variable's address space), while `p + c` works.  Global, like the built-in.
template <class P, class C, __mtl::enable_if_t<__is_pointer(P) && __is_class(C) && __is_convertible(C, long), int> = 0>
MTL_INLINE P& operator+=(P& p, C c) { return p = p + c; }
template <class P, class C, __mtl::enable_if_t<__is_pointer(P) && __is_class(C) && __is_convertible(C, long), int> = 0>
MTL_INLINE P& operator-=(P& p, C c) { return p = p - c; }

// ---------------------------------------------------------------- public macros (<metal_config>, <metal_math>)
#define METAL_FUNC inline __attribute__((__always_inline__))
#define METAL_INTERNAL
#define METAL_PURE __attribute__((__pure__))
#define METAL_CONST __attribute__((__const__))
#define METAL_NORETURN __attribute__((__noreturn__))
#define METAL_ALIGN(n) __attribute__((__aligned__(n)))
#define METAL_DEPRECATED(msg) __attribute__((__deprecated__(msg)))
#define METAL_UNAVAILABLE(msg) __attribute__((__unavailable__(msg)))
#define METAL_ENABLE_IF(expr, msg) __attribute__((__enable_if__(expr, msg)))
#define METAL_IMPLICIT
#define METAL_EXPLICIT explicit

#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_E_H ((half)M_E_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LOG10E_H ((half)M_LOG10E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_LN10_H ((half)M_LN10_F)
#define M_PI_H ((half)M_PI_F)
#define M_PI_2_H ((half)M_PI_2_F)
#define M_PI_4_H ((half)M_PI_4_F)
#define M_1_PI_H ((half)M_1_PI_F)
#define M_2_PI_H ((half)M_2_PI_F)
#define M_2_SQRTPI_H ((half)M_2_SQRTPI_F)
#define M_SQRT2_H ((half)M_SQRT2_F)
#define M_SQRT1_2_H ((half)M_SQRT1_2_F)
#define MAXFLOAT 0x1.fffffep+127f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_DIG 6
#define FLT_MANT_DIG 24
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1.0p-126f
#define FLT_EPSILON 0x1.0p-23f
#define FLT_MAX_EXP 128
#define FLT_MIN_EXP -125
#define FLT_RADIX 2
#define MAXHALF ((half)65504.0f)
#define HALF_DIG 3
#define HALF_MANT_DIG 11
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define HUGE_VALH ((half)__builtin_inff())
#define CHAR_BIT 8
#define SCHAR_MAX 127
#define SCHAR_MIN (-128)
#define UCHAR_MAX 255
#define CHAR_MAX SCHAR_MAX
#define CHAR_MIN SCHAR_MIN
#define SHRT_MAX 32767
#define SHRT_MIN (-32768)
#define USHRT_MAX 65535
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define LONG_MAX 0x7fffffffffffffffL
#define LONG_MIN (-0x7fffffffffffffffL - 1)
#define ULONG_MAX 0xfffffffffffffffful

#ifdef __MTL_RULES__
// MSL has no goto; clang would accept it.
#define goto _Pragma("GCC error \"MSL restriction: goto is not supported\"") goto
#endif
