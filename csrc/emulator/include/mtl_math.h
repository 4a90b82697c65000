// MSL math, common, integer, relational and geometric functions.
// half / bfloat are computed in float and rounded once (the emulator's model
// of the GPU's half math); vectors apply the scalar function per component.
#pragma once

namespace metal {
namespace __math {

template <class T> inline constexpr bool __isf = is_floating_point_v<T>;

// Applies f per component for vectors, directly for scalars.
#define MTL_MAP1(expr)                                                        \
  if constexpr (__vt<T>::n > 1) {                                             \
    T r;                                                                       \
    for (int i = 0; i < __vt<T>::n; i++) { __elem_t<T> x = v[i]; r[i] = (expr); } \
    return r;                                                                  \
  } else {                                                                     \
    T x = v;                                                                   \
    return (expr);                                                             \
  }

#define MTL_F1(name, fexpr)                                                                   \
  MTL_INLINE float name(float x) { return fexpr; }                                             \
  MTL_INLINE half name(half x) { return (half)name((float)x); }                                \
  MTL_INLINE bfloat name(bfloat x) { return (bfloat)name((float)x); }                          \
  template <class T, int N> MTL_INLINE vec<T, N> name(vec<T, N> v) {                          \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; i++) r[i] = name((T)v[i]);                                         \
    return r;                                                                                 \
  }

MTL_F1(exp, __builtin_expf(x))
MTL_F1(exp2, __builtin_exp2f(x))
MTL_F1(exp10, __builtin_powf(10.0f, x))
MTL_F1(log, __builtin_logf(x))
MTL_F1(log2, __builtin_log2f(x))
MTL_F1(log10, __builtin_log10f(x))
MTL_F1(sqrt, __builtin_sqrtf(x))
MTL_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
MTL_F1(sin, __builtin_sinf(x))
MTL_F1(cos, __builtin_cosf(x))
MTL_F1(tan, __builtin_tanf(x))
MTL_F1(asin, __builtin_asinf(x))
MTL_F1(acos, __builtin_acosf(x))
MTL_F1(atan, __builtin_atanf(x))
MTL_F1(sinh, __builtin_sinhf(x))
MTL_F1(cosh, __builtin_coshf(x))
MTL_F1(tanh, __builtin_tanhf(x))
MTL_F1(asinh, __builtin_asinhf(x))
MTL_F1(acosh, __builtin_acoshf(x))
MTL_F1(atanh, __builtin_atanhf(x))
MTL_F1(sinpi, __builtin_sinf(x * 3.14159265358979323846f))
MTL_F1(cospi, __builtin_cosf(x * 3.14159265358979323846f))
MTL_F1(tanpi, __builtin_tanf(x * 3.14159265358979323846f))
MTL_F1(floor, __builtin_floorf(x))
MTL_F1(ceil, __builtin_ceilf(x))
MTL_F1(round, __builtin_roundf(x))
MTL_F1(rint, __builtin_rintf(x))
MTL_F1(trunc, __builtin_truncf(x))
MTL_F1(fabs, __builtin_fabsf(x))
MTL_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MTL_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MTL_F1(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x))))
#undef MTL_F1

#define MTL_F2(name, fexpr)                                                                          \
  MTL_INLINE float name(float x, float y) { return fexpr; }                                          \
  MTL_INLINE half name(half x, half y) { return (half)name((float)x, (float)y); }                   \
  MTL_INLINE bfloat name(bfloat x, bfloat y) { return (bfloat)name((float)x, (float)y); }           \
  template <class T, int N> MTL_INLINE vec<T, N> name(vec<T, N> a, vec<T, N> b) {                   \
    vec<T, N> r;                                                                                     \
    for (int i = 0; i < N; i++) r[i] = name((T)a[i], (T)b[i]);                                       \
    return r;                                                                                        \
  }                                                                                                  \
  template <class T, int N> MTL_INLINE vec<T, N> name(vec<T, N> a, type_identity_t<T> b) {          \
    vec<T, N> r;                                                                                     \
    for (int i = 0; i < N; i++) r[i] = name((T)a[i], b);                                             \
    return r;                                                                                        \
  }

MTL_F2(pow, __builtin_powf(x, y))
MTL_F2(powr, __builtin_powf(x, y))
MTL_F2(fmod, __builtin_fmodf(x, y))
MTL_F2(atan2, __builtin_atan2f(x, y))
MTL_F2(copysign, __builtin_copysignf(x, y))
MTL_F2(fdim, __builtin_fdimf(x, y))
MTL_F2(fmin, __builtin_fminf(x, y))
MTL_F2(fmax, __builtin_fmaxf(x, y))
MTL_F2(nextafter, __builtin_nextafterf(x, y))
MTL_F2(step, (y < x ? 0.0f : 1.0f))
MTL_F2(divide, x / y)
#undef MTL_F2

