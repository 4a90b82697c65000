// Math, common, integer, relational and geometric functions (<metal_math>,
// <metal_common>, <metal_integer>, <metal_relational>, <metal_geometric>).
//
// Operand types follow Apple's _*_func_operand_type rules: arguments of one
// type give that type; a vector with scalars gives the vector (the scalars
// are converted); differing scalars are converted to a common type, where an
// unscoped enum counts as its underlying type (min(BK, n - j) with
// enum : uint { BK = 16 }).  Per kind of function:
//   math     (exp, pow, fmin, mix ...): floating types; a float and an
//            integer scalar give the float type;
//   common   (min, max, clamp ...): any arithmetic type; scalars combine by
//            the usual arithmetic conversions;
//   integer  (popcount, rotate, mulhi ...): integer types; an integer and a
//            float scalar give the integer type.
// half / bfloat are computed in float and rounded once (the emulator's model
// of the GPU's half math); vectors apply the scalar function per component.
#pragma once
#pragma clang system_header

namespace __mtl {

template <class T, bool = __is_enum(T)> struct arith_ { typedef T type; };
template <class T> struct arith_<T, true> { typedef __underlying_type(T) type; };
// the type a function argument counts as: cv / address space stripped, enum -> underlying
template <class T> using arith_t = typename arith_<plain_t<T>>::type;

enum Kind { kMath, kCommon, kInteger };
template <class T> inline constexpr constant bool is_num = __is_arithmetic(T);
template <int K, class T> inline constexpr constant bool accepts =
    K == kMath ? __is_floating_point(elem_t<T>) : K == kCommon ? __is_arithmetic(elem_t<T>) : __is_integral(elem_t<T>);

template <class A, class B, bool = __is_floating_point(A) && __is_floating_point(B)>
struct common_scalar { typedef decltype(declval<A>() + declval<B>()) type; };
template <class A, class B> struct common_scalar<A, B, true> { typedef float type; };  // half with float / bfloat

// Two different scalars.
template <int K, class A, class B, class = void> struct scalar2 {};
template <int K, class A, class B>
struct scalar2<K, A, B, enable_if_t<is_num<A> && is_num<B>>> {
  static constexpr constant bool fa = __is_floating_point(A), fb = __is_floating_point(B);
  static constexpr constant bool ok = K == kCommon || (K == kMath ? (fa || fb) : (!fa || !fb));
  // math: the floating one; integer: the integer one; otherwise the common type
  typedef conditional_t<(K == kMath && fa && !fb) || (K == kInteger && !fa && fb), A,
                        conditional_t<(K == kMath && fb && !fa) || (K == kInteger && fa && !fb), B,
                                      typename common_scalar<A, B>::type>> result;
};

template <class A, class B> inline constexpr constant int case2 =
    __is_same(A, B) ? 0 : (vn<A> > 1 && vn<B> == 1) ? 1 : (vn<A> == 1 && vn<B> > 1) ? 2 : (vn<A> == 1) ? 3 : 4;
template <int K, class A, class B, int C = case2<A, B>> struct op2 {};  // case 4: two different vectors
template <int K, class A, class B> struct op2<K, A, B, 0> : enable_if<accepts<K, A>, A> {};
template <int K, class A, class B> struct op2<K, A, B, 1> : enable_if<accepts<K, A> && is_num<B>, A> {};
template <int K, class A, class B> struct op2<K, A, B, 2> : enable_if<accepts<K, B> && is_num<A>, B> {};
template <int K, class A, class B, class = void> struct op2_scalars {};
template <int K, class A, class B>
struct op2_scalars<K, A, B, enable_if_t<scalar2<K, A, B>::ok>> { typedef typename scalar2<K, A, B>::result type; };
template <int K, class A, class B> struct op2<K, A, B, 3> : op2_scalars<K, A, B> {};

// The operand type of a function of kind K on arguments of types A, B (, C);
// no type (SFINAE) when Metal has no such overload.
template <int K, class A, class B> using op2_t = typename op2<K, arith_t<A>, arith_t<B>>::type;
template <int K, class A, class B, class C> using op3_t = op2_t<K, op2_t<K, A, B>, C>;
template <int K, class T> using op1_t = typename enable_if<accepts<K, arith_t<T>>, arith_t<T>>::type;

// Component i of a scalar or vector, and its assignment.
template <class T> MTL_INLINE elem_t<T> at(T v, int i) {
  if constexpr (vn<T> == 1) return v;
  else return v[i];
}
template <class T, class E> MTL_INLINE void set(thread T& v, int i, E x) {
  if constexpr (vn<T> == 1) v = x;
  else v[i] = x;
}

// f per component, computed in float for half / bfloat (f is passed once and
// never copied: C++ for OpenCL without a generic address space cannot copy a
// closure).
template <class T> inline constexpr constant bool via_float = __is_floating_point(T) && !__is_same(T, float);
template <class T, class F>
MTL_INLINE T map(T v, F f) {
  typedef elem_t<T> E;
  T r;
  for (int i = 0; i < vn<T>; i++) {
    if constexpr (via_float<E>) set(r, i, E(f(float(at(v, i)))));
    else set(r, i, E(f(at(v, i))));
  }
  return r;
}
template <class T, class F>
MTL_INLINE T map2(T a, T b, F f) {
  typedef elem_t<T> E;
  T r;
  for (int i = 0; i < vn<T>; i++) {
    if constexpr (via_float<E>) set(r, i, E(f(float(at(a, i)), float(at(b, i)))));
    else set(r, i, E(f(at(a, i), at(b, i))));
  }
  return r;
}
template <class T, class F>
MTL_INLINE T map3(T a, T b, T c, F f) {
  typedef elem_t<T> E;
  T r;
  for (int i = 0; i < vn<T>; i++) {
    if constexpr (via_float<E>) set(r, i, E(f(float(at(a, i)), float(at(b, i)), float(at(c, i)))));
    else set(r, i, E(f(at(a, i), at(b, i), at(c, i))));
  }
  return r;
}
// Per-component predicate: bool for scalars, boolN for vectors.
template <class T, class F>
MTL_INLINE vec_of<bool, vn<T>> test(T v, F f) {
  vec_of<bool, vn<T>> r;
  for (int i = 0; i < vn<T>; i++) set(r, i, (bool)f(float(at(v, i))));
  return r;
}
template <class T> MTL_INLINE T fmin1(T a, T b) { return (a < b || b != b) ? a : b; }
template <class T> MTL_INLINE T fmax1(T a, T b) { return (a > b || b != b) ? a : b; }

}  // namespace __mtl

