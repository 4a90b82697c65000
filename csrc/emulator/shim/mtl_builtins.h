// Apple's compiler builtins that public Metal code calls directly (MLX's
// bf16_math.h builds its bfloat overloads of metal::exp, simd_sum ... on
// them): `__metal_<function>(args..., fast_math_flag)` for the math
// functions, `__metal_simd_<collective>(...)` and `__metal_get_<built-in>(T())`
// for built-in values.  They are global names, as in Apple's compiler; the
// flag (__METAL_FAST_MATH__, __METAL_PRECISE_MATH__ or
// __METAL_MAYBE_FAST_MATH__, the build's default) chooses the fast or precise
// implementation on the GPU, which compute alike here (docs/emulator.md).
#pragma once
#pragma clang system_header

#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#ifdef __FAST_MATH__
#define __METAL_MAYBE_FAST_MATH__ __METAL_FAST_MATH__
#else
#define __METAL_MAYBE_FAST_MATH__ __METAL_PRECISE_MATH__
#endif

// math: the arguments share one floating-point scalar or vector type T
#define MTL_BUILTIN1(name)                                                                  \
  template <typename T, typename = __mtl::op1_t<__mtl::kMath, T>>                          \
  MTL_INLINE T __metal_##name(T x, bool = false) { return metal::name(x); }
#define MTL_BUILTIN2(name)                                                                  \
  template <typename T, typename = __mtl::op1_t<__mtl::kMath, T>>                          \
  MTL_INLINE T __metal_##name(T x, T y, bool = false) { return metal::name(x, y); }
#define MTL_BUILTIN3(name)                                                                  \
  template <typename T, typename = __mtl::op1_t<__mtl::kMath, T>>                          \
  MTL_INLINE T __metal_##name(T x, T y, T z, bool = false) { return metal::name(x, y, z); }
MTL_BUILTIN1(exp) MTL_BUILTIN1(exp2) MTL_BUILTIN1(exp10) MTL_BUILTIN1(log) MTL_BUILTIN1(log2)
MTL_BUILTIN1(log10) MTL_BUILTIN1(sqrt) MTL_BUILTIN1(rsqrt) MTL_BUILTIN1(sin) MTL_BUILTIN1(cos)
MTL_BUILTIN1(tan) MTL_BUILTIN1(asin) MTL_BUILTIN1(acos) MTL_BUILTIN1(atan) MTL_BUILTIN1(sinh)
MTL_BUILTIN1(cosh) MTL_BUILTIN1(tanh) MTL_BUILTIN1(asinh) MTL_BUILTIN1(acosh) MTL_BUILTIN1(atanh)
MTL_BUILTIN1(sinpi) MTL_BUILTIN1(cospi) MTL_BUILTIN1(tanpi) MTL_BUILTIN1(asinpi) MTL_BUILTIN1(acospi)
MTL_BUILTIN1(atanpi) MTL_BUILTIN1(floor) MTL_BUILTIN1(ceil) MTL_BUILTIN1(round) MTL_BUILTIN1(rint)
MTL_BUILTIN1(trunc) MTL_BUILTIN1(fabs) MTL_BUILTIN1(fract) MTL_BUILTIN1(saturate) MTL_BUILTIN1(sign)
MTL_BUILTIN2(pow) MTL_BUILTIN2(powr) MTL_BUILTIN2(fmod) MTL_BUILTIN2(atan2) MTL_BUILTIN2(atan2pi)
MTL_BUILTIN2(copysign) MTL_BUILTIN2(fdim) MTL_BUILTIN2(fmin) MTL_BUILTIN2(fmax) MTL_BUILTIN2(nextafter)
MTL_BUILTIN2(step) MTL_BUILTIN2(divide)
MTL_BUILTIN3(fma) MTL_BUILTIN3(mad) MTL_BUILTIN3(fmin3) MTL_BUILTIN3(fmax3) MTL_BUILTIN3(fmedian3)
MTL_BUILTIN3(mix) MTL_BUILTIN3(smoothstep)
#undef MTL_BUILTIN1
#undef MTL_BUILTIN2
#undef MTL_BUILTIN3
template <typename T, typename = __mtl::op1_t<__mtl::kMath, T>>
MTL_INLINE T __metal_ldexp(T x, int k, bool = false) { return metal::ldexp(x, k); }
template <typename T, typename = __mtl::op1_t<__mtl::kMath, T>>
MTL_INLINE T __metal_frexp(T x, thread int* e) { return metal::frexp(x, *e); }