MTL_INLINE float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
MTL_INLINE half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
MTL_INLINE bfloat fma(bfloat a, bfloat b, bfloat c) { return (bfloat)__builtin_fmaf((float)a, (float)b, (float)c); }
template <class T, int N> MTL_INLINE vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = fma((T)a[i], (T)b[i], (T)c[i]);
  return r;
}
template <class T> MTL_INLINE T mad(T a, T b, T c) { return fma(a, b, c); }
MTL_INLINE float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }
MTL_INLINE half ldexp(half x, int e) { return (half)__builtin_ldexpf((float)x, e); }
MTL_INLINE float frexp(float x, thread int& e) { return __builtin_frexpf(x, &e); }
MTL_INLINE float modf(float x, thread float& ip) { return __builtin_modff(x, &ip); }
MTL_INLINE int ilogb(float x) { return __builtin_ilogbf(x); }
MTL_INLINE float sincos(float x, thread float& c) { c = __builtin_cosf(x); return __builtin_sinf(x); }

// min / max / clamp for every scalar and vector type (floats: NaN-ignoring like fmin).
template <class T> MTL_INLINE T __min1(T a, T b) {
  if constexpr (__isf<T>) return (a < b || b != b) ? a : b;
  else return a < b ? a : b;
}
template <class T> MTL_INLINE T __max1(T a, T b) {
  if constexpr (__isf<T>) return (a > b || b != b) ? a : b;
  else return a > b ? a : b;
}
template <class T> MTL_INLINE T min(T a, T b) {
  if constexpr (__vt<T>::n > 1) { T r; for (int i = 0; i < __vt<T>::n; i++) r[i] = __min1<__elem_t<T>>(a[i], b[i]); return r; }
  else return __min1<T>(a, b);
}
template <class T> MTL_INLINE T max(T a, T b) {
  if constexpr (__vt<T>::n > 1) { T r; for (int i = 0; i < __vt<T>::n; i++) r[i] = __max1<__elem_t<T>>(a[i], b[i]); return r; }
  else return __max1<T>(a, b);
}
template <class T, int N> MTL_INLINE vec<T, N> min(vec<T, N> a, type_identity_t<T> b) { return min(a, vec<T, N>(b)); }
template <class T, int N> MTL_INLINE vec<T, N> max(vec<T, N> a, type_identity_t<T> b) { return max(a, vec<T, N>(b)); }
template <class T> MTL_INLINE T min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T> MTL_INLINE T max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T> MTL_INLINE T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
template <class T> MTL_INLINE T fmin3(T a, T b, T c) { return fmin(fmin(a, b), c); }
template <class T> MTL_INLINE T fmax3(T a, T b, T c) { return fmax(fmax(a, b), c); }
template <class T> MTL_INLINE T fmedian3(T a, T b, T c) { return fmax(fmin(a, b), fmin(fmax(a, b), c)); }
template <class T> MTL_INLINE T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, int N> MTL_INLINE vec<T, N> clamp(vec<T, N> x, type_identity_t<T> lo, type_identity_t<T> hi) {
  return clamp(x, vec<T, N>(lo), vec<T, N>(hi));
}
template <class T> MTL_INLINE T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, int N> MTL_INLINE vec<T, N> mix(vec<T, N> x, vec<T, N> y, type_identity_t<T> a) { return x + (y - x) * a; }
template <class T> MTL_INLINE T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}

template <class T> MTL_INLINE T abs(T v) {
  if constexpr (__vt<T>::n > 1) { T r; for (int i = 0; i < __vt<T>::n; i++) r[i] = v[i] < 0 ? -v[i] : v[i]; return r; }
  else if constexpr (__isf<T>) return (T)__builtin_fabsf((float)v);
  else return v < 0 ? (T)-v : v;
}
template <class T> MTL_INLINE T absdiff(T a, T b) { return a > b ? a - b : b - a; }

template <class T> MTL_INLINE auto isnan(T v) { MTL_MAP1(x != x) }
template <class T> MTL_INLINE auto isinf(T v) { MTL_MAP1(__builtin_isinf((float)x) != 0) }
template <class T> MTL_INLINE auto isfinite(T v) { MTL_MAP1(__builtin_isfinite((float)x) != 0) }
template <class T> MTL_INLINE auto signbit(T v) { MTL_MAP1(__builtin_signbit((float)x) != 0) }
template <class T> MTL_INLINE bool isnormal(T x) { return __builtin_isnormal((float)x); }