namespace metal {

// ---------------------------------------------------------------- math (floating point)
#define MTL_MATH1(name, expr)                                                               \
  template <typename T, typename O = __mtl::op1_t<__mtl::kMath, T>>                       \
  MTL_INLINE O name(T x) {                                                                 \
    return __mtl::map(O(x), [](auto x) { return expr; });                                  \
  }
MTL_MATH1(exp, __builtin_expf(x))
MTL_MATH1(exp2, __builtin_exp2f(x))
MTL_MATH1(exp10, __builtin_powf(10.0f, x))
MTL_MATH1(log, __builtin_logf(x))
MTL_MATH1(log2, __builtin_log2f(x))
MTL_MATH1(log10, __builtin_log10f(x))
MTL_MATH1(sqrt, __builtin_sqrtf(x))
MTL_MATH1(rsqrt, 1.0f / __builtin_sqrtf(x))
MTL_MATH1(sin, __builtin_sinf(x))
MTL_MATH1(cos, __builtin_cosf(x))
MTL_MATH1(tan, __builtin_tanf(x))
MTL_MATH1(asin, __builtin_asinf(x))
MTL_MATH1(acos, __builtin_acosf(x))
MTL_MATH1(atan, __builtin_atanf(x))
MTL_MATH1(sinh, __builtin_sinhf(x))
MTL_MATH1(cosh, __builtin_coshf(x))
MTL_MATH1(tanh, __builtin_tanhf(x))
MTL_MATH1(asinh, __builtin_asinhf(x))
MTL_MATH1(acosh, __builtin_acoshf(x))
MTL_MATH1(atanh, __builtin_atanhf(x))
MTL_MATH1(sinpi, __builtin_sinf(x * 3.14159265358979323846f))
MTL_MATH1(cospi, __builtin_cosf(x * 3.14159265358979323846f))
MTL_MATH1(tanpi, __builtin_tanf(x * 3.14159265358979323846f))
MTL_MATH1(asinpi, __builtin_asinf(x) * 0.318309886183790671538f)
MTL_MATH1(acospi, __builtin_acosf(x) * 0.318309886183790671538f)
MTL_MATH1(atanpi, __builtin_atanf(x) * 0.318309886183790671538f)
MTL_MATH1(floor, __builtin_floorf(x))
MTL_MATH1(ceil, __builtin_ceilf(x))
MTL_MATH1(round, __builtin_roundf(x))
MTL_MATH1(rint, __builtin_rintf(x))
MTL_MATH1(trunc, __builtin_truncf(x))
MTL_MATH1(fabs, __builtin_fabsf(x))
MTL_MATH1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MTL_MATH1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MTL_MATH1(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x))))
#undef MTL_MATH1