// simd collectives (the call site is the caller's: see mtl_sync.h)
#define MTL_BUILTIN_SIMD(name)                                                              \
  template <typename T> MTL_INLINE T __metal_##name(T x, __mtl::Site s = {}) { return metal::name(x, s); }
MTL_BUILTIN_SIMD(simd_sum) MTL_BUILTIN_SIMD(simd_product) MTL_BUILTIN_SIMD(simd_max) MTL_BUILTIN_SIMD(simd_min)
MTL_BUILTIN_SIMD(simd_prefix_inclusive_sum) MTL_BUILTIN_SIMD(simd_prefix_exclusive_sum)
MTL_BUILTIN_SIMD(simd_prefix_inclusive_product) MTL_BUILTIN_SIMD(simd_prefix_exclusive_product)
MTL_BUILTIN_SIMD(simd_broadcast_first)
#undef MTL_BUILTIN_SIMD
// the bitwise ones take any type (on its bits)
namespace __mtl {
template <int S> struct uint_of_ { typedef uint type; };
template <> struct uint_of_<1> { typedef uchar type; };
template <> struct uint_of_<2> { typedef ushort type; };
template <> struct uint_of_<8> { typedef ulong type; };
template <int S> using uint_of = typename uint_of_<S>::type;
}  // namespace __mtl
#define MTL_BUILTIN_BITWISE(name)                                                           \
  template <typename T> MTL_INLINE T __metal_##name(T x, __mtl::Site s = {}) {             \
    if constexpr (__is_integral(__mtl::elem_t<T>)) return metal::name(x, s);               \
    else {                                                                                 \
      typedef __mtl::vec_of<__mtl::uint_of<sizeof(__mtl::elem_t<T>)>, __mtl::vn<T>> U;     \
      return __builtin_bit_cast(T, metal::name(__builtin_bit_cast(U, x), s));              \
    }                                                                                      \
  }
MTL_BUILTIN_BITWISE(simd_and) MTL_BUILTIN_BITWISE(simd_or) MTL_BUILTIN_BITWISE(simd_xor)
#undef MTL_BUILTIN_BITWISE
#define MTL_BUILTIN_SHUFFLE(name)                                                           \
  template <typename T> MTL_INLINE T __metal_##name(T x, ushort arg, __mtl::Site s = {}) { \
    return metal::name(x, arg, s);                                                         \
  }
MTL_BUILTIN_SHUFFLE(simd_shuffle) MTL_BUILTIN_SHUFFLE(simd_broadcast) MTL_BUILTIN_SHUFFLE(simd_shuffle_xor)
MTL_BUILTIN_SHUFFLE(simd_shuffle_up) MTL_BUILTIN_SHUFFLE(simd_shuffle_down)
MTL_BUILTIN_SHUFFLE(simd_shuffle_rotate_up) MTL_BUILTIN_SHUFFLE(simd_shuffle_rotate_down)
MTL_BUILTIN_SHUFFLE(quad_shuffle) MTL_BUILTIN_SHUFFLE(quad_broadcast) MTL_BUILTIN_SHUFFLE(quad_shuffle_xor)
MTL_BUILTIN_SHUFFLE(quad_shuffle_up) MTL_BUILTIN_SHUFFLE(quad_shuffle_down)
#undef MTL_BUILTIN_SHUFFLE
template <typename T>
MTL_INLINE T __metal_simd_shuffle_and_fill_down(T x, T fill, ushort delta, ushort modulo, __mtl::Site s = {}) {
  return metal::simd_shuffle_and_fill_down(x, fill, delta, modulo, s);
}
template <typename T>
MTL_INLINE T __metal_simd_shuffle_and_fill_up(T x, T fill, ushort delta, ushort modulo, __mtl::Site s = {}) {
  return metal::simd_shuffle_and_fill_up(x, fill, delta, modulo, s);
}

// built-in values, typed by a dummy argument: __metal_get_simdgroup_size(ushort())
template <typename T>
MTL_INLINE T __metal_get_thread_index_in_simdgroup(T) { return T(__mtl_rt_lane()); }
template <typename T>
MTL_INLINE T __metal_get_simdgroup_size(T) { return T(32); }
template <typename T>
MTL_INLINE T __metal_get_threads_per_simdgroup(T) { return T(32); }