// integer functions
template <class T> MTL_INLINE T popcount(T v) { MTL_MAP1((__elem_t<T>)__builtin_popcountll((unsigned long long)(make_unsigned_t<__elem_t<T>>)x)) }
template <class T> MTL_INLINE T clz(T v) {
  MTL_MAP1((__elem_t<T>)(x == 0 ? (int)sizeof(x) * 8 : __builtin_clzll((unsigned long long)(make_unsigned_t<__elem_t<T>>)x) - (64 - (int)sizeof(x) * 8)))
}
template <class T> MTL_INLINE T ctz(T v) { MTL_MAP1((__elem_t<T>)(x == 0 ? (int)sizeof(x) * 8 : __builtin_ctzll((unsigned long long)x))) }
template <class T> MTL_INLINE T reverse_bits(T v) {
  MTL_MAP1((__elem_t<T>)(__builtin_bitreverse64((unsigned long long)(make_unsigned_t<__elem_t<T>>)x) >> (64 - sizeof(x) * 8)))
}
template <class T> MTL_INLINE T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 4) return (T)(((long)a * (long)b) >> 32);
  else return (T)(((__int128)a * (__int128)b) >> 64);
}
template <class T> MTL_INLINE T rotate(T v, T n) {
  using U = make_unsigned_t<T>;
  constexpr int B = sizeof(T) * 8;
  U x = (U)v;
  int s = (int)((U)n % B);
  return (T)(s ? (U)((x << s) | (x >> (B - s))) : x);
}
template <class T> MTL_INLINE T hadd(T a, T b) { return (T)(((long)a + (long)b) >> 1); }
template <class T> MTL_INLINE T rhadd(T a, T b) { return (T)(((long)a + (long)b + 1) >> 1); }
template <class T> MTL_INLINE T mul24(T a, T b) { return a * b; }
template <class T> MTL_INLINE T mad24(T a, T b, T c) { return a * b + c; }
template <class T> MTL_INLINE T extract_bits(T x, uint offset, uint bits) {
  using U = make_unsigned_t<T>;
  if (bits == 0) return 0;
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  if constexpr (is_signed_v<T>) {
    int sh = (int)(sizeof(T) * 8 - bits);
    return (T)((T)(((U)x >> offset & m) << sh) >> sh);
  } else {
    return (T)((U)x >> offset & m);
  }
}
template <class T> MTL_INLINE T insert_bits(T base, T ins, uint offset, uint bits) {
  using U = make_unsigned_t<T>;
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  return (T)(((U)base & ~(m << offset)) | (((U)ins & m) << offset));
}

// relational
template <class T> MTL_INLINE bool all(T v) {
  if constexpr (__vt<T>::n > 1) { for (int i = 0; i < __vt<T>::n; i++) if (!v[i]) return false; return true; }
  else return (bool)v;
}
template <class T> MTL_INLINE bool any(T v) {
  if constexpr (__vt<T>::n > 1) { for (int i = 0; i < __vt<T>::n; i++) if (v[i]) return true; return false; }
  else return (bool)v;
}
template <class T, class C> MTL_INLINE T select(T a, type_identity_t<T> b, C c) {
  if constexpr (__vt<T>::n > 1) {
    T r;
    for (int i = 0; i < __vt<T>::n; i++) {
      bool ci;
      if constexpr (__vt<C>::n > 1) ci = c[i] != 0; else ci = (bool)c;
      r[i] = ci ? b[i] : a[i];
    }
    return r;
  } else {
    return c ? b : a;
  }
}

// geometric
template <class T, int N> MTL_INLINE T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += (T)a[i] * (T)b[i];
  return s;
}
template <class T, int N> MTL_INLINE T length(vec<T, N> a) { return sqrt(dot(a, a)); }
template <class T, int N> MTL_INLINE T length_squared(vec<T, N> a) { return dot(a, a); }
template <class T, int N> MTL_INLINE T distance(vec<T, N> a, vec<T, N> b) { return length(a - b); }
template <class T, int N> MTL_INLINE vec<T, N> normalize(vec<T, N> a) { return a * rsqrt(dot(a, a)); }
template <class T> MTL_INLINE vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) {
  return vec<T, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}
#undef MTL_MAP1

}  // namespace __math

using namespace __math;
namespace fast { using namespace ::metal::__math; }
namespace precise { using namespace ::metal::__math; }

}  // namespace metal