#define MTL_MATH2(name, expr)                                                               \
  template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kMath, T, U>>         \
  MTL_INLINE O name(T x, U y) {                                                            \
    return __mtl::map2(O(x), O(y), [](auto x, auto y) { return expr; });                   \
  }
MTL_MATH2(pow, __builtin_powf(x, y))
MTL_MATH2(powr, __builtin_powf(x, y))
MTL_MATH2(fmod, __builtin_fmodf(x, y))
MTL_MATH2(atan2, __builtin_atan2f(x, y))
MTL_MATH2(atan2pi, __builtin_atan2f(x, y) * 0.318309886183790671538f)
MTL_MATH2(copysign, __builtin_copysignf(x, y))
MTL_MATH2(fdim, __builtin_fdimf(x, y))
MTL_MATH2(fmin, __mtl::fmin1(x, y))
MTL_MATH2(fmax, __mtl::fmax1(x, y))
MTL_MATH2(nextafter, __builtin_nextafterf(x, y))
MTL_MATH2(step, (y < x ? decltype(x)(0) : decltype(x)(1)))
MTL_MATH2(divide, x / y)
#undef MTL_MATH2

#define MTL_MATH3(name, expr)                                                                \
  template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kMath, T, U, V>> \
  MTL_INLINE O name(T a, U b, V c) {                                                        \
    return __mtl::map3(O(a), O(b), O(c), [](auto a, auto b, auto c) { return expr; });     \
  }
MTL_MATH3(fma, __builtin_fmaf(a, b, c))
MTL_MATH3(mad, __builtin_fmaf(a, b, c))
MTL_MATH3(fmin3, __mtl::fmin1(__mtl::fmin1(a, b), c))
MTL_MATH3(fmax3, __mtl::fmax1(__mtl::fmax1(a, b), c))
MTL_MATH3(fmedian3, __mtl::fmax1(__mtl::fmin1(a, b), __mtl::fmin1(__mtl::fmax1(a, b), c)))
#undef MTL_MATH3

template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kMath, T, U, V>>
MTL_INLINE O mix(T x, U y, V a) {
  return O(x) + (O(y) - O(x)) * O(a);
}
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kMath, T, U, V>>
MTL_INLINE O smoothstep(T edge0, U edge1, V x) {
  O t = __mtl::map3(O((O(x) - O(edge0)) / (O(edge1) - O(edge0))), O(0), O(1),
                    [](auto v, auto lo, auto hi) { return __mtl::fmin1(__mtl::fmax1(v, lo), hi); });
  return t * t * (O(3) - O(2) * t);
}
template <typename T, typename E, typename O = __mtl::op1_t<__mtl::kMath, T>>
MTL_INLINE O ldexp(T x, E e) {
  if constexpr (__mtl::vn<O> == 1) return O(__builtin_ldexpf(float(x), int(e)));
  else { O r, v = O(x); for (int i = 0; i < __mtl::vn<O>; i++) r[i] = __mtl::elem_t<O>(__builtin_ldexpf(float(v[i]), int(e[i]))); return r; }
}
template <typename T, typename O = __mtl::op1_t<__mtl::kMath, T>>
MTL_INLINE __mtl::vec_of<int, __mtl::vn<O>> ilogb(T x) {
  if constexpr (__mtl::vn<O> == 1) return __builtin_ilogbf(float(x));
  else { __mtl::vec_of<int, __mtl::vn<O>> r; for (int i = 0; i < __mtl::vn<O>; i++) r[i] = __builtin_ilogbf(float(x[i])); return r; }
}
MTL_INLINE float frexp(float x, thread int& e) { return __builtin_frexpf(x, &e); }
MTL_INLINE half frexp(half x, thread int& e) { return half(__builtin_frexpf(float(x), &e)); }
MTL_INLINE float modf(float x, thread float& ip) { return __builtin_modff(x, &ip); }
MTL_INLINE half modf(half x, thread half& ip) { float i; half f = half(__builtin_modff(float(x), &i)); ip = half(i); return f; }
template <typename T, typename O = __mtl::op1_t<__mtl::kMath, T>>
MTL_INLINE O sincos(T x, thread O& cosval) {
  cosval = cos(O(x));
  return sin(O(x));
}

// ---------------------------------------------------------------- common and integer
template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kCommon, T, U>>
MTL_INLINE O min(T x, U y) {
  return __mtl::map2(O(x), O(y), [](auto a, auto b) {
    if constexpr (__is_floating_point(decltype(a))) return __mtl::fmin1(a, b);
    else return a < b ? a : b;
  });
}
template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kCommon, T, U>>
MTL_INLINE O max(T x, U y) {
  return __mtl::map2(O(x), O(y), [](auto a, auto b) {
    if constexpr (__is_floating_point(decltype(a))) return __mtl::fmax1(a, b);
    else return a > b ? a : b;
  });
}
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kCommon, T, U, V>>
MTL_INLINE O clamp(T x, U minval, V maxval) {
  return min(max(O(x), O(minval)), O(maxval));
}
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kCommon, T, U, V>>
MTL_INLINE O min3(T x, U y, V z) { return min(min(O(x), O(y)), O(z)); }
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kCommon, T, U, V>>
MTL_INLINE O max3(T x, U y, V z) { return max(max(O(x), O(y)), O(z)); }
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kCommon, T, U, V>>
MTL_INLINE O median3(T x, U y, V z) { return max(min(O(x), O(y)), min(max(O(x), O(y)), O(z))); }

template <typename T, typename O = __mtl::op1_t<__mtl::kCommon, T>>
MTL_INLINE O abs(T x) {
  return __mtl::map(O(x), [](auto v) {
    if constexpr (__is_floating_point(decltype(v))) return __builtin_fabsf(v);
    else return v < 0 ? decltype(v)(-v) : v;
  });
}

#define MTL_INT1(name, expr)                                                                \
  template <typename T, typename O = __mtl::op1_t<__mtl::kInteger, T>>                     \
  MTL_INLINE O name(T v) {                                                                 \
    return __mtl::map(O(v), [](auto x) {                                                   \
      typedef decltype(x) E;                                                               \
      typedef make_unsigned_t<E> UE;                                                       \
      constexpr int B = sizeof(E) * 8;                                                     \
      (void)B;                                                                             \
      return E(expr);                                                                      \
    });                                                                                    \
  }
// (`long` is 64-bit; C++ for OpenCL makes `long long` 128-bit)
MTL_INT1(popcount, __builtin_popcountl((ulong)(UE)x))
MTL_INT1(clz, x == 0 ? B : __builtin_clzl((ulong)(UE)x) - (64 - B))
MTL_INT1(ctz, x == 0 ? B : __builtin_ctzl((ulong)(UE)x))
MTL_INT1(reverse_bits, __builtin_bitreverse64((ulong)(UE)x) >> (64 - B))
#undef MTL_INT1

#define MTL_INT2(name, expr)                                                                \
  template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kInteger, T, U>>      \
  MTL_INLINE O name(T x, U y) {                                                            \
    return __mtl::map2(O(x), O(y), [](auto a, auto b) {                                    \
      typedef decltype(a) E;                                                               \
      typedef make_unsigned_t<E> UE;                                                       \
      constexpr int B = sizeof(E) * 8;                                                     \
      (void)B;                                                                             \
      return E(expr);                                                                      \
    });                                                                                    \
  }
MTL_INT2(mulhi, B == 64 ? (long)(((__int128)a * (__int128)b) >> 64) : (long)(((long)a * (long)b) >> B))
MTL_INT2(rotate, ((UE)b % B) ? (UE)(((UE)a << ((UE)b % B)) | ((UE)a >> (B - (UE)b % B))) : (UE)a)
MTL_INT2(hadd, ((__int128)a + (__int128)b) >> 1)
MTL_INT2(rhadd, ((__int128)a + (__int128)b + 1) >> 1)
MTL_INT2(mul24, a * b)
MTL_INT2(absdiff, a > b ? a - b : b - a)
MTL_INT2(addsat, __builtin_add_overflow(a, b, &a) ? (b > 0 ? numeric_limits<E>::max() : numeric_limits<E>::min()) : a)
MTL_INT2(subsat, __builtin_sub_overflow(a, b, &a) ? (b < 0 ? numeric_limits<E>::max() : numeric_limits<E>::min()) : a)
#undef MTL_INT2
template <typename T, typename U, typename V, typename O = __mtl::op3_t<__mtl::kInteger, T, U, V>>
MTL_INLINE O mad24(T a, U b, V c) { return O(a) * O(b) + O(c); }

template <typename T, typename O = __mtl::op1_t<__mtl::kInteger, T>>
MTL_INLINE O extract_bits(T x, uint offset, uint bits) {
  return __mtl::map(O(x), [offset, bits](auto v) {
    typedef decltype(v) E;
    typedef make_unsigned_t<E> UE;
    if (bits == 0) return E(0);
    UE m = bits >= sizeof(E) * 8 ? (UE)~(UE)0 : (UE)(((UE)1 << bits) - 1);
    if constexpr (__is_signed(E)) {
      int sh = (int)(sizeof(E) * 8 - bits);
      return E((E)(((UE)v >> offset & m) << sh) >> sh);
    } else {
      return E((UE)v >> offset & m);
    }
  });
}
template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kInteger, T, U>>
MTL_INLINE O insert_bits(T base, U insert, uint offset, uint bits) {
  return __mtl::map2(O(base), O(insert), [offset, bits](auto b, auto i) {
    typedef decltype(b) E;
    typedef make_unsigned_t<E> UE;
    UE m = bits >= sizeof(E) * 8 ? (UE)~(UE)0 : (UE)(((UE)1 << bits) - 1);
    return E(((UE)b & ~(m << offset)) | (((UE)i & m) << offset));
  });
}

// ---------------------------------------------------------------- relational
#define MTL_TEST(name, expr)                                                                \
  template <typename T, typename O = __mtl::op1_t<__mtl::kMath, T>>                        \
  MTL_INLINE __mtl::vec_of<bool, __mtl::vn<O>> name(T v) {                                 \
    return __mtl::test(O(v), [](float x) -> bool { return expr; });                        \
  }
MTL_TEST(isnan, x != x)
MTL_TEST(isinf, __builtin_isinf(x) != 0)
MTL_TEST(isfinite, __builtin_isfinite(x) != 0)
MTL_TEST(isnormal, __builtin_isnormal(x) != 0)
MTL_TEST(signbit, __builtin_signbit(x) != 0)
#undef MTL_TEST
template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kMath, T, U>>
MTL_INLINE __mtl::vec_of<bool, __mtl::vn<O>> isunordered(T x, U y) { return isnan(O(x)) | isnan(O(y)); }
template <typename T, typename U, typename O = __mtl::op2_t<__mtl::kMath, T, U>>
MTL_INLINE __mtl::vec_of<bool, __mtl::vn<O>> isordered(T x, U y) { return !isunordered(x, y); }

template <typename T>
MTL_INLINE bool all(T v) {
  if constexpr (__mtl::vn<T> > 1) { for (int i = 0; i < __mtl::vn<T>; i++) if (!v[i]) return false; return true; }
  else return (bool)v;
}
template <typename T>
MTL_INLINE bool any(T v) {
  if constexpr (__mtl::vn<T> > 1) { for (int i = 0; i < __mtl::vn<T>; i++) if (v[i]) return true; return false; }
  else return (bool)v;
}
// select(a, b, c): c ? b : a, per component for vectors (c: bool, boolN or a comparison mask)
template <typename T, typename U, typename C, typename O = __mtl::op2_t<__mtl::kCommon, T, U>>
MTL_INLINE O select(T a, U b, C c) {
  if constexpr (__mtl::vn<O> > 1) {
    O r, x = O(a), y = O(b);
    for (int i = 0; i < __mtl::vn<O>; i++) {
      bool ci;
      if constexpr (__mtl::vn<C> > 1) ci = c[i] != 0; else ci = (bool)c;
      r[i] = ci ? y[i] : x[i];
    }
    return r;
  } else {
    return c ? O(b) : O(a);
  }
}

// ---------------------------------------------------------------- geometric
template <typename T, int N>
MTL_INLINE T dot(__mtl::ev<T, N> a, __mtl::ev<T, N> b) {
  float s = 0.0f;
  for (int i = 0; i < N; i++) s += float(a[i]) * float(b[i]);
  return T(s);
}
template <typename T, int N>
MTL_INLINE T length_squared(__mtl::ev<T, N> a) { return dot(a, a); }
template <typename T, int N>
MTL_INLINE T length(__mtl::ev<T, N> a) { return sqrt(dot(a, a)); }
template <typename T, int N>
MTL_INLINE T distance(__mtl::ev<T, N> a, __mtl::ev<T, N> b) { return length(a - b); }
template <typename T, int N>
MTL_INLINE T distance_squared(__mtl::ev<T, N> a, __mtl::ev<T, N> b) {
  return length_squared(a - b);
}
template <typename T, int N>
MTL_INLINE __mtl::ev<T, N> normalize(__mtl::ev<T, N> a) {
  return a * rsqrt(dot(a, a));
}
template <typename T>
MTL_INLINE __mtl::ev<T, 3> cross(__mtl::ev<T, 3> a,
                                                       __mtl::ev<T, 3> b) {
  return __mtl::ev<T, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}

// fast:: and precise:: variants compute like the default ones here (see
// docs/emulator.md: real fast-math ULPs are a blind spot).
#define MTL_FAST_PRECISE(ns)                                                                 \
  namespace ns {                                                                            \
  using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2; \
  using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::sin; using metal::cos; \
  using metal::tan; using metal::asin; using metal::acos; using metal::atan; using metal::sinh; \
  using metal::cosh; using metal::tanh; using metal::asinh; using metal::acosh; using metal::atanh; \
  using metal::sinpi; using metal::cospi; using metal::tanpi; using metal::floor; using metal::ceil; \
  using metal::round; using metal::rint; using metal::trunc; using metal::fabs; using metal::fract; \
  using metal::saturate; using metal::pow; using metal::powr; using metal::fmod; using metal::atan2; \
  using metal::copysign; using metal::fdim; using metal::fmin; using metal::fmax; using metal::divide; \
  using metal::fma; using metal::fmin3; using metal::fmax3; using metal::fmedian3; using metal::clamp; \
  using metal::min; using metal::max; using metal::normalize; using metal::length; using metal::distance; \
  using metal::sincos;                                                                      \
  }
MTL_FAST_PRECISE(fast)
MTL_FAST_PRECISE(precise)
#undef MTL_FAST_PRECISE

}  // namespace metal
